"""The fleet assignment on random small cost tables: valid, priorities and quotas kept,
never worse than first fit, and optimal against brute force on tiny instances."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from policies.scheduling.baselines import every_on_every, first_fit, overcommit
from policies.scheduling.check import violations
from policies.scheduling.ilp import solve_schedule
from policies.scheduling.scoring import Choice, candidate_values, priority_weights, score
from policies.scheduling.types import Candidate, Demand, NodeGroup, ScheduleRequest


def _groups(r: random.Random) -> tuple[NodeGroup, ...]:
    out = []
    for t in range(r.randint(1, 3)):
        n = r.randint(1, 2)
        out.append(
            NodeGroup(f"g{t}", tuple(f"n{t}-{i}" for i in range(n)), r.choice((4, 8)), 8 * (t + 1))
        )
    return tuple(out)


def _candidates(r: random.Random, groups: Sequence[NodeGroup], need: int) -> tuple[Candidate, ...]:
    """Every count vector; it runs from ``need`` GPUs on, with throughput growing sub-linearly."""
    speed = [r.uniform(0.5, 2.0) for _ in groups]
    out = []
    for v in itertools.product(*(range(len(g.nodes) + 1) for g in groups)):
        if not any(v):
            continue
        gpus = sum(k * g.gpus_per_node for k, g in zip(v, groups, strict=True))
        slow = min(s for s, k in zip(speed, v, strict=True) if k)
        tps = gpus * slow * 100 * r.uniform(0.8, 1.0) if gpus >= need else 0.0
        usd = sum(k * g.usd_per_node_hour for k, g in zip(v, groups, strict=True))
        out.append(Candidate(v, gpus, tps, 1e6 / max(tps, 1.0), usd, "" if tps else "memory"))
    return tuple(out)


def random_request(seed: int, *, shared: bool = True, instances: int = 2) -> ScheduleRequest:
    r = random.Random(seed)
    groups = _groups(r)
    nodes = [n for g in groups for n in g.nodes]
    demands = []
    cands = {}
    for i in range(r.randint(1, 3)):
        eligible = frozenset(n for n in nodes if r.random() < 0.8) or frozenset(nodes[:1])
        name = f"d{i}"
        demands.append(
            Demand(
                name,
                eligible,
                namespace=r.choice(("a", "b")),
                priority=r.choice((0, 0, 1, 5)),
                min_gpus=r.choice((0, 0, 8)),
                max_gpus=r.choice((0, 0, 16)),
                objective=r.choice(("throughput", "cost")),
                memory_fraction=r.choice((1.0, 1.0, 0.5)) if shared else 1.0,
                max_instances=r.randint(1, instances),
            )
        )
        cands[name] = _candidates(r, groups, r.choice((4, 8, 16)))
    previous = {}
    if r.random() < 0.5:
        d = demands[0]
        previous[d.name] = frozenset(sorted(d.eligible)[: r.randint(1, len(d.eligible))])
    quotas = {"a": r.choice((8, 16, 64))} if r.random() < 0.5 else {}
    return ScheduleRequest(
        groups,
        tuple(demands),
        cands,
        previous=previous,
        quotas_gpus=quotas,
        move_weight=r.choice((0.0, 0.25, 1.0)),
    )


SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_schedules_are_valid_and_never_worse_than_first_fit(seed: int) -> None:
    req = random_request(seed)
    s = solve_schedule(req)
    assert violations(req, s) == []
    ff = first_fit(req)
    assert violations(req, ff) == []
    assert s.objective >= ff.objective - 1e-9
    for p in s.pending.values():
        assert p.message and p.resource in ("gpus", "memory", "quota", "nodes")


@pytest.mark.parametrize("seed", SEEDS)
def test_higher_priorities_are_placed_as_if_the_lower_did_not_exist(seed: int) -> None:
    req = random_request(seed)
    s = solve_schedule(req)
    for level in sorted({d.priority for d in req.demands}):
        top = tuple(d for d in req.demands if d.priority >= level)
        held = {d.name: req.previous[d.name] for d in top if d.name in req.previous}
        top_req = ScheduleRequest(
            req.groups,
            top,
            req.candidates,
            previous=held,
            quotas_gpus=req.quotas_gpus,
            move_weight=0,
        )
        alone = solve_schedule(top_req)
        w = priority_weights(top_req)
        assert sum(w[n] for n in s.placements if n in w) == sum(w[n] for n in alone.placements)


def _best_split(
    req: ScheduleRequest, d: Demand, nodes: Sequence[str]
) -> tuple[float, Choice] | None:
    """The best instances for exactly ``nodes`` (brute force over candidate multisets)."""
    group_of = {n: ti for ti, g in enumerate(req.groups) for n in g.nodes}
    want = [0] * len(req.groups)
    for n in nodes:
        want[group_of[n]] += 1
    cands = req.candidates[d.name]
    vals = candidate_values(d, cands)
    ok = [
        i
        for i, v in enumerate(vals)
        if v is not None and not (d.max_gpus and cands[i].gpus > d.max_gpus)
    ]
    best: tuple[float, Choice] | None = None
    for k in range(1, d.max_instances + 1):
        for combo in itertools.combinations_with_replacement(ok, k):
            tot = [sum(cands[i].counts[t] for i in combo) for t in range(len(req.groups))]
            if tot != want:
                continue
            pools = [[n for n in g.nodes if n in nodes] for g in req.groups]
            inst = []
            for i in combo:
                got: list[str] = []
                for t, c in enumerate(cands[i].counts):
                    got += pools[t][:c]
                    del pools[t][:c]
                inst.append((i, tuple(got)))
            v = sum(vals[i] or 0.0 for i in combo)
            if best is None or v > best[0]:
                best = (v, {d.name: tuple(inst)})
    return best


def brute_force(req: ScheduleRequest) -> float:
    """Best score over every exclusive assignment of nodes to deployments."""
    nodes = [n for g in req.groups for n in g.nodes]
    best = score(req, {})
    for owners in itertools.product(range(len(req.demands) + 1), repeat=len(nodes)):
        choice: dict[str, tuple[tuple[int, tuple[str, ...]], ...]] = {}
        ok = True
        for di, d in enumerate(req.demands):
            mine = [n for n, o in zip(nodes, owners, strict=True) if o == di + 1]
            if not mine:
                continue
            if not set(mine) <= d.eligible:
                ok = False
                break
            split = _best_split(req, d, mine)
            if split is None:
                ok = False
                break
            choice.update(split[1])
        if not ok:
            continue
        s = solve_schedule  # noqa: F841 - the same score as the ILP's
        from policies.scheduling.scoring import build_schedule

        sched = build_schedule(req, choice, solver="brute")
        if violations(req, sched):
            continue
        best = max(best, score(req, choice))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_the_program_matches_brute_force_on_tiny_instances(seed: int) -> None:
    req = random_request(1000 + seed, shared=False)
    s = solve_schedule(req)
    assert s.objective == pytest.approx(brute_force(req), rel=1e-9, abs=1e-9)


def test_every_on_every_over_commits_what_the_scheduler_keeps_exclusive() -> None:
    g = (NodeGroup("g", ("a", "b"), 8, 10.0),)
    cands = (Candidate((1,), 8, 100.0, 10.0, 10.0), Candidate((2,), 16, 150.0, 12.0, 20.0))
    demands = tuple(Demand(f"d{i}", frozenset({"a", "b"})) for i in range(3))
    req = ScheduleRequest(g, demands, {d.name: cands for d in demands})
    eoe = every_on_every(req)
    assert max(overcommit(req, eoe).values()) == 3.0
    s = solve_schedule(req)
    assert max(overcommit(req, s).values()) == 1.0
    assert len(s.placements) == 2 and len(s.pending) == 1
    assert violations(req, s) == []


def test_memory_fractions_share_a_node_within_one() -> None:
    g = (NodeGroup("g", ("a",), 8, 10.0),)
    cands = (Candidate((1,), 8, 100.0, 10.0, 10.0),)
    demands = (
        Demand("x", frozenset({"a"}), memory_fraction=0.5),
        Demand("y", frozenset({"a"}), memory_fraction=0.5),
        Demand("z", frozenset({"a"}), memory_fraction=0.25, priority=-1),
    )
    s = solve_schedule(ScheduleRequest(g, demands, {d.name: cands for d in demands}))
    assert set(s.placements) == {"x", "y"}
    assert s.pending["z"].resource == "gpus" and s.pending["z"].missing == 8


def test_a_quota_leaves_the_deployment_pending_with_the_quota_named() -> None:
    g = (NodeGroup("g", ("a", "b"), 8, 10.0),)
    cands = (Candidate((1,), 8, 100.0, 10.0, 10.0),)
    demands = (
        Demand("x", frozenset({"a", "b"}), namespace="t"),
        Demand("y", frozenset({"a", "b"}), namespace="t"),
    )
    s = solve_schedule(
        ScheduleRequest(g, demands, {d.name: cands for d in demands}, quotas_gpus={"t": 8})
    )
    assert len(s.placements) == 1
    (p,) = s.pending.values()
    assert p.resource == "quota" and p.missing == 8 and "quota is 8 GPUs" in p.message


def test_the_move_penalty_keeps_a_running_deployment_on_its_nodes() -> None:
    g = (NodeGroup("g", ("a", "b", "c"), 8, 10.0),)
    cands = (Candidate((1,), 8, 100.0, 10.0, 10.0), Candidate((2,), 16, 190.0, 10.0, 20.0))
    demands = (Demand("x", frozenset({"a", "b", "c"})), Demand("y", frozenset({"a", "b", "c"})))
    prev = {"x": frozenset({"b", "c"})}
    s = solve_schedule(ScheduleRequest(g, demands, {d.name: cands for d in demands}, previous=prev))
    assert set(s.placements["x"].nodes) & {"b", "c"}
    assert s.nodes_moved <= 1
    assert violations(ScheduleRequest(g, demands, {d.name: cands for d in demands}), s) == []


def test_a_newcomer_of_equal_priority_never_takes_a_running_deployments_place() -> None:
    """Only a strictly higher priority preempts. ``new`` is worth twice as much on the one
    node ``run`` holds; at priority 0 both, ``run`` keeps it (first fit too); at priority
    1, ``new`` takes it and ``run`` is preempted."""
    g = (NodeGroup("g", ("a",), 8, 10.0),)
    slow = (Candidate((1,), 8, 100.0, 10.0, 10.0),)
    fast = (Candidate((1,), 8, 200.0, 5.0, 10.0),)
    for priority, placed in ((0, "run"), (1, "new")):
        demands = (
            Demand("new", frozenset({"a"}), priority=priority),
            Demand("run", frozenset({"a"})),
        )
        req = ScheduleRequest(
            g, demands, {"new": fast, "run": slow}, previous={"run": frozenset({"a"})}
        )
        for s in (solve_schedule(req), first_fit(req)):
            assert set(s.placements) == {placed}, (priority, s.solver)
            assert violations(req, s) == []
        decided = {d.deployment: d.kind for d in solve_schedule(req).decisions}
        assert decided == ({} if placed == "run" else {"new": "placed", "run": "preempted"})
    # Without a previous holder the faster one wins, as before.
    both = (Demand("new", frozenset({"a"})), Demand("run", frozenset({"a"})))
    fresh = ScheduleRequest(g, both, {"new": fast, "run": slow})
    assert set(solve_schedule(fresh).placements) == {"new"}
