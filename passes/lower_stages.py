"""Cut one device's lowered program into the pipeline stages it runs.

A pipeline plan holds one intra-op plan on one stage's mesh (``Plan.stage_mesh``: a block of
``size / pp`` consecutive devices, ``MeshSpec.stage_mesh``) and a list of stages, each a
contiguous range of layers (``Plan.stages``). With interleaving (``chunks`` = v > 1) there
are ``pp * v`` stages and stage ``c`` runs on physical stage ``c % pp``. Physical stage
``s`` owns the global ranks ``[s k, (s + 1) k)`` with ``k`` devices per stage, in the stage
mesh's row-major order, so the rank's coordinates on the stage mesh are those of ``rank - s k``.

The device's program is lowered once on the stage mesh (``autopar_passes.lower_spmd``), then split:

- an op goes to the stage of its layer (``node.meta["autopar"].layer``); an op outside the
  layers that comes before the first layer's first node (embeddings) goes to the first
  stage, one after (final norm, head, loss) to the last, as ``autopar_passes.pipeline.layer_costs``
  costs them; ``getitem`` goes with the op it reads;
- a reshard (local step or collective) goes with its first consumer, so what crosses a cut
  is the producer's local tensor in the producer's layout; the consumer reshards it. The
  intra-op plan is one plan for every stage, so the rank with the same stage-mesh
  coordinates in the next stage expects exactly that piece;
- what depends on no activation (parameters, buffers, constants, and what is computed from
  them alone: a gathered FSDP weight, a position table, a rotary table from ``arange``) is
  *recomputed* in every stage that uses it rather than sent: it is cheap next to a layer,
  keeps activations the only thing on the wire, and makes a weight used by two stages (a
  tied embedding and head) a parameter each of them holds. Their gradients are then summed
  across the stages that hold them (``holders``). Random ops are never recomputed (two
  stages would draw different numbers);
- an activation needed several stages later (a value computed before the layers and used by
  the head) is *passed along*: every stage in between receives it and sends it on
  unchanged. ``torch.distributed.pipelining`` moves tensors between neighbouring stages
  only, and passing along costs one point-to-point per cut, no recomputation;
- user inputs reach every stage as keyword arguments (every rank holds the whole batch), so
  they are never sent.

Each stage becomes a readable ``torch.fx.Graph``: positional inputs are the activations it
receives from the previous stage (none for the first), then every user input by name; the
outputs are what it sends to the next stage (made contiguous for the wire), or for the last
stage the model's outputs.

>>> programs = split_stages(traced, lowered, plan)              # doctest: +SKIP
>>> [(p.index, p.receives, p.sends) for p in programs]          # doctest: +SKIP
[(0, (), ('add_2',)), (1, ('add_2',), ())]
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from autopar_passes.annotation import META_KEY
from autopar_passes.lower_spmd import LoweredGraph
from autopar_passes.trace import TracedModel
from autopar_plans.errors import PlanFileError
from autopar_plans.mesh import MeshSpec
from autopar_plans.plan import Plan


@dataclass
class StageProgram:
    """The program of one pipeline stage (one chunk of layers) on one device."""

    index: int  # the stage's place in the pipeline, 0 .. pp * chunks - 1
    graph: torch.fx.Graph
    receives: tuple[str, ...]  # activations from stage index - 1: the positional inputs
    sends: tuple[str, ...]  # activations to stage index + 1: the outputs (last stage: none)
    user_inputs: tuple[str, ...]  # keyword inputs: every user input, by placeholder name
    returns: tuple[str, ...] = ()  # last stage: the model's flat outputs (lowered names)
    params: dict[str, str] = field(default_factory=dict)  # get_attr target -> param name
    buffers: dict[str, str] = field(default_factory=dict)
    constants: dict[str, str] = field(default_factory=dict)
    collectives: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def code(self) -> str:
        return self.graph.python_code("self").src.strip()


@dataclass(frozen=True)
class PipelinePlace:
    """Where a global rank sits in a pipeline plan."""

    stage: int  # physical stage, 0 .. pp - 1
    coords: tuple[int, ...]  # on the stage mesh
    stages: tuple[int, ...]  # the pipeline stages (chunks) it runs, in order


def stage_mesh(plan: Plan) -> MeshSpec:
    """The mesh the plan's layouts are on: one stage's mesh, or the whole mesh."""
    return plan.stage_mesh or plan.mesh


def pipeline_axis_name(names: Sequence[str]) -> str:
    """The pipeline axis's name: ``pp``, or ``pp_`` ... when a stage axis is called so."""
    name = "pp"
    while name in names:
        name += "_"
    return name


def pipeline_mesh_spec(plan: Plan) -> MeshSpec:
    """The mesh a pipeline plan runs on: ``(pp, *stage mesh)``, the pipeline axis first."""
    inner = stage_mesh(plan)
    return inner.model_copy(
        update={
            "shape": (plan.parallelism.pp, *inner.shape),
            "axis_names": (pipeline_axis_name(inner.axis_names), *inner.axis_names),
        }
    )


def locate(plan: Plan, rank: int) -> PipelinePlace:
    """The physical stage, stage-mesh coordinates and pipeline stages of ``rank``."""
    pp = plan.parallelism.pp
    mesh = stage_mesh(plan)
    per_stage = mesh.size
    stage = rank // per_stage
    count = max(len(plan.stages), 1)
    return PipelinePlace(
        stage,
        mesh.coordinates(rank - stage * per_stage),
        tuple(c for c in range(count) if c % pp == stage),
    )


def stage_of_nodes(traced: TracedModel, plan: Plan) -> dict[str, int]:
    """The pipeline stage of every op of the traced graph (the module docstring's rule)."""
    last = len(plan.stages) - 1
    of_layer: dict[int, int] = {}
    for stage in plan.stages:
        for layer in range(stage.layers[0], stage.layers[1] + 1):
            of_layer[layer] = stage.index
    found: dict[str, int] = {}
    seen_layer = False
    for node in traced.graph.nodes:
        if node.op != "call_function":
            continue
        layer = node.meta[META_KEY].layer
        if layer is not None:
            if layer not in of_layer:
                raise PlanFileError(
                    f"the plan's stages do not cover layer {layer} (op {node.name}); it "
                    "was made for another model"
                )
            seen_layer = True
            found[node.name] = of_layer[layer]
        else:
            found[node.name] = last if seen_layer else 0
    return found


def split_stages(traced: TracedModel, lowered: LoweredGraph, plan: Plan) -> list[StageProgram]:
    """Every pipeline stage's program, cut from one device's lowered program."""
    return _Split(traced, lowered, plan).run()


def holders(programs: list[StageProgram], pp: int) -> dict[str, tuple[int, ...]]:
    """For each parameter, the physical stages whose programs hold it (sorted)."""
    found: dict[str, set[int]] = {}
    for program in programs:
        for name in program.params.values():
            found.setdefault(name, set()).add(program.index % pp)
    return {name: tuple(sorted(stages)) for name, stages in found.items()}


def local_parts(programs: list[StageProgram]) -> dict[str, int]:
    """For each parameter (``get_attr`` target) one rank's ``programs`` read: the position of
    the program that reads it, or -1 when several do (its gradient is complete only after
    all of theirs)."""
    found: dict[str, int] = {}
    for position, program in enumerate(programs):
        for target in program.params:
            found[target] = position if found.get(target, position) == position else -1
    return found


class _Split:
    def __init__(self, traced: TracedModel, lowered: LoweredGraph, plan: Plan) -> None:
        self.lowered = lowered
        self.count = len(plan.stages)
        self.last = self.count - 1
        self.nodes = list(lowered.graph.nodes)
        self.traced_stage = stage_of_nodes(traced, plan)
        self.traced_layer = {
            n.name: n.meta[META_KEY].layer for n in traced.graph.nodes if n.op == "call_function"
        }
        self.static = self._static_nodes()
        self.stage: dict[torch.fx.Node, int] = {}

    # ---- which stage runs what ------------------------------------------------------
    def _static_nodes(self) -> set[torch.fx.Node]:
        """Nodes that depend on no activation and no user input (recomputed where used)."""
        static: set[torch.fx.Node] = set()
        for node in self.nodes:
            if node.op == "get_attr" or (
                node.op in ("call_function", "call_module", "call_method")
                and not _random(node)
                and all(arg in static for arg in node.all_input_nodes)
            ):
                static.add(node)
        return static

    def _place(self) -> None:
        """Stage of every node that runs once (not static, not a user input)."""
        runs = [
            n
            for n in self.nodes
            if n not in self.static and n.op not in ("placeholder", "output", "get_attr")
        ]
        for node in reversed(runs):
            source = self.lowered.sources.get(node)
            consumers = [self._consumer_stage(user) for user in node.users]
            first_use = min((s for s in consumers if s is not None), default=None)
            if source is not None and source in self.traced_stage:
                rule = self.traced_stage[source]
                # outside the layers after them (rule: last) but read earlier: run it there
                after = self.traced_layer.get(source) is None and rule == self.last
                self.stage[node] = min(rule, first_use) if after and first_use is not None else rule
            else:
                self.stage[node] = first_use if first_use is not None else -1
        for node in runs:  # never before what it reads; getitem with the op it reads
            inputs = [self.stage[a] for a in node.all_input_nodes if a in self.stage]
            if node.target is operator.getitem and inputs:
                self.stage[node] = inputs[0]
            else:
                self.stage[node] = max([self.stage[node], *inputs, 0])

    def _consumer_stage(self, user: torch.fx.Node) -> int | None:
        if user.op == "output":
            return self.last
        return self.stage.get(user)

    def _static_uses(self) -> dict[torch.fx.Node, set[int]]:
        """For each static node, the stages that need it."""
        uses: dict[torch.fx.Node, set[int]] = {}
        for node in reversed(self.nodes):
            if node not in self.static:
                continue
            needed: set[int] = set()
            for user in node.users:
                if user.op == "output":
                    needed.add(self.last)
                elif user in self.static:
                    needed |= uses[user]
                else:
                    needed.add(self.stage[user])
            uses[node] = needed
        return uses

    def _crossings(self) -> list[list[torch.fx.Node]]:
        """For each cut c (between stage c and c + 1), the values that cross it."""
        cuts: list[list[torch.fx.Node]] = [[] for _ in range(max(self.count - 1, 0))]
        for node in self.nodes:
            if node not in self.stage:
                continue
            consumers = [self._consumer_stage(u) for u in node.users]
            last_use = max((s for s in consumers if s is not None), default=self.stage[node])
            for cut in range(self.stage[node], last_use):
                cuts[cut].append(node)
        return cuts

    # ---- building the stage graphs --------------------------------------------------
    def run(self) -> list[StageProgram]:
        self._place()
        uses = self._static_uses()
        cuts = self._crossings()
        inputs = [n for n in self.nodes if n.op == "placeholder"]
        programs = []
        for index in range(self.count):
            receives = cuts[index - 1] if index > 0 else []
            sends = cuts[index] if index < self.last else []
            keep = {
                n
                for n in self.nodes
                if self.stage.get(n) == index or (n in self.static and index in uses[n])
            }
            programs.append(self._build(index, receives, sends, inputs, keep))
        # what no stage reads is held by the first (the optimizer and state_dict see it)
        for kind in ("params", "buffers"):
            read = {t for p in programs for t in getattr(p, kind)}
            for target, name in getattr(self.lowered, kind).items():
                if target not in read:
                    getattr(programs[0], kind)[target] = name
        return programs

    def _build(
        self,
        index: int,
        receives: list[torch.fx.Node],
        sends: list[torch.fx.Node],
        inputs: list[torch.fx.Node],
        keep: set[torch.fx.Node],
    ) -> StageProgram:
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in receives:
            env[node] = graph.placeholder(node.name)
        for node in inputs:
            env[node] = graph.placeholder(keyword_name(node.name))
        program = StageProgram(
            index,
            graph,
            tuple(n.name for n in receives),
            (),
            tuple(str(env[n].target) for n in inputs),
        )
        for node in self.nodes:
            if node.op == "output":
                if index == self.last:
                    graph.output(torch.fx.map_arg(node.args[0], lambda a: env[a]))
                    program.returns = tuple(n.name for n in _nodes_in(node.args[0]))
                continue
            if node not in keep or node in env:
                continue
            env[node] = graph.node_copy(node, lambda a: env[a])
            self._record(program, node)
        if index != self.last:
            out = [graph.call_method("contiguous", (env[n],)) for n in sends]
            graph.output(tuple(out))
            program.sends = tuple(n.name for n in sends)
        graph.lint()
        return program

    def _record(self, program: StageProgram, node: torch.fx.Node) -> None:
        lowered = self.lowered
        if node.op == "get_attr":
            target = str(node.target)
            if target in lowered.params:
                program.params[target] = lowered.params[target]
            elif target in lowered.buffers:
                program.buffers[target] = lowered.buffers[target]
            elif target in lowered.constants:
                program.constants[target] = lowered.constants[target]
        elif node.op == "call_module":
            target = str(node.target)
            program.collectives[target] = lowered.collectives[target]


def _nodes_in(value: object) -> list[torch.fx.Node]:
    """The nodes in a (nested) output value, in order."""
    if isinstance(value, torch.fx.Node):
        return [value]
    if isinstance(value, list | tuple):
        return [n for item in value for n in _nodes_in(item)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _nodes_in(item)]
    return []


def keyword_name(name: str) -> str:
    """The keyword a user input takes in a stage program: its own name, unless the pipeline
    schedule's ``step`` takes that keyword itself."""
    return f"{name}_input" if name in _SCHEDULE_KEYWORDS else name


_SCHEDULE_KEYWORDS = frozenset({"target", "losses", "return_outputs", "loss_kwargs"})


def _random(node: torch.fx.Node) -> bool:
    """Whether the op draws random numbers (recomputing it would draw different ones)."""
    target = node.target
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def iter_stage_codes(programs: list[StageProgram]) -> Iterator[str]:
    """Each program's code under a header naming the stage and what crosses its cuts."""
    for program in programs:
        header = (
            f"# pipeline stage {program.index}: receives "
            f"{', '.join(program.receives) or 'nothing'}; sends "
            f"{', '.join(program.sends) or 'nothing (last stage: the outputs)'}"
        )
        yield header + "\n" + program.code
