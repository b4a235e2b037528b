"""Serving: what a deployment must serve and how planned instances serve it.

- :mod:`policies.serving.traffic` - :class:`Traffic` (arrivals, prompt and output lengths as
  :class:`LengthDist`) and :class:`Slo` (TTFT and TPOT at a percentile), with their one
  document codec;
- :mod:`policies.serving.curves` - :class:`StepCurve`, an instance's decode-step and prefill
  times against batch, context and prompt length (filled from the cost model);
- :mod:`policies.serving.plan` - :class:`ServingPlan`: pools of instances (aggregated, or
  prefill/decode pairs with their KV path) and the router's shares;
- :mod:`policies.serving.simulate` - the discrete-event serving simulator
  (:func:`simulate` -> :class:`SimReport`; its engine in :mod:`policies.serving.sim_engine`,
  its options and report in :mod:`policies.serving.sim_types`).

Pure: no I/O.
"""

from policies.serving.curves import StepCurve, check_curve
from policies.serving.plan import (
    InstanceGroup,
    KvPath,
    Pool,
    ServingPlan,
    check_plan,
    plan_from_doc,
    plan_to_doc,
)
from policies.serving.simulate import (
    GroupReport,
    Percentiles,
    PoolReport,
    RequestRecord,
    SimOptions,
    SimReport,
    report_to_doc,
    simulate,
)
from policies.serving.traffic import (
    ARRIVALS,
    LengthDist,
    Slo,
    Traffic,
    check_length_dist,
    check_slo,
    check_traffic,
    length_from_doc,
    length_to_doc,
    slo_from_doc,
    slo_to_doc,
    traffic_from_doc,
    traffic_to_doc,
)

__all__ = [
    "ARRIVALS",
    "GroupReport",
    "InstanceGroup",
    "KvPath",
    "LengthDist",
    "Percentiles",
    "Pool",
    "PoolReport",
    "RequestRecord",
    "ServingPlan",
    "SimOptions",
    "SimReport",
    "Slo",
    "StepCurve",
    "Traffic",
    "check_curve",
    "check_length_dist",
    "check_plan",
    "check_slo",
    "check_traffic",
    "length_from_doc",
    "length_to_doc",
    "plan_from_doc",
    "plan_to_doc",
    "report_to_doc",
    "simulate",
    "slo_from_doc",
    "slo_to_doc",
    "traffic_from_doc",
    "traffic_to_doc",
]
