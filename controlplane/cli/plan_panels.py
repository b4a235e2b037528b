"""The panels of ``mixfleetctl plan render`` computed from a plan: the step split by phase,
the hottest experts of one layer, the traffic between nodes (see
:mod:`controlplane.cli.render`, which assembles them into a :class:`PlanPicture`).

Pure functions of the plan and the cost model's evaluation; units: microseconds (``_us``),
bytes, fractions in [0, 1].
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from policies.estimate.costmodel import CostTable
from policies.estimate.engines import EngineOptions, EngineSpec, Runtime, full_rows
from policies.estimate.evaluation import (
    Evaluation,
    LayerPlacement,
    exchange_bytes_by_node,
)
from policies.estimate.execution import layer_rows
from policies.estimate.replica_choice import dispatch
from policies.hardware.topology import Channel
from policies.model.architecture import ModelSpec
from policies.plan import Plan

#: A ``[gpu][moe_layer]`` grid of one panel.
Grid = tuple[tuple[float, ...], ...]

#: Relative margin within which GPUs count as equally slow.
TIE = 0.005
#: Experts drawn in the placement panel at most (replicated ones first, then by load).
MAX_EXPERT_COLUMNS = 48
_CHANNEL_NAMES = {
    Channel.LOCAL: "same GPU",
    Channel.NVLINK: "NVLink",
    Channel.PCIE: "PCIe",
    Channel.RDMA: "RDMA",
    Channel.RDMA_CROSS: "fabric link",
    Channel.UNREACHABLE: "no path",
}


@dataclass(frozen=True)
class PhaseSlice:
    """One phase of the predicted step.

    Attributes:
        name: ``dense attention`` | ``attention`` | ``dispatch+combine`` | ``experts``.
        total_us: its part of the step (sum over layers of the slowest GPU), us.
        setter: the GPU slowest in this phase in most layers ("" when none).
        setter_layers: in how many of ``layers`` that GPU is the slowest.
        layers: layers the phase occurs in.
        known: False when the phase cannot be computed from the inputs given.
    """

    name: str
    total_us: float
    setter: str
    setter_layers: int
    layers: int
    known: bool = True


@dataclass(frozen=True)
class ExpertView:
    """Where the hottest experts of one MoE layer sit.

    Attributes:
        layer: model layer index.
        experts: expert ids of the columns (replicated first, then by load).
        replicas: replicas of each column's expert.
        load: each column's fraction of the layer's token-expert pairs (None: load unknown).
        grid: ``[gpu][column]`` pairs per step the GPU's replica serves (share of the
            expert's tokens when the load is unknown); 0 where the GPU holds none.
        unit: what ``grid`` holds.
        hidden: experts not drawn (all held once, colder than the last column).
    """

    layer: int
    experts: tuple[int, ...]
    replicas: tuple[int, ...]
    load: tuple[float, ...] | None
    grid: Grid
    unit: str
    hidden: int


@dataclass(frozen=True)
class LinkTraffic:
    """Dispatch+combine bytes per step between nodes (all MoE layers).

    Attributes:
        nodes: node names, plan order.
        bytes_per_step: ``[src node][dst node]`` bytes (diagonal: between GPUs of a node).
        channel: ``[src node][dst node]`` channel name (``NVLink``, ``RDMA``...).
        note: how the traffic was computed.
    """

    nodes: tuple[str, ...]
    bytes_per_step: Grid
    channel: tuple[tuple[str, ...], ...]
    note: str


def runtime_of_plan(plan: Plan) -> Runtime:
    """The runtime recorded in the plan (engine, backend, replica rule, ranks per node)."""
    e = plan.engine
    spec = EngineSpec(
        name=e.name,  # type: ignore[arg-type]  # a plan only records valid engine names
        version=e.version,
        options=EngineOptions(e.a2a_backend, e.dispatch, e.dp_balance),
    )
    return Runtime(spec, e.a2a_backend, e.dispatch, e.dp_balance, e.gpus_per_node, e.why)  # type: ignore[arg-type]


def executed_layers(
    plan: Plan, m: ModelSpec, table: CostTable, placements: Sequence[LayerPlacement]
) -> list[LayerPlacement]:
    """``placements`` with who-sends-to-whom traffic when the plan's engine picks replicas by
    locality (the plan's shares already are the executed ones)."""
    runtime = runtime_of_plan(plan)
    if runtime.dispatch not in ("static", "dynamic") or not placements:
        return list(placements)
    rows = layer_rows(placements)
    weights = [[x / (sum(r) or 1.0) for x in r] for r in table.load]
    if runtime.dispatch == "static":  # SGLang's seeded spread runs over the whole map
        rows = full_rows(rows, m.moe_layers, m.num_layers, m.num_experts)
        by_layer = dict(zip(m.moe_layers, weights, strict=True))
        weights = [by_layer.get(layer, [0.0] * m.num_experts) for layer in range(m.num_layers)]
    share = [g.attention_share for g in plan.gpus]
    _, traffic = dispatch(runtime, rows, m.num_experts, share, weights=weights)
    if traffic is None:
        return list(placements)
    if runtime.dispatch == "static":
        traffic = [traffic[layer] for layer in m.moe_layers]
    import numpy as np

    return [
        LayerPlacement(p.per_gpu, np.asarray(t, dtype=float))
        for p, t in zip(placements, traffic, strict=True)
    ]


def _slowest(values: Sequence[float], labels: Sequence[str], models: Sequence[str]) -> str:
    """The GPU with the largest value; GPUs within 0.5% of it count as tied and are named
    together (``a100-0 (8 GPUs tied)``, ``64 B200 tied`` or ``a100-0/gpu0 +3 tied``); ""
    when all are 0."""
    top = max(values, default=0.0)
    if top <= 0:
        return ""
    tied = [i for i, v in enumerate(values) if v >= top * (1 - TIE)]
    if len(tied) == 1:
        return labels[tied[0]]
    nodes = {labels[i].split("/")[0] for i in tied}
    if len(nodes) == 1:
        return f"{nodes.pop()} ({len(tied)} GPUs tied)"
    kinds = {models[i] for i in tied}
    if len(kinds) == 1:
        return f"{len(tied)} {kinds.pop()} tied"
    return f"{labels[tied[0]]} +{len(tied) - 1} tied"


def _slice(name: str, total: float, setters: Sequence[str], known: bool = True) -> PhaseSlice:
    top = Counter(s for s in setters if s).most_common(1)
    who, count = top[0] if top else ("", 0)
    return PhaseSlice(name, total, who, count, len(setters), known)


def phases(
    ev: Evaluation, labels: Sequence[str], models: Sequence[str], comm_known: bool
) -> tuple[PhaseSlice, ...]:
    """The step split by phase, each phase's slowest GPU per layer counted."""
    out: list[PhaseSlice] = []
    if ev.dense_layer is not None and ev.num_dense_layers:
        d = ev.dense_layer
        who = _slowest(d.attention_us, labels, models)
        total = max(d.attention_us, default=0.0) * ev.num_dense_layers
        out.append(_slice("dense attention", total, [who] * ev.num_dense_layers))
    layers = ev.moe_layers
    if layers:
        out.append(
            _slice(
                "attention",
                sum(max(t.attention_us, default=0.0) for t in layers),
                [_slowest(t.attention_us, labels, models) for t in layers],
            )
        )
        comm = [max(max(t.comm_us, default=0.0), t.link_us) for t in layers]
        setters = [
            "fabric link"
            if t.link_us > max(t.comm_us, default=0.0)
            else _slowest(t.comm_us, labels, models)
            for t in layers
        ]
        out.append(
            _slice("dispatch+combine", sum(comm) if comm_known else 0.0, setters, comm_known)
        )
        out.append(
            _slice(
                "experts",
                sum(max(t.expert_us, default=0.0) for t in layers),
                [_slowest(t.expert_us, labels, models) for t in layers],
            )
        )
    return tuple(out)


def busy(ev: Evaluation, n: int, comm_known: bool) -> Grid:
    """Per GPU ``(attention, dispatch+combine, experts)`` summed over the step, us."""
    rows = []
    for i in range(n):
        attn = sum(t.attention_us[i] for t in ev.moe_layers)
        if ev.dense_layer is not None:
            attn += ev.dense_layer.attention_us[i] * ev.num_dense_layers
        comm = sum(t.comm_us[i] for t in ev.moe_layers) if comm_known else 0.0
        rows.append((attn, comm, sum(t.expert_us[i] for t in ev.moe_layers)))
    return tuple(rows)


def links(
    plan: Plan, table: CostTable, layers: Sequence[LayerPlacement], comm_known: bool
) -> LinkTraffic | None:
    """Dispatch+combine bytes per step between nodes; None for an all-gather exchange.
    Without the fleet (``comm_known`` False) the channels are unknown."""
    exchange = runtime_of_plan(plan).exchange_in(table.decode)
    if exchange == "allgather" or not layers:
        return None
    nodes = tuple(dict.fromkeys(g.node for g in plan.gpus))
    index = {name: k for k, name in enumerate(nodes)}
    node_of = [index[g.node] for g in plan.gpus]
    share = [g.attention_share for g in plan.gpus]
    grid = exchange_bytes_by_node(table, share, layers, exchange).tolist()
    members = [[i for i, k in enumerate(node_of) if k == a] for a in range(len(nodes))]
    names = tuple(
        tuple(
            _channel_name(table, members[a], members[b]) if comm_known else "link: --fleet"
            for b in range(len(nodes))
        )
        for a in range(len(nodes))
    )
    how = "replica choice replayed" if layers[0].traffic is not None else "planned shares"
    return LinkTraffic(nodes, tuple(tuple(r) for r in grid), names, how)


def _channel_name(table: CostTable, src: Sequence[int], dst: Sequence[int]) -> str:
    """The channel between a GPU of ``src`` and another GPU of ``dst`` ("-" if none)."""
    for i in src:
        for j in dst:
            if i != j:
                return _CHANNEL_NAMES[Channel(int(table.topology.channel[i][j]))]
    return "-"


def expert_view(
    plan: Plan, rows: Sequence[Sequence[float]] | None, li: int, pairs: float | None
) -> ExpertView:
    """The placement panel for MoE layer index ``li`` (``pairs``: token-expert pairs of the
    layer per step; None: the grid holds replica shares)."""
    replicas = [0] * plan.num_experts
    for g in plan.gpus:
        for s in g.experts[li]:
            replicas[s.expert] += 1
    load = None
    if rows is not None:
        total = sum(rows[li]) or 1.0
        load = [x / total for x in rows[li]]
    heat = load or [0.0] * plan.num_experts
    order = sorted(range(plan.num_experts), key=lambda e: (-(replicas[e] > 1), -heat[e], e))
    cols = order[:MAX_EXPERT_COLUMNS]
    col_of = {e: c for c, e in enumerate(cols)}
    grid = []
    for g in plan.gpus:
        row = [0.0] * len(cols)
        for s in g.experts[li]:
            c = col_of.get(s.expert)
            if c is not None:
                row[c] += s.share * (heat[s.expert] * pairs if pairs is not None else 1.0)
        grid.append(tuple(row))
    unit = "token-expert pairs per step" if pairs is not None else "share of the expert's tokens"
    return ExpertView(
        layer=plan.moe_layers[li],
        experts=tuple(cols),
        replicas=tuple(replicas[e] for e in cols),
        load=tuple(load[e] for e in cols) if load is not None else None,
        grid=tuple(grid),
        unit=unit,
        hidden=plan.num_experts - len(cols),
    )
