"""The target engine as an input: parsing, the one runtime per EP group, replica choice and
DP balancing as each engine executes a plan (policies/estimate/engines.py, policies/estimate/execution.py).

The replay of SGLang's own dispatch computation is checked against SGLang's code in
tests/conformance/; here its properties and the solve-level consequences are checked.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from builders import fleet, request, tiny_model, workload
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.errors import InputError
from policies.estimate.costmodel import build_cost_table
from policies.estimate.engines import (
    EngineOptions,
    EngineSpec,
    engine_to_doc,
    full_rows,
    parse_engine,
    resolve_runtime,
)
from policies.estimate.evaluation import LayerPlacement, evaluate, gather_times_us
from policies.estimate.execution import executed, runtime_of
from policies.estimate.replica_choice import (
    _nearest,
    dispatch,
    replicas_of,
    served_shares,
    sglang_static_map,
)
from policies.model.architecture import preset
from policies.request import PlacementRequest, RawPlacement
from policies.solve import solve
from policies.solvers import locality

Nodes = list[tuple[str, str, int, float | None]]
MIXED: Nodes = [("a", "A100-SXM4-80GB", 2, 600.0), ("h", "H100-SXM5-80GB", 2, 900.0)]
HOPPER: Nodes = [("h", "H100-SXM5-80GB", 2, 900.0), ("g", "H200-SXM-141GB", 2, 900.0)]


def _engine(name: str, **options: str) -> EngineSpec:
    return EngineSpec(name, options=EngineOptions(**options))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- parsing


def test_parse_engine_round_trips_every_field() -> None:
    spec = parse_engine(
        {
            "name": "sglang",
            "version": "0.5.23",
            "options": {"a2aBackend": "deepep", "dispatch": "dynamic", "dpBalance": "engine"},
        }
    )
    want = _engine("sglang", a2a_backend="deepep", dispatch="dynamic", dp_balance="engine")
    assert spec == dataclasses.replace(want, version="0.5.23")
    assert parse_engine(engine_to_doc(spec)) == spec
    assert parse_engine("vllm").name == "vllm"
    assert parse_engine("vllm").resolved_version == "0.33.0"


@pytest.mark.parametrize(
    ("doc", "field", "words"),
    [
        ({"name": "tgi"}, "engine.name", "choose one of native, sglang, vllm, trtllm"),
        ({"name": "sglang", "speed": 1}, "engine.speed", "unknown field 'speed'"),
        (
            {"name": "sglang", "options": {"a2a": "x"}},
            "engine.options.a2a",
            "did you mean 'a2aBackend'",
        ),
        (
            {"name": "sglang", "options": {"dpBalance": "fair"}},
            "engine.options.dpBalance",
            "router",
        ),
        ({"name": "vllm", "options": {"dispatch": "static"}}, "engine.options.dispatch", "hashes"),
        (
            {"name": "sglang", "options": {"dispatch": "lp"}},
            "engine.options.dispatch",
            "not modelled",
        ),
        (
            {"name": "sglang", "options": {"a2aBackend": "nccl"}},
            "engine.options.a2aBackend",
            "deepep",
        ),
        ({"name": "sglang", "options": []}, "engine.options", "mapping"),
        (7, "engine", "engine name"),
        ({"name": ""}, "engine.name", "non-empty"),
    ],
)
def test_parse_engine_names_the_bad_field(doc: object, field: str, words: str) -> None:
    with pytest.raises(InputError) as err:
        parse_engine(doc)
    assert err.value.field == field
    assert words in str(err.value)


# --------------------------------------------------------------------------- runtime


def test_one_backend_for_a_mixed_group() -> None:
    """A100 ranks cannot run DeepEP's low-latency/internode kernels, so SGLang's group falls
    back to ``none`` (even split) for every rank - never deepep on some and nccl on others."""
    rt = resolve_runtime(_engine("sglang"), ["ampere", "ampere", "hopper", "hopper"], list("aahh"))
    assert (rt.a2a_backend, rt.dispatch, rt.exchange_in(False)) == ("none", "even", "allgather")
    assert "deepep" in rt.why
    rt = resolve_runtime(_engine("sglang"), ["hopper"] * 4, list("aabb"))
    assert (rt.a2a_backend, rt.dispatch, rt.gpus_per_node) == ("deepep", "static", 2)


def test_explicit_backend_some_gpu_lacks_is_refused() -> None:
    with pytest.raises(InputError, match=r"does not run on \['ampere'\]"):
        resolve_runtime(_engine("sglang", a2a_backend="deepep"), ["ampere", "hopper"], ["a", "b"])


@pytest.mark.parametrize(
    ("name", "dispatch"), [("vllm", "even"), ("trtllm", "even"), ("native", "planned")]
)
def test_replica_rule_per_engine(name: str, dispatch: str) -> None:
    assert resolve_runtime(_engine(name), ["hopper"] * 2, ["a", "a"]).dispatch == dispatch


def test_sglang_needs_equal_contiguous_nodes() -> None:
    with pytest.raises(InputError, match="same number of GPUs"):
        resolve_runtime(_engine("sglang"), ["hopper"] * 3, ["a", "a", "b"])
    with pytest.raises(InputError, match="not contiguous"):
        resolve_runtime(_engine("vllm"), ["hopper"] * 3, ["a", "b", "a"])


# --------------------------------------------------------------------------- replica choice


def test_static_rule_on_a_hand_checked_map() -> None:
    """2 nodes x 2 ranks, 2 slots per rank, experts 0..3 (E=4, R=4). Expert 0 sits on rank 0
    and rank 3 (different nodes): rank 1 takes node 0's replica, rank 2 node 1's. Expert 1 sits
    twice on node 0 only (ranks 0, 1): ranks 2 and 3 find none nearby and draw."""
    row = [0, 1, 1, 2, 3, 2, 0, 3]  # rank r holds slots 2r, 2r+1
    picks = sglang_static_map([row], 4, 4, 2)
    assert [picks[r][0][0] for r in range(4)] == [0, 0, 6, 6]
    assert [picks[r][0][1] for r in range(2)] == [1, 2]  # own replica
    assert {picks[r][0][1] for r in (2, 3)} <= {1, 2}
    assert all(picks[r][0][2] == (3 if r < 2 else 5) for r in range(4))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(4, 2), (4, 1), (6, 3), (8, 4)]))
def test_static_picks_are_replicas_and_shares_sum_to_one(seed: int, shape: tuple[int, int]) -> None:
    ep, per_node = shape
    rng = random.Random(seed)
    experts, slots = 6, 3
    rows = []
    for _ in range(3):
        row = list(range(experts)) + [rng.randrange(experts) for _ in range(ep * slots - experts)]
        rng.shuffle(row)
        rows.append(row)
    picks = sglang_static_map(rows, experts, ep, per_node)
    for r in range(ep):
        for li, row in enumerate(rows):
            for e in range(experts):
                p = picks[r][li][e]
                assert row[p] == e
                own = [q for q in range(r * slots, (r + 1) * slots) if row[q] == e]
                if own:
                    assert p == own[0]
    rt = resolve_runtime(
        _engine("sglang"), ["hopper"] * ep, [str(g // per_node) for g in range(ep)]
    )
    share = [rng.random() + 0.1 for _ in range(ep)]
    for li, per_slot in enumerate(served_shares(rt, rows, experts, share)):
        for cands in replicas_of(rows[li], experts):
            assert sum(per_slot[p] for p in cands) == pytest.approx(1.0)


def test_dense_rows_advance_the_seeded_spread() -> None:
    """SGLang loads every decoder layer; the trivial dense rows draw too, so the replay must
    run over the full map (the MoE rows alone give other picks)."""
    moe = [[0, 0, 1, 1], [1, 0, 0, 1]]
    rows = full_rows(moe, (2, 3), 4, 2)
    assert rows[0] == [0, 1, 0, 1] and rows[2] == moe[0]
    with_dense = sglang_static_map(rows, 2, 4, 4)
    assert len(with_dense[0]) == 4


def test_locality_split_matches_the_exact_rule_without_draws() -> None:
    """When every node holds a replica of each multi-replica expert, no rank draws, and the
    search's split equals the exact replay."""
    row = [0, 1, 2, 0, 1, 3, 0, 2]  # 4 ranks x 2 slots, nodes {0,1} {2,3}
    rt = resolve_runtime(_engine("sglang"), ["hopper"] * 4, ["a", "a", "b", "b"])
    share = [0.1, 0.2, 0.3, 0.4]
    exact = served_shares(rt, [row], 4, share)[0]
    node_of, totals = [0, 0, 1, 1], [0.3, 0.7]
    for cands in replicas_of(row, 4):
        holders = sorted({p // 2 for p in cands})
        split = locality.split(holders, share, node_of, totals)
        for g in holders:
            assert split[g] == pytest.approx(sum(exact[p] for p in cands if p // 2 == g))


def _rank_by_rank(
    rows: list[list[int]], experts: int, x: list[float], per_node: int, w: list[list[float]]
) -> tuple[list[list[float]], list[list[list[float]]]]:
    """The dynamic rule as its definition reads, one rank at a time: the nearest replica
    (``_nearest``, the function SGLang's rule is checked against), else an even spread."""
    ep = len(x)
    slots = len(rows[0]) // ep
    shares, traffic = [], []
    for li, row in enumerate(rows):
        share = [0.0] * len(row)
        flows = [[0.0] * ep for _ in range(ep)]
        for e, cands in enumerate(replicas_of(row, experts)):
            for q in range(ep):
                near = _nearest(cands, q, slots, per_node)
                picks = [(near, 1.0)] if near != -1 else [(p, 1 / len(cands)) for p in cands]
                for p, f in picks:
                    share[p] += x[q] * f
                    flows[q][p // slots] += x[q] * w[li][e] * f
        shares.append(share)
        traffic.append(flows)
    return shares, traffic


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from([(1, 4), (2, 2), (4, 2), (3, 4), (2, 8)]),
    slots=st.integers(1, 4),
)
def test_the_dynamic_rule_in_aggregate_equals_it_rank_by_rank(
    seed: int, shape: tuple[int, int], slots: int
) -> None:
    """:func:`dispatch`'s dynamic rule treats only the ranks on a node holding a replica one
    by one; the shares and the traffic are those of the rule applied to every rank."""
    nodes, per_node = shape
    ep = nodes * per_node
    rng = random.Random(seed)
    experts = min(ep * slots, rng.choice([2, 4, 8]))
    rows = []
    for _ in range(2):
        row = list(range(experts)) + [rng.randrange(experts) for _ in range(ep * slots - experts)]
        rng.shuffle(row)
        rows.append(row)
    x = [rng.random() + 0.01 for _ in range(ep)]
    w = [[rng.random() for _ in range(experts)] for _ in rows]
    rt = dataclasses.replace(
        resolve_runtime(_engine("sglang", dispatch="dynamic"), ["hopper"] * ep, ["n"] * ep),
        gpus_per_node=per_node,
    )
    got_shares, got_traffic = dispatch(rt, rows, experts, x, weights=w)
    total = sum(x)
    want_shares, want_traffic = _rank_by_rank(rows, experts, [v / total for v in x], per_node, w)
    assert got_traffic is not None
    for got, want in zip(got_shares, want_shares, strict=True):
        assert got == pytest.approx(want, abs=1e-12)
    for got_m, want_m in zip(got_traffic, want_traffic, strict=True):
        for got, want in zip(got_m, want_m, strict=True):
            assert got == pytest.approx(want, abs=1e-12)


# --------------------------------------------------------------------------- solving


def _req(nodes: Nodes, engine: EngineSpec, policy: str = "ilp") -> PlacementRequest:
    m = tiny_model(experts=8, moe_layers=2)
    w = workload(m, [[8, 6, 5, 4, 3, 2, 1, 1], [1, 1, 2, 3, 4, 5, 6, 8]])
    return dataclasses.replace(
        request(fleet(nodes), m, w, policy=policy, redundant=4, time_limit_s=10), engine=engine
    )


def test_engine_balancing_gives_equal_shares_and_unit_weights() -> None:
    plan = solve(_req(MIXED, _engine("vllm", dp_balance="engine"))).plan
    assert {round(g.attention_share, 9) for g in plan.gpus} == {0.25}
    assert {g.dp_weight for g in plan.gpus} == {1.0}
    assert plan.engine.name == "vllm" and plan.engine.dp_balance == "engine"


def test_router_weights_are_the_planned_shares() -> None:
    plan = solve(_req(MIXED, _engine("vllm"))).plan
    assert sum(g.dp_weight for g in plan.gpus) == pytest.approx(4.0)
    for g in plan.gpus:
        assert g.dp_weight == pytest.approx(g.attention_share * 4)


def test_every_gpu_of_a_plan_gets_the_group_backend() -> None:
    for engine in ("native", "sglang", "vllm", "trtllm"):
        plan = solve(_req(MIXED, _engine(engine))).plan
        assert len({g.hints.ep_backend for g in plan.gpus}) == 1, engine
        assert plan.gpus[0].hints.ep_backend == plan.engine.a2a_backend


@pytest.mark.parametrize("engine", ["sglang", "vllm", "trtllm", "native"])
def test_ilp_never_loses_to_eplb_under_the_engine_rule(engine: str) -> None:
    # trtllm: no router can set its DP ranks' shares (its HTTP API takes no rank)
    for balance in ("auto", "engine") if engine == "trtllm" else ("router", "engine"):
        spec = _engine(engine, dp_balance=balance)
        ilp = solve(_req(HOPPER, spec)).plan.summary
        eplb = solve(_req(HOPPER, spec, "eplb")).plan.summary
        assert ilp.step_time_us <= eplb.step_time_us * (1 + 1e-9), (engine, balance)


def test_static_plan_shares_are_what_sglang_sends() -> None:
    """The plan's replica shares are the executed ones: recomputing them from the plan's own
    slots with the exact rule gives the same numbers."""
    req = _req(HOPPER, _engine("sglang"), "eplb")
    plan = solve(req).plan
    rows = full_rows(plan.physical_to_logical(), req.model.moe_layers, req.model.num_layers, 8)
    rt = runtime_of(req)
    want = served_shares(rt, rows, 8, [g.attention_share for g in plan.gpus])
    got = [[s.share for g in plan.gpus for s in g.experts[li]] for li in range(2)]
    for li, layer in enumerate(req.model.moe_layers):
        assert got[li] == pytest.approx(want[layer], abs=1e-9)


def test_sglang_refuses_what_it_cannot_load() -> None:
    mixtral = preset("mixtral-8x7b")
    f = fleet([("n0", "H200-SXM-141GB", 8, 900.0)])
    req = dataclasses.replace(
        request(f, mixtral, workload(mixtral), redundant=0), engine=_engine("sglang")
    )
    with pytest.raises(InputError, match="no expert-location support"):
        solve(req)
    native_form = dataclasses.replace(_req(HOPPER, _engine("sglang")), form="native")
    with pytest.raises(InputError, match="equal expert slots"):
        solve(native_form)


def test_gather_exchange_does_not_depend_on_the_placement() -> None:
    """With an all-gather backend every GPU receives every token: the exchange phase is the
    same for any expert placement (its bandwidth: tests/policies/test_gather_bandwidth.py)."""
    req = _req(MIXED, _engine("sglang"))
    table = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    share = [0.1, 0.2, 0.3, 0.4]
    packed = LayerPlacement(
        (((0, 1.0), (1, 1.0), (2, 1.0)), ((3, 1.0),), ((4, 1.0), (5, 1.0)), ((6, 1.0), (7, 1.0)))
    )
    spread = LayerPlacement(
        (((0, 1.0), (4, 1.0)), ((1, 1.0), (5, 1.0)), ((2, 1.0), (6, 1.0)), ((3, 1.0), (7, 1.0)))
    )
    gathered = [evaluate(table, share, [lay, lay], "allgather") for lay in (packed, spread)]
    assert gathered[0].moe_layers[0].comm_us == gathered[1].moe_layers[0].comm_us
    assert list(gathered[0].moe_layers[0].comm_us) == gather_times_us(table, share)
    a2a = evaluate(table, share, [packed, packed])
    assert (
        a2a.moe_layers[0].comm_us != evaluate(table, share, [spread, spread]).moe_layers[0].comm_us
    )


def test_executed_keeps_planned_shares_for_native() -> None:
    req = _req(MIXED, EngineSpec())
    raw = RawPlacement((0.1, 0.2, 0.3, 0.4), ())
    assert executed(req, runtime_of(req), raw).attention_share == (0.1, 0.2, 0.3, 0.4)


def test_dp_balance_auto_is_router_where_the_http_api_takes_a_rank_and_engine_for_trtllm() -> None:
    from policies.estimate.engines import parse_engine

    assert parse_engine({"name": "sglang"}).dp_balance == "router"
    assert parse_engine({"name": "vllm"}).dp_balance == "router"
    trt = parse_engine({"name": "trtllm"})
    assert trt.options.dp_balance == "auto" and trt.dp_balance == "engine" and trt.equal_dp
    assert parse_engine({"name": "trtllm", "options": {"dpBalance": "engine"}}).equal_dp
    with pytest.raises(InputError) as err:
        parse_engine({"name": "trtllm", "options": {"dpBalance": "router"}})
    assert err.value.field == "engine.options.dpBalance"
    assert "no per-request DP rank" in str(err.value)
