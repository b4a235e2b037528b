"""Why a schedule is what it is: the reason of every pending deployment
(:func:`pending_reasons`: which resource, on which nodes, how much is missing) and, for one
deployment, why these nodes and what the next-best assignment would give (:func:`explain`).

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.scheduling.scoring import candidate_values
from policies.scheduling.types import Candidate, Demand, Pending, Placement, ScheduleRequest

_GIB = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*GiB")


def _missing_gib(reason: str) -> float:
    """How much memory a cost-model reason says is missing, GiB: what it needs (every
    figure before the last) less what it has (the last); 0 when the reason has no figures."""
    nums = [float(x) for x in _GIB.findall(reason)]
    if len(nums) < 2:
        return 0.0
    return max(0.0, sum(nums[:-1]) - nums[-1])


def pending_reasons(
    req: ScheduleRequest, placements: Mapping[str, Placement]
) -> tuple[Pending, ...]:
    """A :class:`Pending` for every deployment without a placement."""
    gpus_of = {n: g.gpus_per_node for g in req.groups for n in g.nodes}
    load: dict[str, float] = {}
    holders: dict[str, list[str]] = {}
    for name, p in placements.items():
        f = next(d.memory_fraction for d in req.demands if d.name == name)
        for n in p.nodes:
            load[n] = load.get(n, 0.0) + f
            holders.setdefault(n, []).append(name)
    by_name = {d.name: d for d in req.demands}
    out: list[Pending] = []
    for d in sorted(req.demands, key=lambda d: (-d.priority, d.name)):
        if d.name not in placements:
            out.append(_reason(req, d, load, holders, gpus_of, by_name, placements))
    return tuple(out)


def _runnable(d: Demand, cands: tuple[Candidate, ...]) -> list[Candidate]:
    vals = candidate_values(d, cands)
    return [
        c
        for c, v in zip(cands, vals, strict=True)
        if v is not None and (not d.max_gpus or c.gpus <= d.max_gpus) and c.gpus >= d.min_gpus
    ]


def _reason(
    req: ScheduleRequest,
    d: Demand,
    load: Mapping[str, float],
    holders: Mapping[str, list[str]],
    gpus_of: Mapping[str, int],
    by_name: Mapping[str, Demand],
    placements: Mapping[str, Placement],
) -> Pending:
    eligible = sorted(d.eligible & set(gpus_of))
    if not eligible:
        return Pending(
            d.name,
            "nodes",
            (),
            0.0,
            "GPUs",
            "no usable node matches the node selector. To fix: start agents on matching "
            "nodes or change spec.nodeSelector",
        )
    cands = req.candidates.get(d.name, ())
    total = sum(gpus_of[n] for n in eligible)
    if d.min_gpus > total:
        return Pending(
            d.name,
            "gpus",
            tuple(eligible),
            float(d.min_gpus - total),
            "GPUs",
            f"minGpus {d.min_gpus} but only {total} GPUs on nodes it may use. To fix: lower "
            "spec.minGpus or add nodes",
        )
    runnable = _runnable(d, cands)
    if not cands and d.max_gpus:
        return Pending(
            d.name,
            "gpus",
            tuple(eligible),
            float(min(gpus_of[n] for n in eligible) - d.max_gpus),
            "GPUs",
            f"maxGpus {d.max_gpus} is below one node's GPUs on every node it may use (at "
            f"least {min(gpus_of[n] for n in eligible)}). To fix: raise spec.maxGpus",
        )
    if not runnable:
        why = next((c.reason for c in sorted(cands, key=lambda c: -c.gpus) if c.reason), "")
        return Pending(
            d.name,
            "memory",
            tuple(eligible),
            _missing_gib(why),
            "GiB",
            f"no instance fits on the {total} GPUs it may use ({why or 'no candidate'}). "
            "To fix: add nodes, raise spec.maxGpus, or use fp8 KV cache / a shorter context",
        )
    quota = req.quotas_gpus.get(d.namespace)
    smallest = min(runnable, key=lambda c: c.gpus)
    if quota is not None:
        used = sum(
            p.gpus * by_name[n].memory_fraction
            for n, p in placements.items()
            if by_name[n].namespace == d.namespace
        )
        need = smallest.gpus * d.memory_fraction
        if used + need > quota + 1e-9:
            return Pending(
                d.name,
                "quota",
                (),
                used + need - quota,
                "GPUs",
                f"namespace {d.namespace} quota is {quota} GPUs, {used:g} in use; the smallest "
                f"instance needs {need:g}. To fix: raise the quota or free GPUs in the namespace",
            )
    return _held(req, d, runnable, load, holders, by_name)


def _held(
    req: ScheduleRequest,
    d: Demand,
    runnable: list[Candidate],
    load: Mapping[str, float],
    holders: Mapping[str, list[str]],
    by_name: Mapping[str, Demand],
) -> Pending:
    """The reason of a deployment whose runnable instances need nodes others hold: the
    instance with the smallest shortfall, the busy nodes and their holders."""
    best: tuple[float, Candidate, list[str]] | None = None
    for c in runnable:
        short = 0.0
        busy: list[str] = []
        for g, k in zip(req.groups, c.counts, strict=True):
            mine = [n for n in g.nodes if n in d.eligible]
            free = [n for n in mine if load.get(n, 0.0) + d.memory_fraction <= 1 + 1e-9]
            if len(free) < k:
                short += (k - len(free)) * g.gpus_per_node
                busy.extend(n for n in mine if n not in free)
        if best is None or short < best[0]:
            best = (short, c, busy)
    assert best is not None
    short, c, busy = best
    who = sorted({h for n in busy for h in holders.get(n, ())})
    held_by = ", ".join(f"{h} (priority {by_name[h].priority})" for h in who) or "nobody"
    return Pending(
        d.name,
        "gpus",
        tuple(busy),
        short,
        "GPUs",
        f"its closest runnable instance needs {c.gpus} GPUs, {short:g} more than are free on "
        f"its nodes; held by {held_by}. To fix: raise spec.priority, free nodes or add "
        "nodes",
    )


@dataclass(frozen=True)
class Explanation:
    """Why a deployment got its nodes.

    Attributes:
        deployment: its name.
        nodes: the nodes it holds (empty when pending).
        reason: why, in words (the pending reason when it is pending).
        tokens_per_s: its predicted throughput.
        usd_per_million_tokens: its cost per million tokens, USD (inf when pending).
        alternatives: its other runnable instances as ``(nodes per group, GPUs, tokens/s,
            USD per Mtok)``, best value first.
        next_best_nodes: the nodes the next-best schedule would give it (that schedule may
            not give it exactly these nodes).
        next_best_tokens_per_s: its throughput there.
        next_best_total_tokens_per_s: every deployment's throughput there.
        total_tokens_per_s: every deployment's throughput in the chosen schedule.
    """

    deployment: str
    nodes: tuple[str, ...]
    reason: str
    tokens_per_s: float
    usd_per_million_tokens: float
    alternatives: tuple[tuple[str, int, float, float], ...]
    next_best_nodes: tuple[str, ...]
    next_best_tokens_per_s: float
    next_best_total_tokens_per_s: float
    total_tokens_per_s: float


def explain(req: ScheduleRequest, schedule: object, deployment: str) -> Explanation:
    """Why ``deployment`` holds its nodes in ``schedule`` (a
    :class:`~policies.scheduling.types.Schedule` of ``req``) and what the next-best
    assignment would give: the integer program solved again with its exact node set
    forbidden.

    Raises:
        KeyError: no such deployment in ``req``.
    """
    from policies.scheduling.ilp import solve_schedule
    from policies.scheduling.types import Schedule

    assert isinstance(schedule, Schedule)
    d = next((x for x in req.demands if x.name == deployment), None)
    if d is None:
        raise KeyError(deployment)
    cands = req.candidates.get(deployment, ())
    vals = candidate_values(d, cands)
    labels = [g.label for g in req.groups]
    alts = sorted(
        (
            (
                " + ".join(f"{k}x ({lab})" for k, lab in zip(c.counts, labels, strict=True) if k),
                c.gpus,
                c.tokens_per_s,
                c.usd_per_million_tokens,
                v,
            )
            for c, v in zip(cands, vals, strict=True)
            if v is not None
        ),
        key=lambda a: -a[4],
    )
    p = schedule.placements.get(deployment)
    if p is None:
        pend = schedule.pending.get(deployment)
        reason = pend.message if pend is not None else "not placed"
        nodes: tuple[str, ...] = ()
    else:
        nodes = p.nodes
        reason = why_placed(req, schedule, d, p)
    nxt = solve_schedule(req, exclude={deployment: frozenset(nodes)}) if nodes else schedule
    np_ = nxt.placements.get(deployment)
    return Explanation(
        deployment=deployment,
        nodes=nodes,
        reason=reason,
        tokens_per_s=p.tokens_per_s if p else 0.0,
        usd_per_million_tokens=p.usd_per_million_tokens if p else float("inf"),
        alternatives=tuple(a[:4] for a in alts[:8]),
        next_best_nodes=np_.nodes if np_ else (),
        next_best_tokens_per_s=np_.tokens_per_s if np_ else 0.0,
        next_best_total_tokens_per_s=nxt.tokens_per_s,
        total_tokens_per_s=schedule.tokens_per_s,
    )


def why_placed(req: ScheduleRequest, schedule: object, d: Demand, p: Placement) -> str:
    """Why a placed deployment has these nodes, in words."""
    eligible = [n for g in req.groups for n in g.nodes if n in d.eligible]
    left = [n for n in eligible if n not in p.nodes]
    others = {
        n: name
        for name, q in getattr(schedule, "placements", {}).items()
        if name != d.name
        for n in q.nodes
    }
    parts = [
        f"{len(p.instances)} instance(s) on {len(p.nodes)} of its {len(eligible)} usable "
        f"nodes for its {d.objective} objective: {p.tokens_per_s:,.0f} tokens/s, "
        f"{p.usd_per_million_tokens:.3f} USD per Mtok"
    ]
    by_others = sorted(n for n in left if n in others)
    idle = sorted(n for n in left if n not in others)
    if by_others:
        parts.append("left to others: " + ", ".join(f"{n} ({others[n]})" for n in by_others))
    if idle:
        parts.append(f"left out although free: {', '.join(idle)}" + _with_idle(req, p, idle))
    if d.objective == "throughput" and not d.max_gpus:
        parts.append(
            "no maxGpus: its throughput objective takes every free GPU that adds tokens/s "
            "(set maxGpus, or state traffic and SLOs to be sized for what it must serve)"
        )
    return "; ".join(parts)


def _with_idle(req: ScheduleRequest, p: Placement, idle: Sequence[str]) -> str:
    """What its one-instance candidate with the idle nodes added would give (by how much
    leaving them out raises its objective), or why it cannot run."""
    if len(p.instances) != 1:
        return " (they would lower its objective)"
    group_of = {n: ti for ti, g in enumerate(req.groups) for n in g.nodes}
    counts = [0] * len(req.groups)
    for n in (*p.nodes, *idle):
        counts[group_of[n]] += 1
    c = next((c for c in req.candidates.get(p.deployment, ()) if c.counts == tuple(counts)), None)
    if c is None:
        return " (no candidate holds them too)"
    if not c.ok:
        return f" (with them it cannot run: {c.reason[:200]})"
    dt = c.tokens_per_s - p.tokens_per_s
    usd = c.usd_per_million_tokens
    return (
        f" (with them: {c.tokens_per_s:,.0f} tokens/s ({dt:+,.0f}), {usd:.3f} USD per Mtok "
        f"({usd - p.usd_per_million_tokens:+.3f}), step {c.step_time_us / 1000:.1f} ms)"
    )
