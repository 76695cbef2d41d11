"""The cost model: what a plan costs in time and memory on a given kind of hardware.

Runs no model and starts no process (except ``calibrate``, which benchmarks the machine).
The formulas, their sources and what they leave out are in ``docs/cost_model.md``.

Hardware (``autopar_cost_model.hardware``)
    ``load_preset("h100-sxm")`` or ``load_preset("my.yaml")`` -> ``DevicePreset`` (peak
    FLOP/s per dtype, memory, ``intra_node``/``inter_node`` ``Link``, ``Efficiency``);
    ``list_presets()``; ``save_preset(preset, path)``; ``preset_dirs()``.

Compute (``autopar_cost_model.compute``)
    ``op_time(flops, bytes_moved, dtype, preset)``: roofline seconds;
    ``backward_time``, ``backward_flops`` (matmul: 2x forward), ``peak_flops(preset, dtype)``.

Communication (``autopar_cost_model.collectives``, ``autopar_cost_model.reshard``)
    ``cost = MeshCost(mesh, preset)``; ``cost.all_reduce(nbytes, axes)``, ``all_gather``,
    ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``p2p(nbytes, axis)`` -> seconds;
    ``cost.collective(kind, nbytes, axes)`` -> ``CollectiveCost(time, form, steps)``;
    ``cost.reshard(src, dst, shape, itemsize)`` -> ``Reshard(time, steps)``.

Memory (``autopar_cost_model.memory``)
    ``param_state_bytes(shape, optimizer, precision)``;
    ``model_state_memory(params, mesh, optimizer, precision)`` -> ``autopar_plans.MemoryBreakdown``;
    ``saved_activation_bytes``, ``microbatches_in_flight``, ``activation_memory``,
    ``device_memory``.

Step (``autopar_cost_model.step``)
    ``step_time(compute_s, recompute_s=, inline_comm_s=, tail_comm_s=, stages=, ...)``;
    ``bubble_fraction(p, m, v)``, ``pipeline_time``, ``exposed_gradient_sync``,
    ``exposed_prefetch``, ``mfu``, ``to_estimate`` -> ``autopar_plans.Estimate``.

Reference (``autopar_cost_model.reference``)
    ``gpt_params``, ``gpt_flops_per_iteration``, ``tp_traffic_per_layer``: published forms.

Calibration (``autopar_cost_model.calibrate``, imported on demand: it starts processes)
    ``from autopar_cost_model.calibrate import calibrate``; ``calibrate(name, quick)`` ->
    ``Calibration(preset, notes)``; from the shell, ``autopar calibrate``.
"""

from autopar_cost_model.collectives import (
    COLLECTIVES,
    AxisLink,
    CollectiveCost,
    CollectiveStep,
    MeshCost,
    bus_factor,
    collective_cost,
    ring_steps,
    ring_time,
)
from autopar_cost_model.compute import (
    backward_bytes,
    backward_flops,
    backward_time,
    dtype_key,
    is_compute_bound,
    matmul_flops,
    op_time,
    peak_flops,
)
from autopar_cost_model.hardware import (
    DTYPE_KEYS,
    DevicePreset,
    Efficiency,
    Link,
    dump_preset,
    known_preset_names,
    list_presets,
    load_preset,
    preset_dirs,
    save_preset,
)
from autopar_cost_model.memory import (
    OPTIMIZERS,
    PRECISIONS,
    ParamLayouts,
    PrecisionPolicy,
    activation_memory,
    device_memory,
    microbatches_in_flight,
    model_state_memory,
    optimizer_state_values,
    param_state_bytes,
    saved_activation_bytes,
)
from autopar_cost_model.reference import gpt_flops_per_iteration, gpt_params, tp_traffic_per_layer
from autopar_cost_model.reshard import Reshard, ReshardStep, reshard_cost
from autopar_cost_model.step import (
    StepTime,
    bubble_fraction,
    exposed_gradient_sync,
    exposed_overlap,
    exposed_prefetch,
    mfu,
    pipeline_time,
    step_time,
    to_estimate,
)

__all__ = [
    "COLLECTIVES",
    "DTYPE_KEYS",
    "OPTIMIZERS",
    "PRECISIONS",
    "AxisLink",
    "CollectiveCost",
    "CollectiveStep",
    "DevicePreset",
    "Efficiency",
    "Link",
    "MeshCost",
    "ParamLayouts",
    "PrecisionPolicy",
    "Reshard",
    "ReshardStep",
    "StepTime",
    "activation_memory",
    "backward_bytes",
    "backward_flops",
    "backward_time",
    "bubble_fraction",
    "bus_factor",
    "collective_cost",
    "device_memory",
    "dtype_key",
    "dump_preset",
    "exposed_gradient_sync",
    "exposed_overlap",
    "exposed_prefetch",
    "gpt_flops_per_iteration",
    "gpt_params",
    "is_compute_bound",
    "known_preset_names",
    "list_presets",
    "load_preset",
    "matmul_flops",
    "mfu",
    "microbatches_in_flight",
    "model_state_memory",
    "op_time",
    "optimizer_state_values",
    "param_state_bytes",
    "peak_flops",
    "pipeline_time",
    "preset_dirs",
    "reshard_cost",
    "ring_steps",
    "ring_time",
    "save_preset",
    "saved_activation_bytes",
    "step_time",
    "to_estimate",
    "tp_traffic_per_layer",
]
