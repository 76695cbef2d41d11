"""Which parameters travel in the compute dtype under mixed precision.

FSDP2 gathers parameters in its ``param_dtype`` (``MixedPrecisionPolicy``): half the bytes
of fp32, and the op finds its weight already cast. autopar runs mixed precision as
``torch.autocast`` over fp32 parameters, where an op outside autocast's lower-precision list
(a norm on CPU, an embedding) wants the fp32 weight. So a parameter is gathered cast only
when every op that reads it is one autocast runs in the compute dtype anyway (a matmul's
weight): then the values are those of the single-device autocast run. Norm weights, biases
and embeddings are gathered in fp32. The runtime (``runtime.param_groups``) and the plan's
ledger (``passes.ledger``) both ask this module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from passes.annotation import META_KEY
from passes.trace import TracedModel

# ops autocast runs in the compute dtype, on CPU and CUDA alike (casting every input)
LOW_PRECISION_OPS = frozenset(
    {
        "aten.linear.default",
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.matmul.default",
        "aten.einsum.default",
    }
)
COMPUTE = {"bf16_mixed": torch.bfloat16, "fp16_mixed": torch.float16}
MIXED = tuple(COMPUTE)


def cast_for_gather(traced: TracedModel, precision: str) -> frozenset[str]:
    """The parameters gathered in the compute dtype under ``precision``: those of two dims
    or more every reader of which is a lower-precision op (none unless mixed precision)."""
    if precision not in MIXED:
        return frozenset()
    nodes = {node.name: node for node in traced.graph.nodes}
    found = set()
    for name, info in traced.params.items():
        if len(info.shape) < 2:
            continue
        readers = [user for node in info.nodes for user in nodes[node].users]
        if readers and all(r.meta[META_KEY].op in LOW_PRECISION_OPS for r in readers):
            found.add(name)
    return frozenset(found)


def working_cast_nodes(traced: TracedModel, precision: str) -> frozenset[str]:
    """``cast_for_gather``'s parameters by their placeholders (``CostModel.working_cast``):
    under ZeRO their working copies are held in the compute dtype."""
    cast = cast_for_gather(traced, precision)
    return frozenset(node for name in cast for node in traced.params[name].nodes)


def autocast_dtypes(traced: TracedModel, precision: str) -> dict[str, str]:
    """Each node's output dtype when the model runs under the autocast of ``precision``
    (empty unless mixed precision): one run of the traced graph on fake tensors, so a
    norm's or an embedding's fp32 output is known for what it is, and a matmul's for bf16.

    The run uses CPU autocast's op lists; CUDA's differ in a few ops (its softmax and
    norms return fp32 for bf16 inputs), which the ledger then gets wrong there."""
    compute = COMPUTE.get(precision)
    if compute is None:
        return {}
    values: dict[str, object] = {}
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        torch.no_grad(),
        torch.autocast("cpu", dtype=compute),
    ):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                values[node.name] = (
                    torch.empty(val.shape, dtype=val.dtype)
                    if isinstance(val, torch.Tensor)
                    else val
                )
            elif node.op == "call_function" and node.meta[META_KEY].outputs:
                args, kwargs = torch.fx.node.map_aggregate(
                    (node.args, node.kwargs), _on_cpu(values)
                )
                values[node.name] = node.target(*args, **kwargs)  # type: ignore[operator]
    return {
        name: str(value.dtype).removeprefix("torch.")
        for name, value in values.items()
        if isinstance(value, torch.Tensor)
    }


def _on_cpu(values: dict[str, object]) -> Callable[[object], object]:
    """Arguments for the fake run: nodes by their values, every device the CPU (a model
    planned on ``meta`` names its device in the graph)."""

    def convert(value: object) -> object:
        if isinstance(value, torch.fx.Node):
            return values[value.name]
        if isinstance(value, torch.device):
            return torch.device("cpu")
        return value

    return convert
