"""One objective for every assignment: the integer program, the baselines and the tests score
with :func:`score`, and :func:`build_schedule` turns a choice of instances into a
:class:`~policies.scheduling.types.Schedule`.

A *choice* maps each placed deployment to its instances, each ``(candidate index, node
names)``. Its score is lexicographic by priority, then value, then moves (written as one
number)::

    score = sum_d P_d * placed_d + (sum_d value_d - mu * vbar * moves) / V

* ``P_d``: priority weight; a level's weight is one more than the weights of every
  deployment below it, so placing one deployment beats placing any set of lower ones.
  Within a priority a running deployment (one that held nodes before) ranks above a new
  one (:func:`priority_level`): only a strictly higher priority preempts.
* ``value_d``: sum of :func:`candidate_values` of its instances (tokens per second as its
  objective weighs them).
* ``moves``: for each deployment holding nodes before, nodes it gives up plus
  :data:`GROW_WEIGHT` times the nodes it gains (growing onto a free node disturbs less than
  giving one up; a new deployment's first nodes are not moves). ``Schedule.nodes_moved``
  counts both in full.
* ``vbar``: an average node's value; ``mu`` the request's ``move_weight``.
* ``V``: a bound on the bracket's size that keeps it inside (-1, 1).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.scheduling.types import (
    Candidate,
    Decision,
    Demand,
    Placement,
    Schedule,
    ScheduleRequest,
)

#: deployment -> its instances as ``(candidate index, node names)``.
Choice = Mapping[str, tuple[tuple[int, tuple[str, ...]], ...]]


def candidate_values(demand: Demand, cands: Sequence[Candidate]) -> list[float | None]:
    """Each candidate's value under the deployment's objective (None: it cannot run).

    ``throughput``: tokens/s. ``cost``: tokens/s times its tokens per dollar over the best
    candidate's (an instance twice as dear per token counts half). ``slo``: tokens/s when
    the step time meets the target, else 0 (placed, but no goodput)."""
    ok = [c for c in cands if c.ok]
    best_eff = max((c.tokens_per_s / c.usd_per_hour for c in ok if c.usd_per_hour > 0), default=0)
    out: list[float | None] = []
    for c in cands:
        if not c.ok:
            out.append(None)
        elif demand.objective == "cost" and c.usd_per_hour > 0 and best_eff > 0:
            out.append(c.tokens_per_s * (c.tokens_per_s / c.usd_per_hour) / best_eff)
        elif demand.objective == "slo" and demand.slo_step_time_us > 0:
            out.append(c.tokens_per_s if c.step_time_us <= demand.slo_step_time_us else 0.0)
        else:
            out.append(c.tokens_per_s)
    return out


def priority_level(req: ScheduleRequest, d: Demand) -> tuple[int, int]:
    """``d``'s rank, highest first (sort ascending): its priority, then running (it held
    nodes before) above new. Only a strictly higher priority preempts: a deployment of the
    same priority that arrives later never takes the place of a running one."""
    return (-d.priority, 0 if req.previous.get(d.name) else 1)


def priority_weights(req: ScheduleRequest) -> dict[str, float]:
    """``P_d``: one more than the sum of the weights of every deployment ranked below ``d``
    (:func:`priority_level`: a lower priority, or the same priority and new while ``d``
    runs)."""
    weights: dict[str, float] = {}
    below = 0.0
    levels = {d.name: priority_level(req, d) for d in req.demands}
    for level in sorted(set(levels.values()), reverse=True):
        w = 1.0 + below
        at = [d for d in req.demands if levels[d.name] == level]
        for d in at:
            weights[d.name] = w
        below += w * len(at)
    return weights


def scales(req: ScheduleRequest) -> tuple[float, float]:
    """``(vbar, V)`` of the module docstring."""
    per_node: list[float] = []
    top = 0.0
    for d in req.demands:
        vals = candidate_values(d, req.candidates.get(d.name, ()))
        best = max((v for v in vals if v is not None), default=0.0)
        top += best * max(1, d.max_instances)
        for c, v in zip(req.candidates.get(d.name, ()), vals, strict=True):
            if v is not None and sum(c.counts) > 0:
                per_node.append(v / sum(c.counts))
    vbar = sum(per_node) / len(per_node) if per_node else 1.0
    nodes = sum(len(g.nodes) for g in req.groups)
    bound = top + req.move_weight * vbar * 2 * nodes * max(1, len(req.demands))
    return vbar, max(bound, 1e-9) * 1.01


GROW_WEIGHT = 0.5
"""Weight of a node a running deployment gains, against 1 for a node it gives up."""


def moves(
    req: ScheduleRequest, held: Mapping[str, frozenset[str]], *, grow_weight: float = 1.0
) -> float:
    """Node changes of the deployments that held nodes before: nodes given up plus
    ``grow_weight`` times nodes gained (see the module docstring)."""
    names = {d.name for d in req.demands}
    total = 0.0
    for d, before in req.previous.items():
        if d not in names or not before:
            continue
        now = held.get(d, frozenset())
        total += len(before - now) + grow_weight * len(now - before)
    return total


def score(req: ScheduleRequest, choice: Choice) -> float:
    """The objective of a choice (higher is better)."""
    weights = priority_weights(req)
    vbar, bound = scales(req)
    by_name = {d.name: d for d in req.demands}
    placed = 0.0
    value = 0.0
    for name, inst in choice.items():
        if not inst:
            continue
        placed += weights[name]
        vals = candidate_values(by_name[name], req.candidates[name])
        value += sum(vals[i] or 0.0 for i, _ in inst)
    held = {d: frozenset(n for _, ns in inst for n in ns) for d, inst in choice.items()}
    penalty = req.move_weight * vbar * moves(req, held, grow_weight=GROW_WEIGHT)
    return placed + (value - penalty) / bound


def build_schedule(
    req: ScheduleRequest, choice: Choice, *, solver: str, solve_s: float = 0.0
) -> Schedule:
    """The schedule of a choice; pending reasons come from
    :func:`policies.scheduling.explain.pending_reasons`."""
    from policies.scheduling.explain import pending_reasons

    by_name = {d.name: d for d in req.demands}
    placements: dict[str, Placement] = {}
    for name, inst in choice.items():
        if not inst:
            continue
        cands = req.candidates[name]
        vals = candidate_values(by_name[name], cands)
        nodes = {n for _, ns in inst for n in ns}
        order = tuple(n for g in req.groups for n in g.nodes if n in nodes)
        frac = by_name[name].memory_fraction
        placements[name] = Placement(
            deployment=name,
            nodes=order,
            instances=tuple(ns for _, ns in inst),
            gpus=sum(cands[i].gpus for i, _ in inst),
            tokens_per_s=sum(cands[i].tokens_per_s for i, _ in inst),
            usd_per_hour=sum(cands[i].usd_per_hour for i, _ in inst) * frac,
            value=sum(vals[i] or 0.0 for i, _ in inst),
        )
    held = {d: frozenset(p.nodes) for d, p in placements.items()}
    used = set().union(*held.values()) if held else set()
    free = tuple(n for g in req.groups for n in g.nodes if n not in used)
    pending = pending_reasons(req, placements)
    return Schedule(
        placements=placements,
        pending={p.deployment: p for p in pending},
        decisions=decisions(req, placements, pending_names=set(by_name) - set(placements)),
        free_nodes=free,
        objective=score(req, choice),
        nodes_moved=round(moves(req, held)),
        solver=solver,
        solve_s=solve_s,
    )


def decisions(
    req: ScheduleRequest, placements: Mapping[str, Placement], pending_names: set[str]
) -> tuple[Decision, ...]:
    """What changed against ``req.previous``, each with its reason."""
    out: list[Decision] = []
    by_name = {d.name: d for d in req.demands}
    taken: dict[str, str] = {}
    for name, p in placements.items():
        for n in p.nodes:
            taken.setdefault(n, name)
    for d in sorted(by_name.values(), key=lambda d: (-d.priority, d.name)):
        before = req.previous.get(d.name, frozenset())
        now = frozenset(placements[d.name].nodes) if d.name in placements else frozenset()
        added = tuple(sorted(now - before))
        removed = tuple(sorted(before - now))
        if not added and not removed:
            continue
        lost = [n for n in removed if n not in d.eligible]
        by = sorted({taken[n] for n in removed if n in taken and taken[n] != d.name})
        higher = [b for b in by if by_name[b].priority > d.priority]
        if d.name in pending_names:
            kind = "preempted" if higher else "pending"
        elif not before:
            kind = "placed"
        elif not removed:
            kind = "grown"
        elif not added:
            kind = "preempted" if higher else "shrunk"
        else:
            kind = "moved"
        why: list[str] = []
        if lost:
            why.append(f"nodes {', '.join(lost)} are no longer usable")
        if higher:
            why.append(
                f"higher priority {', '.join(higher)} took {len(removed) - len(lost)} node(s)"
            )
        elif by:
            why.append(f"{', '.join(by)} use the nodes for more of the objective")
        if added:
            why.append(f"takes {', '.join(added)} for its {d.objective} objective")
        if kind == "preempted":
            why.append("drained gracefully: the next plan is rolled out before nodes are freed")
        out.append(Decision(d.name, kind, added, removed, "; ".join(why) or "re-assigned"))
    for name, before in sorted(req.previous.items()):
        if name not in by_name and before:
            out.append(Decision(name, "released", (), tuple(sorted(before)), "deployment removed"))
    return tuple(out)
