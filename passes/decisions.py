"""Group the graph's nodes into the ILP's decisions, keeping the problem small.

Two reductions (DESIGN.md, "The solver"), both exact:

- **Followers merge into their producer.** A single-input op that is free (a view, a
  pointwise op without FLOPs) and can take, for every strategy of its producer, a strategy
  whose input is exactly the producer's output layout, follows that producer: it has no
  variable of its own, its strategy is a function of the producer's choice (``mapping``).
  ``getitem`` always follows its producer.
- **Identical layers share one decision.** Each node of a repeated layer takes the decision
  of its representative (``autopar_passes.layer_sharing``); the decision's costs are summed over its
  members. A follower's mapping is relative to its producer's decision, so a follower joins
  its representative only when their producers are represented alike; where they are not
  (the first layer of a class reads the layer before it, of another class, where the
  other copies read a copy of their own class) it is regrouped with the copies whose
  producers match (``Decisions.representatives``), or the copy's sharded input would be
  priced and lowered as the representative's.

Reads ``NodeChoices`` (``autopar_passes.strategies.graph``) and the representatives; writes
``Decision`` (one per ILP one-hot variable group) and ``Binding`` (per node: which decision
it takes and how).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from autopar_passes.strategies.graph import NodeChoices, TensorInput
from autopar_passes.strategies.types import Strategy
from autopar_plans.placement import Layout


@dataclass
class Decision:
    """One one-hot choice of the ILP: ``strategies`` of its ``key`` node, taken by every
    node in ``members`` (the key first) and, through their mappings, by its followers."""

    key: str
    strategies: list[Strategy]
    members: list[str] = field(default_factory=list)
    followers: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Binding:
    """How a node takes its strategy from a decision.

    ``mapping[k]`` is the node's strategy index when the decision takes choice ``k``
    (``None``: the same index, for members). A ``getitem`` node has ``item`` set: its
    layout is output ``item`` of node ``source``.
    """

    decision: str
    mapping: tuple[int, ...] | None = None
    source: str | None = None
    item: int = 0


@dataclass
class Decisions:
    """All decisions and every node's binding, with the lookups the solver needs."""

    choices: dict[str, NodeChoices]
    decisions: dict[str, Decision]
    bindings: dict[str, Binding]
    # placeholder -> the placeholder of the same (tied) parameter that decides for both
    tied: dict[str, str] = field(default_factory=dict)
    # node -> its representative as the bindings take it: the layers' (``layer_sharing``)
    # with followers regrouped where their producers are represented differently; what
    # every sum over identical copies (edge costs, recompute regions) must key on
    representatives: dict[str, str] = field(default_factory=dict)

    def strategy(self, node: str, choice: int) -> Strategy:
        """The strategy ``node`` runs when its decision takes ``choice``."""
        binding = self.bindings[node]
        index = choice if binding.mapping is None else binding.mapping[choice]
        return self.choices[node].strategies[index]

    def output_layout(self, node: str, choice: int, index: int = 0) -> Layout:
        """Layout of output ``index`` of ``node`` when its decision takes ``choice``."""
        binding = self.bindings[node]
        if binding.source is not None:
            return self.output_layout(binding.source, choice, binding.item)
        return self.strategy(node, choice).outputs[index]

    def size(self) -> int:
        return sum(len(d.strategies) for d in self.decisions.values() if len(d.strategies) > 1)

    @cached_property
    def position(self) -> dict[str, int]:
        """Each node's place in the graph's order (``choices`` is in it)."""
        return {name: i for i, name in enumerate(self.choices)}


def group_decisions(
    choices: dict[str, NodeChoices],
    representatives: dict[str, str],
    tied: dict[str, str] | None = None,
) -> Decisions:
    """Bind every node to a decision, merging followers and identical layers.

    ``tied`` maps a parameter placeholder to another placeholder of the same tensor (export
    may give a tied weight one placeholder per name): both take one decision, one layout.
    """
    result = Decisions(choices, {}, {}, dict(tied or {}), dict(representatives))
    regrouped: dict[tuple[str, tuple[str, ...]], str] = {}
    for name, node in choices.items():
        if name in result.tied:
            result.bindings[name] = result.bindings[result.tied[name]]
            continue
        rep = _representative(result, name, regrouped)
        if rep != name:
            _join_representative(result, name, rep)
            continue
        if node.kind == "getitem":
            source = node.inputs[0]
            parent = result.bindings[source.producer]
            result.bindings[name] = Binding(
                parent.decision, source=source.producer, item=source.index
            )
            result.decisions[parent.decision].followers.append(name)
            continue
        mapping = _follow(result, node)
        if mapping is not None:
            producer = result.bindings[node.inputs[0].producer]
            result.bindings[name] = Binding(producer.decision, mapping=mapping)
            result.decisions[producer.decision].followers.append(name)
            continue
        result.decisions[name] = Decision(name, node.strategies, [name])
        result.bindings[name] = Binding(name)
    return result


def _representative(
    result: Decisions, name: str, regrouped: dict[tuple[str, tuple[str, ...]], str]
) -> str:
    """The node whose binding ``name`` takes (``name`` itself: a binding of its own), and
    ``result.representatives`` made to say so. A member joins its layer representative's
    decision whatever its producers (its edges are priced from its own producers); a
    follower or getitem only when its producers are represented as the representative's
    are, else the first copy with its producers' representatives leads a group of its own."""
    reps = result.representatives
    rep = reps.get(name, name)
    if rep == name or rep not in result.bindings:
        return name
    binding = result.bindings[rep]
    if binding.mapping is None and binding.source is None:
        return rep
    mine = tuple(reps.get(s.producer, s.producer) for s in result.choices[name].inputs)
    theirs = tuple(reps.get(s.producer, s.producer) for s in result.choices[rep].inputs)
    if mine == theirs:
        return rep
    leader = regrouped.setdefault((rep, mine), name)
    reps[name] = leader
    return leader


def _join_representative(result: Decisions, name: str, rep: str) -> None:
    """``name`` sits where ``rep`` sits in an identical layer: it takes rep's binding."""
    binding = result.bindings[rep]
    if binding.source is not None:
        # a getitem: same decision, its source is the member at the source's position
        result.bindings[name] = binding  # resolved through the member below
        producer = result.choices[name].inputs[0]
        result.bindings[name] = Binding(
            binding.decision, source=producer.producer, item=producer.index
        )
        result.decisions[binding.decision].followers.append(name)
        return
    result.bindings[name] = binding
    decision = result.decisions[binding.decision]
    if binding.mapping is None and binding.decision == rep:
        decision.members.append(name)
    else:
        decision.followers.append(name)


def _follow(result: Decisions, node: NodeChoices) -> tuple[int, ...] | None:
    """The mapping that makes ``node`` follow its single producer, or None."""
    if node.kind != "op" or len(node.inputs) != 1 or node.note is None:
        return None
    if node.note.kind != "view" and node.note.fwd_flops > 0:
        return None
    source: TensorInput = node.inputs[0]
    producer = result.bindings.get(source.producer)
    if producer is None:
        return None
    decision = result.decisions[producer.decision]
    mapping = []
    for choice in range(len(decision.strategies)):
        layout = result.output_layout(source.producer, choice, source.index)
        matches = [j for j, s in enumerate(node.strategies) if s.inputs[0] == layout]
        if not matches:
            return None
        mapping.append(max(matches, key=lambda j: node.strategies[j].split))
    return tuple(mapping)
