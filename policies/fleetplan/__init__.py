"""The fleet planner: which engine instances (variants x counts, aggregated or prefill/decode
pools) serve every deployment's demand within its SLOs, at least cost, by priority when the
fleet is short.

- :mod:`policies.fleetplan.curves` - a variant's step curve, computed once per node
  make-up from the one cost model, keyed for a cache (:class:`CurveCache`);
- :mod:`policies.fleetplan.sizing` - batch limit, capacity and latencies of one instance
  read from its curve;
- :mod:`policies.fleetplan.planner` - the front door (:func:`plan_fleet`) and the
  formulation: variants, the integer program, the reply;
- :mod:`policies.fleetplan.candidates` - node make-ups, their curves and the variants sized
  from them; :mod:`policies.fleetplan.pairs` - prefill/decode pairs and the KV path
  (:func:`kv_path`);
- :mod:`policies.fleetplan.program` - the integer program, solved by priority, then cost;
- :mod:`policies.fleetplan.readback` - counts to pools with nodes, loads, shortfalls;
- :mod:`policies.fleetplan.types` - request and reply types;
- :mod:`policies.fleetplan.report` - the plan as a document (``schedule show -o json``) and
  as the serving simulator's :class:`~policies.serving.plan.ServingPlan`.

Pure: no I/O.
"""

from policies.fleetplan.curves import (
    CURVE_VERSION,
    CurveCache,
    CurveEntry,
    CurveGrid,
    MemoryCurveCache,
    compute_curve,
    curve_key,
)
from policies.fleetplan.planner import kv_path, plan_fleet
from policies.fleetplan.types import (
    DISAGGREGATION,
    ROLES,
    DeploymentPlan,
    FleetDeployment,
    FleetPlan,
    PlannedGroup,
    PlannedPool,
    PlannerSettings,
    PlanRequest,
    Shortfall,
    Variant,
)

__all__ = [
    "CURVE_VERSION",
    "DISAGGREGATION",
    "ROLES",
    "CurveCache",
    "CurveEntry",
    "CurveGrid",
    "DeploymentPlan",
    "FleetDeployment",
    "FleetPlan",
    "MemoryCurveCache",
    "PlanRequest",
    "PlannedGroup",
    "PlannedPool",
    "PlannerSettings",
    "Shortfall",
    "Variant",
    "compute_curve",
    "curve_key",
    "kv_path",
    "plan_fleet",
]
