"""Carrying out the decision: the solves and tier splits :func:`operators.decide.reconcile`
asks for, and the writes its actions stand for.

* :func:`run_solve` and :func:`run_tiers` call the (injectable) planner and turn its spec
  errors into failed outcomes - permanent ones the decision reports in the status - never
  into exceptions.
* :func:`act` carries out the actions in order: PartitionPlans are created (a name already
  taken means another writer allocated the version first: re-observe), ConfigMaps and the
  status subresource go through server-side apply (forced: the operator is their only
  author; it never applies the user's spec; an engine instance's ModelDeployment is its own
  object, put back when someone else edits it), deletes carry the uid as precondition,
  and the finalizer is set through a JSON merge patch guarded by resourceVersion and
  retried on 409 (:func:`set_finalizer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import structlog
from prometheus_client import Histogram

from apis.kube.client import CONFIGMAPS, MODEL_DEPLOYMENTS, PARTITION_PLANS, Json, Kube
from apis.kube.errors import ConflictError, InvalidError, NotFoundError, TemporaryError
from apis.kube.names import FINALIZER
from apis.kube.versions import record_version
from operators.decide import (
    Action,
    ApplyChild,
    ApplyConfigMap,
    ApplyPlan,
    ApplyStatus,
    DeleteChild,
    DeleteConfigMap,
    DeletePlan,
    Requeue,
    SetFinalizer,
    SolveAction,
    TierAction,
)
from operators.informer import Key
from operators.observe import DeploymentView, Observed, SolveOutcome, TierOutcome
from policies.advice.tiers import TierPlan, TierRequest
from policies.errors import InfeasibleError, InputError, SolverError
from policies.request import PlacementRequest, PlacementResult

SOLVES = Histogram(
    "mixfleet_operator_solve_seconds",
    "Wall time of placement solves, seconds",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
TIER_SPLITS = Histogram(
    "mixfleet_operator_tier_split_seconds",
    "Wall time of interactive / batch tier splits, seconds",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)

_log = structlog.get_logger("mixfleet.operator")


def run_solve(
    solver: Callable[[PlacementRequest], PlacementResult], action: SolveAction
) -> SolveOutcome:
    """Run one placement solve; spec errors become a failed outcome, not an exception."""
    t0 = time.monotonic()
    try:
        result = solver(action.request).require_placed()
    except InfeasibleError as exc:
        return SolveOutcome(
            action.inputs_digest, None, "Infeasible", str(exc), time.monotonic() - t0
        )
    except InputError as exc:
        return SolveOutcome(
            action.inputs_digest, None, "InvalidSpec", str(exc), time.monotonic() - t0
        )
    except SolverError as exc:
        return SolveOutcome(
            action.inputs_digest, None, "SolverError", str(exc), time.monotonic() - t0
        )
    elapsed = time.monotonic() - t0
    SOLVES.observe(elapsed)
    if result.infeasible:
        reasons = "; ".join(result.infeasible[:8])
        return SolveOutcome(
            action.inputs_digest,
            None,
            "Infeasible",
            f"no placement satisfies every constraint: {reasons}. To fix: add GPUs, "
            "lower workload.tokensPerGpu or contextLen, or use kvCacheDtype: fp8",
            elapsed,
        )
    return SolveOutcome(action.inputs_digest, result.plan, "Solved", "", elapsed)


def run_tiers(planner: Callable[[TierRequest], TierPlan], action: TierAction) -> TierOutcome:
    """Split the nodes into interactive and batch tiers; a bad tier becomes a failed
    outcome (``InvalidTier``, permanent), a solver failure ``TierPlanningFailed``
    (retried), never an exception."""
    t0 = time.monotonic()
    try:
        split = planner(action.request)
    except InputError as exc:
        return TierOutcome(
            action.inputs_digest,
            None,
            "InvalidTier",
            f"{exc}. To fix: correct the PlacementPolicy's interactive tier or the "
            "deployment's spec",
            time.monotonic() - t0,
        )
    except (InfeasibleError, SolverError) as exc:
        return TierOutcome(
            action.inputs_digest, None, "TierPlanningFailed", str(exc), time.monotonic() - t0
        )
    elapsed = time.monotonic() - t0
    TIER_SPLITS.observe(elapsed)
    return TierOutcome(action.inputs_digest, split, "Planned", "", elapsed)


def act(
    kube: Kube,
    observed: Observed,
    actions: Iterable[Action],
    *,
    requeue: Callable[[Key, float], None],
    conflict_retries: int,
) -> None:
    """Carry out the actions in order.

    Args:
        kube: API access (its write guard checks leadership on every write).
        observed: the observation the actions were decided from.
        actions: what :func:`operators.decide.reconcile` returned.
        requeue: ``(key, after_s)`` puts the deployment back on the work queue after
            ``after_s`` seconds.
        conflict_retries: attempts of the finalizer's read-modify-write on 409 Conflict.
    """
    d = observed.deployment
    ns = d.namespace
    for a in actions:
        if isinstance(a, SetFinalizer):
            set_finalizer(kube, d, a.present, conflict_retries=conflict_retries)
        elif isinstance(a, ApplyPlan):
            create_plan(kube, a.body)
        elif isinstance(a, DeletePlan):
            kube.delete(PARTITION_PLANS, a.name, ns, uid=a.uid or None)
        elif isinstance(a, ApplyConfigMap):
            kube.apply(CONFIGMAPS, a.body, force=True)  # the operator's own object
        elif isinstance(a, DeleteConfigMap):
            kube.delete(CONFIGMAPS, a.name, ns)
        elif isinstance(a, ApplyChild):
            kube.apply(MODEL_DEPLOYMENTS, a.body, force=True)  # the operator's own object
            if a.remove:  # what another writer added to its spec: put back
                kube.merge_patch(MODEL_DEPLOYMENTS, a.name, {"spec": a.remove}, ns)
        elif isinstance(a, DeleteChild):
            kube.delete(MODEL_DEPLOYMENTS, a.name, ns, uid=a.uid or None)
        elif isinstance(a, ApplyStatus):
            body = {"metadata": {"name": d.name, "namespace": ns}, "status": a.status}
            try:
                # The operator is the authority on its status fields (the controller's
                # committedVersion and controller document are another manager's).
                kube.apply(MODEL_DEPLOYMENTS, body, subresource="status", force=True)
            except NotFoundError:
                return  # deleted meanwhile
        elif isinstance(a, Requeue):
            requeue((ns, d.name), a.after_s)


def create_plan(kube: Kube, body: Json) -> None:
    """Create a PartitionPlan and record its version; a name already taken means another
    writer allocated the version first - observe again.

    Raises:
        TemporaryError: the name is taken, or the API rejected the object.
    """
    meta = body["metadata"]
    try:
        kube.create(
            PARTITION_PLANS,
            dict(body, apiVersion=PARTITION_PLANS.api_version, kind=PARTITION_PLANS.kind),
        )
    except ConflictError as exc:
        raise TemporaryError(
            f"PartitionPlan {body['metadata']['name']} exists already; re-observing",
            delay_s=0.1,
        ) from exc
    except InvalidError as exc:
        raise TemporaryError(f"PartitionPlan rejected: {exc}") from exc
    record_version(
        kube, meta["namespace"], body["spec"]["deployment"], int(body["spec"]["version"])
    )


def set_finalizer(kube: Kube, d: DeploymentView, present: bool, *, conflict_retries: int) -> None:
    """Add or remove the finalizer: read, modify, merge patch with resourceVersion as
    precondition; on 409 read again (at most ``conflict_retries`` times).

    Raises:
        ConflictError: every attempt met a conflict.
    """
    for attempt in range(conflict_retries):
        obj = kube.get(MODEL_DEPLOYMENTS, d.name, d.namespace)
        if obj is None or obj["metadata"].get("uid") != d.uid:
            return
        finalizers = list(obj["metadata"].get("finalizers") or [])
        if (FINALIZER in finalizers) == present:
            return
        if present:
            finalizers.append(FINALIZER)
        else:
            finalizers = [f for f in finalizers if f != FINALIZER]
        patch = {
            "metadata": {
                "finalizers": finalizers or None,
                "resourceVersion": obj["metadata"]["resourceVersion"],
            }
        }
        try:
            kube.merge_patch(MODEL_DEPLOYMENTS, d.name, patch, d.namespace)
            return
        except ConflictError:
            _log.info("finalizer conflict; retrying", deployment=d.name, attempt=attempt + 1)
        except NotFoundError:
            return
    raise ConflictError(409, "Conflict", f"finalizer of {d.namespace}/{d.name}: too many conflicts")
