"""The fleet scheduler's inputs and outputs.

A :class:`ScheduleRequest` names the node groups of the fleet (nodes of one make-up, see
:func:`policies.deployment.node_groups`), each deployment's :class:`Demand` and its
candidate engine instances (:class:`Candidate`, what the cost model predicts for a count of
nodes per group), the previous assignment and the namespace quotas. A :class:`Schedule`
says which nodes serve which deployment (:class:`Placement`), which deployments stay
pending and why (:class:`Pending`), and what changed (:class:`Decision`).

Units: GPUs, nodes, tokens per second, microseconds, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: What a deployment's share of the fleet is chosen for.
OBJECTIVES = ("throughput", "cost", "slo")


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one make-up (interchangeable for placement).

    Attributes:
        label: ``8x H100-SXM5-80GB`` (what the nodes carry).
        nodes: node names, fleet order.
        gpus_per_node: GPUs on each node of the group.
        usd_per_node_hour: price of one node at the request's prices, USD per hour.
    """

    label: str
    nodes: tuple[str, ...]
    gpus_per_node: int
    usd_per_node_hour: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """One engine instance of a deployment: ``counts[t]`` nodes of node group ``t``.

    Attributes:
        counts: nodes per node group (the request's group order).
        gpus: GPUs of the instance.
        tokens_per_s: predicted throughput (0 when it cannot run).
        step_time_us: predicted step time (decode: time per output token), us.
        usd_per_hour: price of its GPUs, USD per hour.
        reason: why it cannot run (memory, engine group rules); empty when it can.
    """

    counts: tuple[int, ...]
    gpus: int
    tokens_per_s: float
    step_time_us: float
    usd_per_hour: float
    reason: str = ""

    @property
    def ok(self) -> bool:
        """The instance runs (a plan fits and the engine accepts the group)."""
        return not self.reason and self.tokens_per_s > 0

    @property
    def usd_per_million_tokens(self) -> float:
        """Cost of a million tokens on this instance, USD (inf when it produces nothing)."""
        if self.tokens_per_s <= 0:
            return float("inf")
        return self.usd_per_hour / (self.tokens_per_s * 3600.0) * 1e6


@dataclass(frozen=True)
class Demand:
    """What one deployment asks of the fleet.

    Attributes:
        name: deployment name.
        namespace: quota namespace.
        priority: higher is placed first and may preempt lower.
        min_gpus: fewest GPUs it may run on; 0 = whatever one instance needs.
        max_gpus: most GPUs it may take; 0 = no limit.
        objective: ``throughput`` (tokens per second), ``cost`` (tokens per second weighted
            by tokens per dollar relative to its best instance) or ``slo`` (tokens per second
            of instances whose step time meets ``slo_step_time_us``).
        slo_step_time_us: step-time target of the ``slo`` objective, us; 0 = none.
        memory_fraction: share of each GPU's memory it takes; 1 = the GPU is exclusively its
            own, below 1 it may share a node with others whose fractions fit in the rest.
        eligible: nodes it may use (usable, matching its node selector).
        max_instances: engine instances (replica groups) it may be split into.
    """

    name: str
    eligible: frozenset[str]
    namespace: str = "default"
    priority: int = 0
    min_gpus: int = 0
    max_gpus: int = 0
    objective: str = "throughput"
    slo_step_time_us: float = 0.0
    memory_fraction: float = 1.0
    max_instances: int = 1


@dataclass(frozen=True)
class ScheduleRequest:
    """One fleet-level assignment problem.

    Attributes:
        groups: the fleet's node groups.
        demands: the deployments, any order.
        candidates: deployment name -> its candidate instances.
        previous: deployment name -> nodes it holds now (the move penalty counts changes).
        quotas_gpus: namespace -> most GPUs its deployments may hold together.
        move_weight: cost of moving one node, in units of an average node's value
            (0 = moves are free).
        time_limit_s: wall-clock safety net of the integer program, s.
        max_nodes: branch-and-bound node limit (the work limit that keeps solves repeatable).
    """

    groups: tuple[NodeGroup, ...]
    demands: tuple[Demand, ...]
    candidates: Mapping[str, tuple[Candidate, ...]]
    previous: Mapping[str, frozenset[str]] = field(default_factory=dict)
    quotas_gpus: Mapping[str, int] = field(default_factory=dict)
    move_weight: float = 0.25
    time_limit_s: float = 10.0
    max_nodes: int = 20000


@dataclass(frozen=True)
class Placement:
    """Where one deployment runs.

    Attributes:
        deployment: its name.
        nodes: the nodes it holds, fleet order.
        instances: the engine instances, each a tuple of node names.
        gpus: GPUs held.
        tokens_per_s: predicted throughput of all its instances.
        usd_per_hour: price of its GPUs (times its memory fraction), USD per hour.
        value: its share of the objective (tokens per second, weighted as its objective
            says).
    """

    deployment: str
    nodes: tuple[str, ...]
    instances: tuple[tuple[str, ...], ...]
    gpus: int
    tokens_per_s: float
    usd_per_hour: float
    value: float

    @property
    def usd_per_million_tokens(self) -> float:
        """Cost of a million tokens, USD (inf when it produces nothing)."""
        if self.tokens_per_s <= 0:
            return float("inf")
        return self.usd_per_hour / (self.tokens_per_s * 3600.0) * 1e6


@dataclass(frozen=True)
class Pending:
    """A deployment the fleet cannot serve now (the Unschedulable condition).

    Attributes:
        deployment: its name.
        resource: what is missing: ``gpus``, ``memory``, ``quota``, ``nodes`` (none
            eligible) or ``priority`` (held by higher-priority deployments).
        nodes: the nodes concerned (eligible ones that lack it, or the holders).
        missing: how much is missing, in ``unit``.
        unit: ``GPUs`` or ``GiB``.
        message: the reason in words, with what to do.
    """

    deployment: str
    resource: str
    nodes: tuple[str, ...]
    missing: float
    unit: str
    message: str


@dataclass(frozen=True)
class Decision:
    """One change against the previous assignment, with its reason.

    Attributes:
        deployment: whose assignment changed.
        kind: ``placed`` | ``grown`` | ``shrunk`` | ``moved`` | ``preempted`` | ``pending``
            | ``released``.
        nodes_added: nodes it gains.
        nodes_removed: nodes it gives up.
        reason: why, in words.
    """

    deployment: str
    kind: str
    nodes_added: tuple[str, ...]
    nodes_removed: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Schedule:
    """The fleet's assignment.

    Attributes:
        placements: placed deployments, by name.
        pending: deployments left out, by name.
        decisions: what changed against the request's previous assignment.
        free_nodes: nodes nobody holds.
        objective: the schedule's objective value (higher is better; priorities first).
        nodes_moved: node changes against the previous assignment of running deployments.
        solver: ``HiGHS optimal`` | ``HiGHS work_limit`` | ``first-fit`` (the integer
            program found nothing better) | the baseline's name.
        solve_s: wall-clock time of the integer program, s.
    """

    placements: Mapping[str, Placement]
    pending: Mapping[str, Pending]
    decisions: tuple[Decision, ...]
    free_nodes: tuple[str, ...]
    objective: float
    nodes_moved: int
    solver: str
    solve_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Predicted throughput of every placed deployment together."""
        return sum(p.tokens_per_s for p in self.placements.values())

    @property
    def usd_per_hour(self) -> float:
        """Price of the GPUs placed deployments hold, USD per hour."""
        return sum(p.usd_per_hour for p in self.placements.values())

    def holder(self, node: str) -> tuple[str, ...]:
        """The deployments holding ``node`` (more than one only when they share memory)."""
        return tuple(sorted(d for d, p in self.placements.items() if node in p.nodes))
