"""Plan validity as properties over random fleets and loads (hypothesis)."""

from __future__ import annotations

from builders import fleet, request, tiny_model, workload
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policies.plan import validate_plan
from policies.request import POLICIES
from policies.solve import solve

GPU_TYPES = ["A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM-141GB", "L40S", "B200"]


@st.composite
def instances(draw: st.DrawFn) -> tuple[object, ...]:
    n_nodes = draw(st.integers(1, 3))
    nodes = []
    for k in range(n_nodes):
        model = draw(st.sampled_from(GPU_TYPES))
        count = draw(st.sampled_from([1, 2, 4]))
        nvl = None if model == "L40S" else draw(st.sampled_from([None, 600.0, 900.0]))
        nodes.append((f"n{k}", model, count, nvl))
    gpus = sum(c for _, _, c, _ in nodes)
    experts = draw(st.sampled_from([4, 8, 16]))
    layers = draw(st.integers(1, 3))
    load = [[draw(st.floats(0.0, 100.0)) for _ in range(experts)] for _ in range(layers)]
    # engine form needs experts + redundant divisible by the GPU count, and at most
    # `experts` slots per GPU
    slots = max(1, -(-experts // gpus))
    redundant = slots * gpus - experts + draw(st.integers(0, 1)) * gpus
    redundant = min(redundant, experts * gpus - experts)
    form = draw(st.sampled_from(["engine", "native"]))
    phase = draw(st.sampled_from(["decode", "prefill"]))
    return nodes, experts, layers, load, redundant, form, phase


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
@example(  # the greedy warm start held more replicas than the ILP's bound: solved cold now
    (
        [("n0", "A100-SXM4-80GB", 4, None), ("n1", "A100-SXM4-80GB", 4, None)],
        4,
        3,
        [[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        4,
        "native",
        "decode",
    )
)
def test_every_policy_returns_a_valid_plan(inst: tuple[object, ...]) -> None:
    nodes, experts, layers, load, redundant, form, phase = inst
    m = tiny_model(experts=experts, moe_layers=layers)  # type: ignore[arg-type]
    f = fleet(nodes)  # type: ignore[arg-type]
    w = workload(m, load, phase=phase, tokens=32, context=512)  # type: ignore[arg-type]
    results = {}
    for policy in POLICIES:
        req = request(f, m, w, policy=policy, form=form, redundant=redundant, time_limit_s=5)  # type: ignore[arg-type]
        plan = solve(req).plan
        results[policy] = plan
        # Structural invariants hold for every policy: coverage, shares, slots.
        structural = [p for p in validate_plan(plan) if "GiB" not in p]
        assert structural == [], (policy, structural)
        assert abs(sum(g.attention_share for g in plan.gpus) - 1) < 1e-6
        assert plan.summary.step_time_us > 0
    ilp = results["ilp"].summary
    greedy = results["greedy"].summary
    # The ILP keeps the better of its realisation and greedy, per layer and overall.
    assert ilp.step_time_us <= greedy.step_time_us * (1 + 1e-6) or not greedy.feasible
    if ilp.lower_bound_us is not None:
        assert ilp.gap is not None and 0 <= ilp.gap < 1
