"""Trace-time dtype checks: refused exactly where eager refuses and the meta device does not.

The rules of ``autopar_passes.dtype_check`` are brute-forced against the eager CPU kernels
over every combination of dtypes, as DTensor's ``strategy_validation`` checks its sharding
rules against the unsharded op: a rule never refuses what eager runs, and whatever eager
refuses and the meta kernels let through, a rule refuses.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autopar.cli import EXIT_UNTRACEABLE, main
from autopar_examples.models import build
from autopar_passes.dtype_check import check_dtypes
from autopar_passes.trace import trace
from autopar_plans import UntraceableModelError

aten = torch.ops.aten

ALL = (
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX = (torch.int64, torch.int32, torch.int16, torch.float32, torch.bool)


@dataclass(frozen=True)
class Case:
    """An op, its tensor operands (shape, the dtypes to try) and its other arguments.

    ``args`` lays out the call: an int ``i`` stands for tensor operand ``i``, anything else
    is passed as it is.
    """

    name: str
    op: torch._ops.OpOverload
    tensors: Sequence[tuple[tuple[int, ...], Sequence[torch.dtype]]]
    args: Sequence[Any]


CASES = [
    Case("linear", aten.linear.default, [((2, 3), ALL), ((4, 3), ALL), ((4,), ALL)], [0, 1, 2]),
    Case("matmul", aten.matmul.default, [((2, 2, 3), ALL), ((3, 4), ALL)], [0, 1]),
    Case("mm", aten.mm.default, [((2, 3), ALL), ((3, 4), ALL)], [0, 1]),
    Case("addmm", aten.addmm.default, [((4,), ALL), ((2, 3), ALL), ((3, 4), ALL)], [0, 1, 2]),
    Case("bmm", aten.bmm.default, [((1, 2, 3), ALL), ((1, 3, 4), ALL)], [0, 1]),
    Case("mv", aten.mv.default, [((2, 3), ALL), ((3,), ALL)], [0, 1]),
    Case(
        "conv1d",
        aten.conv1d.default,
        [((1, 2, 5), ALL), ((3, 2, 2), ALL), ((3,), FLOATS)],
        [0, 1, 2],
    ),
    Case("conv2d", aten.conv2d.default, [((1, 2, 4, 4), ALL), ((3, 2, 2, 2), ALL)], [0, 1]),
    Case(
        "conv_transpose1d",
        aten.conv_transpose1d.default,
        [((1, 2, 5), ALL), ((2, 3, 2), ALL)],
        [0, 1],
    ),
    Case(
        "convolution",
        aten.convolution.default,
        [((1, 2, 5), ALL), ((3, 2, 2), ALL), ((3,), FLOATS)],
        [0, 1, 2, [1], [0], [1], False, [0], 1],
    ),
    Case(
        "layer_norm",
        aten.layer_norm.default,
        [((2, 3), ALL), ((3,), ALL), ((3,), FLOATS)],
        [0, [3], 1, 2],
    ),
    Case(
        "group_norm",
        aten.group_norm.default,
        [((2, 4, 3), ALL), ((4,), FLOATS), ((4,), FLOATS)],
        [0, 2, 1, 2],
    ),
    *(
        Case(
            f"batch_norm(training={training})",
            aten.batch_norm.default,
            [((4, 3), ALL), ((3,), FLOATS), ((3,), FLOATS), ((3,), FLOATS), ((3,), FLOATS)],
            [0, 1, 2, 3, 4, training, 0.1, 1e-5, False],
        )
        for training in (True, False)
    ),
    Case("index_select", aten.index_select.default, [((5, 3), ALL), ((2,), INDEX)], [0, 0, 1]),
    Case(
        "index_add",
        aten.index_add.default,
        [((5, 3), FLOATS), ((2,), INDEX), ((2, 3), FLOATS)],
        [0, 0, 1, 2],
    ),
    Case(
        "index_copy",
        aten.index_copy.default,
        [((5, 3), FLOATS), ((2,), INDEX), ((2, 3), FLOATS)],
        [0, 0, 1, 2],
    ),
    Case(
        "index_fill",
        aten.index_fill.int_Tensor,
        [((5, 3), FLOATS), ((2,), INDEX), ((), FLOATS)],
        [0, 0, 1, 2],
    ),
    Case("softmax", aten.softmax.int, [((2, 3), ALL)], [0, -1]),
    Case("softmax(dtype=float32)", aten.softmax.int, [((2, 3), ALL)], [0, -1, torch.float32]),
    Case("log_softmax", aten.log_softmax.int, [((2, 3), ALL)], [0, -1]),
    *(Case(op.__name__, op.default, [((2, 3), ALL)], [0]) for op in (aten.gelu, aten.silu)),
    *(Case(op.__name__, op.default, [((2, 3), ALL)], [0]) for op in (aten.mish, aten.hardswish)),
]


def call(case: Case, tensors: Sequence[Any]) -> list[Any]:
    """The op's arguments, with ``tensors`` in the operands' places."""
    return [tensors[a] if isinstance(a, int) and not isinstance(a, bool) else a for a in case.args]


def raises(case: Case, dtypes: Sequence[torch.dtype], device: str) -> bool:
    """Whether the op raises on tensors of ``dtypes`` on ``device`` (cpu: eager's kernels)."""
    try:
        case.op(*call(case, tensors_of(case, dtypes, device)))
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return True
    return False


def refused(case: Case, dtypes: Sequence[torch.dtype], *, autocast: bool = False) -> bool:
    """Whether ``check_dtypes`` refuses a one-op graph of ``case`` on ``dtypes``."""
    graph = torch.fx.Graph()
    nodes = []
    for i, ((shape, _choices), dtype) in enumerate(zip(case.tensors, dtypes, strict=True)):
        node = graph.placeholder(f"x{i}")
        node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        nodes.append(node)
    graph.call_function(case.op, tuple(call(case, nodes)))
    try:
        check_dtypes(graph, autocast=autocast)
    except UntraceableModelError:
        return True
    return False


def one_integer_dtype(dtypes: Sequence[torch.dtype]) -> bool:
    """Operands of one integer dtype: whether the CPU has a kernel for it (int64 matmuls run,
    int32 transposed convolutions do not) is a matter of kernel coverage, not a mismatch, and
    is left to the device that runs the plan."""
    return len(set(dtypes)) == 1 and not (dtypes[0].is_floating_point or dtypes[0] == torch.bool)


def tensors_of(case: Case, dtypes: Sequence[torch.dtype], device: str) -> list[torch.Tensor]:
    return [
        torch.zeros(shape).to(dtype).to(device)
        for (shape, _choices), dtype in zip(case.tensors, dtypes, strict=True)
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_rules_agree_with_eager(case):
    """Refused implies eager raises; eager raises and meta runs implies refused (but for
    operands of one integer dtype)."""
    wrong_refusals, missed = [], []
    for dtypes in itertools.product(*(choices for _shape, choices in case.tensors)):
        eager = raises(case, dtypes, "cpu")
        meta = raises(case, dtypes, "meta")
        refuses = refused(case, dtypes)
        if refuses and not eager:
            wrong_refusals.append(dtypes)
        if eager and not meta and not refuses and not one_integer_dtype(dtypes):
            missed.append(dtypes)
    assert not wrong_refusals, f"refused, though eager runs them: {wrong_refusals[:5]}"
    assert not missed, f"eager refuses and meta lets through: {missed[:5]}"


MATMUL_CASES = [c for c in CASES if c.name in ("linear", "matmul", "mm", "addmm", "conv1d")]


@pytest.mark.parametrize("case", MATMUL_CASES, ids=lambda case: case.name)
def test_under_autocast_only_what_autocast_refuses_is_refused(case):
    """Autocast casts floating operands to one dtype: mixed floats run, integers do not."""
    wrong = []
    for dtypes in itertools.product(*(choices for _shape, choices in case.tensors)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = raises(case, dtypes, "cpu")
        if refused(case, dtypes, autocast=True) and not eager:
            wrong.append(dtypes)
    assert not wrong, f"refused under autocast, though eager runs them: {wrong[:5]}"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(8, 16)
        self.down_proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_integer_input_into_a_linear_is_refused_naming_module_and_op(device):
    model = Stack().to(device)
    tokens = torch.randint(0, 100, (4, 8))
    with pytest.raises(RuntimeError):
        Stack()(tokens)  # eager refuses it
    with pytest.raises(UntraceableModelError) as error:
        trace(model, (tokens,))
    message = str(error.value)
    assert "module 'layers.0.mlp.up_proj' (Linear)" in message
    assert "aten.linear" in message
    assert "input int64, weight float32" in message
    assert ".float()" in message and "nn.Embedding" in message


def test_float64_input_into_a_float32_linear_is_refused():
    batch = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        Stack()(batch)
    with pytest.raises(UntraceableModelError, match=r"input float64, weight float32") as error:
        trace(Stack().to("meta"), (batch,))
    assert "model.to(dtype)" in str(error.value)


def test_a_mismatch_in_the_models_own_forward_names_the_root():
    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.keys = nn.Parameter(torch.randn(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.half() @ self.keys

    with pytest.raises(UntraceableModelError, match=r"'\(root\)' \(Scores\) calls aten.matmul"):
        trace(Scores(), (torch.randn(2, 8),))


def test_token_ids_into_an_embedding_trace():
    model, inputs = build("gpt-tiny")
    assert inputs[0].dtype == torch.int64
    trace(model, inputs)


def test_a_bf16_model_with_bf16_inputs_traces():
    model = Stack().to(torch.bfloat16)
    batch = torch.randn(4, 8, dtype=torch.bfloat16)
    model(batch)
    trace(model, (batch,))


def test_a_bf16_input_with_fp32_norm_weights_traces():
    """CPU and CUDA norms take a 16-bit input with float32 weights (mixed_type.h)."""
    model = nn.Sequential(nn.LayerNorm(8), nn.GroupNorm(2, 8))
    batch = torch.randn(4, 8).to(torch.bfloat16)
    model[0](batch)
    trace(model[0], (batch,))


def test_mixed_floats_under_autocast_trace():
    model = Stack()
    batch = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch)
        trace(model, (batch,))


def test_an_autocast_block_inside_forward_traces():
    class Autocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.proj(x.to(torch.bfloat16))

    Autocast()(torch.randn(2, 8))
    trace(Autocast(), (torch.randn(2, 8),))


def test_integer_index_ops_and_comparisons_trace():
    class Indexing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(10, 4))

        def forward(self, ids: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
            rows = self.table.index_select(0, ids.flatten()).view(*ids.shape, 4)
            picked = torch.gather(rows, 1, ids[..., None].expand(-1, -1, 4) % 2)
            along = torch.take_along_dim(rows, (ids % 2)[..., None], dim=1)
            mask = (ids < 5) & (small > 0)
            scores = torch.softmax(ids.float() * 0.1, dim=-1) + self.table[ids].sum(-1)
            return torch.where(mask[..., None], picked + along, rows) * scores[..., None]

    ids = torch.randint(0, 10, (2, 3))
    small = torch.randint(-2, 2, (2, 3), dtype=torch.int32)
    Indexing()(ids, small)
    trace(Indexing(), (ids, small))
    trace(Indexing().to("meta"), (ids, small))


def test_the_cli_says_it_in_one_line_with_the_untraceable_exit_code(tmp_path, capsys):
    source = tmp_path / "int_model.py"
    source.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn


            def build(device="cpu"):
                model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).to(device)
                return model, (torch.randint(0, 100, (4, 8)),)
            """
        )
    )
    code = main(["plan", f"{Path(source)}:build", "--mesh", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == EXIT_UNTRACEABLE
    assert "module '0' (Linear) calls aten.linear on input int64, weight float32" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
