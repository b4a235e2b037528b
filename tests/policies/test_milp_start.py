"""A MIP start never stands in for the solver's answer (policies/solvers/milp.py).

HiGHS 1.16 solved the fleet planner's cost program below (hopper-blackwell-24, DeepSeek-V3
4096/512 at 29.69 requests/s, started from the served-demand stage's answer) to its optimum,
77.6 USD/h, and reported that objective with the start's column values, a 101.52 USD/h plan:
the planner shipped the dearer plan. The program is the planner's formulation (constraints
(1)-(3) of policies/fleetplan/planner.py) with its coefficients rounded.
"""

from __future__ import annotations

import pytest

from policies.solvers.milp import Limits, Model

DEMAND_RPS = 29.686
B, H100, H200 = "b200", "h100", "h200"

#: Aggregated variants: (USD/h, requests/s, node groups used).
AGGREGATED = [
    (47.2, 21.97, (B,)),
    (30.4, 7.71, (H200,)),
    (71.12, 11.10, (H100, B)),
    (54.32, 11.10, (H100, H200)),
]
#: Prefill/decode pairs: ((USD/h, requests/s, groups) of the prefill, of the decode).
PAIRS = [
    ((30.4, 17.78, (H200,)), (47.2, 128.26, (B,))),
    ((54.32, 25.19, (H100, H200)), (47.2, 128.31, (B,))),
    ((47.2, 37.98, (B,)), (30.4, 44.45, (H200,))),
    ((71.12, 25.19, (H100, B)), (30.4, 44.45, (H200,))),
    ((47.2, 37.98, (B,)), (54.32, 39.61, (H100, H200))),
]


def _program() -> tuple[Model, list[tuple[int, float]], list[int]]:
    """The cost program: ``(model, (column, USD/h) per instance column, the last pair's
    prefill and decode columns)``."""
    m = Model("fleet_cost")
    cost: list[tuple[int, float]] = []
    rates: list[int] = []
    use: dict[str, list[int]] = {B: [], H100: [], H200: []}

    def instances(usd: float, groups: tuple[str, ...]) -> int:
        col = m.var(0, 1, integer=True)
        cost.append((col, usd))
        for g in groups:
            use[g].append(col)
        return col

    for usd, rps, groups in AGGREGATED:
        x, r = instances(usd, groups), m.var(0)
        m.le([(r, 1.0), (x, -rps)], 0.0)
        rates.append(r)
    last: list[int] = []
    for (p_usd, p_rps, p_groups), (d_usd, d_rps, d_groups) in PAIRS:
        y, z, f = instances(p_usd, p_groups), instances(d_usd, d_groups), m.var(0)
        m.le([(f, 1.0), (y, -p_rps)], 0.0)
        m.le([(f, 1.0), (z, -d_rps)], 0.0)
        rates.append(f)
        last = [y, z]
    served = m.var(0, DEMAND_RPS)
    m.eq([(served, 1.0), *((r, -1.0) for r in rates)], 0.0)
    for cols in use.values():  # one node per group
        m.le([(c, 1.0) for c in cols], 1.0)
    m.ge([(served, 1.0 / DEMAND_RPS)], 1.0 - 1e-6)  # the demand, from the first stage
    m.minimise(cost)
    return m, cost, last


def test_the_answer_is_the_solvers_not_the_start() -> None:
    m, cost, last = _program()
    for col, _ in cost:
        m.set_start(col, 1.0 if col in last else 0.0)  # feasible, 101.52 USD/h
    out = m.solve(solver="highs", limits=Limits(max_nodes=500, mip_gap=0.02))
    assert out.status == "optimal"
    assert out.objective == pytest.approx(77.6)
    planned = sum(usd * round(out.values[col]) for col, usd in cost)
    assert planned == pytest.approx(out.objective)  # B200 prefill -> H200 decode
