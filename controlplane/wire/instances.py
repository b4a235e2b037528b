"""Conversions of a deployment's engine instances and demand to ``mixfleet.v1`` messages:
``Instances`` (EngineService.WatchInstances, and GetDeployment's ``status.instances``) and
``DemandStatus`` (a deployment's planned vs measured demand). Copying only; the figures are
:mod:`controlplane.server.controller.endpoints`' and :mod:`controlplane.server.controller.demand`'s.

Units: requests per second, tokens, milliseconds (``_ms``), Unix seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixfleet.v1 import engine_pb2, plan_pb2

from controlplane.server.controller.demand import DemandStatus
from controlplane.server.controller.endpoints import InstanceEndpoint, InstanceSet
from controlplane.server.controller.instance_records import INSTANCES_KEY, InstanceRecord
from controlplane.server.controller.instances import FLEET_PLAN_KEY
from controlplane.server.controller.measured import MeasuredDemand
from policies.spec.build import DeploymentSpec


def instance_to_proto(i: InstanceEndpoint) -> engine_pb2.Instance:
    """One instance as ``mixfleet.v1.Instance``."""
    return engine_pb2.Instance(
        name=i.name,
        role=i.role,
        pool=i.pool,
        nodes=list(i.nodes),
        url=i.url,
        bootstrap_port=i.bootstrap_port,
        requests_per_s=i.requests_per_s,
        batch_limit=i.batch_limit,
        version=i.version,
        ready=i.ready,
        variant=i.variant,
        ttft_ms=i.ttft_ms,
        tpot_ms=i.tpot_ms,
        capacity_requests_per_s=i.capacity_requests_per_s,
        draining=i.draining,
        retiring=i.retiring,
    )


def instances_to_proto(s: InstanceSet, generation: int) -> engine_pb2.Instances:
    """A deployment's instances as ``mixfleet.v1.Instances``."""
    return engine_pb2.Instances(
        deployment=s.deployment,
        engine=s.engine,
        generation=generation,
        instances=[instance_to_proto(i) for i in s.instances],
        slo_ttft_ms=s.slo_ttft_ms,
        slo_tpot_ms=s.slo_tpot_ms,
        slo_percentile=s.slo_percentile,
    )


def instance_fields(status: Mapping[str, Any]) -> tuple[str, int]:
    """``(instance_of, instance_count)`` of a deployment's stored status: the deployment an
    instance serves (""), and how many instances a deployment has (0)."""
    record = InstanceRecord.from_status(status)
    listed = status.get(INSTANCES_KEY)
    count = len(listed) if isinstance(listed, list | tuple) else 0
    return (record.of if record is not None else ""), count


def demand_to_proto(
    spec: DeploymentSpec, status: Mapping[str, Any]
) -> plan_pb2.DemandStatus | None:
    """A deployment's planned vs measured demand (None when it has neither)."""
    st = DemandStatus.from_status(status)
    planned = st.planning_traffic(spec)
    if planned is None and st.measured is None:
        return None
    msg = plan_pb2.DemandStatus(
        planned_from_measurement=planned is not None and planned is st.planned,
        last_replan_unix_s=st.last_replan_s or 0.0,
        last_replan_reason=st.last_replan_reason,
        replans=st.replans,
        slo_percentile=spec.slo.percentile if spec.slo is not None else 0.0,
    )
    if planned is not None:
        msg.planned.CopyFrom(
            plan_pb2.DemandFigures(
                requests_per_s=planned.requests_per_s,
                input_tokens_mean=planned.input_len.mean,
                input_tokens_p90=planned.input_len.p90,
                output_tokens_mean=planned.output_len.mean,
                output_tokens_p90=planned.output_len.p90,
            )
        )
    if st.measured is not None:
        msg.measured.CopyFrom(_measured(st.measured))
        msg.measured_end_unix_s = st.measured.end_s
        msg.measured_seconds = st.measured.end_s - st.measured.start_s
        msg.reporters = st.measured.reporters
    summary = status.get(FLEET_PLAN_KEY)
    if isinstance(summary, Mapping):
        msg.predicted_ttft_ms = _number(summary.get("ttft_ms"))
        msg.predicted_tpot_ms = _number(summary.get("tpot_ms"))
    return msg


def _measured(m: MeasuredDemand) -> plan_pb2.DemandFigures:
    return plan_pb2.DemandFigures(
        requests_per_s=m.requests_per_s,
        input_tokens_mean=m.input_tokens_mean,
        input_tokens_p90=m.input_tokens_p90,
        output_tokens_mean=m.output_tokens_mean,
        output_tokens_p90=m.output_tokens_p90,
        ttft_ms_p50=m.ttft_ms_p50,
        ttft_ms_p99=m.ttft_ms_p99,
        tpot_ms_p50=m.tpot_ms_p50,
        tpot_ms_p99=m.tpot_ms_p99,
        slo_attainment=m.slo_attainment,
    )


def _number(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0
