"""PlanService: deployments, plans, nodes and the strategy questions of mixfleetctl."""

# ruff: noqa: N802  (gRPC servicer methods are named after the RPCs)

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mixfleet.v1 import plan_pb2, plan_pb2_grpc

from apis.documents import load_json_field
from apis.wire.deployment import spec_from_proto
from controlplane.errors import NotFoundError
from controlplane.server.controller import Controller
from controlplane.server.services.guard import Ctx
from controlplane.server.strategies import StrategyService
from controlplane.store import StoredDeployment
from controlplane.wire.instances import instance_to_proto
from controlplane.wire.plans import (
    deployment_to_proto,
    diff_to_proto,
    node_to_proto,
    plan_to_proto,
    unstored_plan_to_proto,
)
from controlplane.wire.strategies import (
    batch_question,
    batch_to_proto,
    context_question,
    context_to_proto,
    cost_question,
    cost_to_proto,
    min_cost_question,
    min_cost_to_proto,
    tiers_question,
    tiers_to_proto,
)
from policies.assignment import diff_plans
from policies.errors import InfeasibleError, InputError
from policies.hardware.fleet import Fleet, parse_fleet
from policies.limits import MAX_VERSION, bounded_int
from policies.spec.build import DeploymentSpec, check_spec


class PlanServicer(plan_pb2_grpc.PlanServiceServicer):
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.strategies = StrategyService(controller)

    def _deployment(self, d: StoredDeployment) -> plan_pb2.Deployment:
        latest = self.c.store.list_plans(d.name, limit=1)
        return deployment_to_proto(d, latest_version=latest[0].version if latest else 0)

    async def _apply(
        self, request: plan_pb2.ApplyDeploymentRequest, *, create: bool, update: bool
    ) -> plan_pb2.Deployment:
        if not request.HasField("spec"):
            raise InputError("missing", field="spec")
        spec = await asyncio.to_thread(_checked_spec, request.spec)  # off the loop
        return self._deployment(
            self.c.apply_deployment(spec, create_only=create, update_only=update, checked=True)
        )

    async def CreateDeployment(
        self, request: plan_pb2.ApplyDeploymentRequest, context: Ctx
    ) -> plan_pb2.Deployment:
        return await self._apply(request, create=True, update=False)

    async def UpdateDeployment(
        self, request: plan_pb2.ApplyDeploymentRequest, context: Ctx
    ) -> plan_pb2.Deployment:
        return await self._apply(request, create=False, update=True)

    async def ApplyDeployment(
        self, request: plan_pb2.ApplyDeploymentRequest, context: Ctx
    ) -> plan_pb2.Deployment:
        return await self._apply(request, create=False, update=False)

    async def DeleteDeployment(
        self, request: plan_pb2.DeleteDeploymentRequest, context: Ctx
    ) -> plan_pb2.DeleteDeploymentResponse:
        if not request.name:
            raise InputError("missing", field="name")
        return plan_pb2.DeleteDeploymentResponse(deleted=self.c.delete_deployment(request.name))

    async def GetDeployment(
        self, request: plan_pb2.GetDeploymentRequest, context: Ctx
    ) -> plan_pb2.Deployment:
        msg = self._deployment(self.c.get_deployment(request.name))
        served = await asyncio.to_thread(
            self.c.endpoints.instances, request.name
        )  # reads each instance
        msg.status.instances.extend(instance_to_proto(i) for i in served.instances)
        return msg

    async def ListDeployments(
        self, request: plan_pb2.ListDeploymentsRequest, context: Ctx
    ) -> plan_pb2.ListDeploymentsResponse:
        return plan_pb2.ListDeploymentsResponse(
            deployments=[self._deployment(d) for d in self.c.store.list_deployments()]
        )

    async def Solve(self, request: plan_pb2.SolveRequest, context: Ctx) -> plan_pb2.SolveResponse:
        if not request.HasField("spec"):
            raise InputError("missing", field="spec")
        # Parsing a model config and expanding a fleet grow with the input: off the loop.
        spec, fleet = await asyncio.to_thread(_solve_inputs, request)
        try:
            result = await self.c.dry_run(spec, fleet)
        except InfeasibleError as exc:
            return plan_pb2.SolveResponse(infeasible=[str(exc).split("\n")[0], *exc.reasons])
        plan = await asyncio.to_thread(  # the plan document grows with the fleet
            unstored_plan_to_proto, result.plan, with_doc=request.include_plan
        )
        return plan_pb2.SolveResponse(plan=plan, infeasible=list(result.infeasible))

    async def GetPlan(self, request: plan_pb2.GetPlanRequest, context: Ctx) -> plan_pb2.PlanRecord:
        if not request.deployment:
            raise InputError("missing", field="deployment")
        bounded_int(request.version, "version", minimum=0, maximum=MAX_VERSION)
        # Reading a plan document back and encoding it grows with the fleet (about a second
        # at 2,000 GPUs): a thread keeps heartbeats and rollouts moving meanwhile.
        p = await asyncio.to_thread(self.c.get_plan, request.deployment, request.version)
        acks = self.c.acks_of(p.deployment, p.version)
        return await asyncio.to_thread(plan_to_proto, p, acks=acks, with_doc=True)

    async def ListPlans(
        self, request: plan_pb2.ListPlansRequest, context: Ctx
    ) -> plan_pb2.ListPlansResponse:
        if request.limit < 0:
            raise InputError("must be >= 0", field="limit")
        plans = self.c.store.list_plans(request.deployment or None, limit=request.limit or 50)
        return plan_pb2.ListPlansResponse(plans=[plan_to_proto(p) for p in plans])

    async def WatchPlans(
        self, request: plan_pb2.WatchPlansRequest, context: Ctx
    ) -> AsyncIterator[plan_pb2.PlanEvent]:
        async for p in self.c.watch_plans(request.deployment):
            yield plan_pb2.PlanEvent(plan=plan_to_proto(p))

    async def DiffPlans(
        self, request: plan_pb2.DiffPlansRequest, context: Ctx
    ) -> plan_pb2.PlanDiff:
        if not request.deployment:
            raise InputError("missing", field="deployment")
        bounded_int(request.from_version, "from_version", minimum=0, maximum=MAX_VERSION)
        bounded_int(request.to_version, "to_version", minimum=0, maximum=MAX_VERSION)
        b = self.c.get_plan(request.deployment, request.to_version)
        if request.from_version:
            a = self.c.get_plan(request.deployment, request.from_version)
        else:
            older = [
                p
                for p in self.c.store.list_plans(request.deployment, limit=1000)
                if p.version < b.version and p.state in ("committed", "superseded")
            ]
            if not older:
                raise NotFoundError(
                    f"no served version before {b.version} to compare with. To fix: give "
                    "from_version",
                    field="from_version",
                )
            a = self.c.get_plan(request.deployment, older[0].version)
        assert a.plan is not None and b.plan is not None
        return diff_to_proto(request.deployment, a.version, b.version, diff_plans(a.plan, b.plan))

    async def ListNodes(
        self, request: plan_pb2.ListNodesRequest, context: Ctx
    ) -> plan_pb2.ListNodesResponse:
        return plan_pb2.ListNodesResponse(nodes=[node_to_proto(v) for v in self.c.node_views()])

    async def GetNode(self, request: plan_pb2.GetNodeRequest, context: Ctx) -> plan_pb2.NodeRecord:
        for v in self.c.node_views(only=request.name):
            return node_to_proto(v)
        raise NotFoundError(f"no node {request.name!r}", field="name")

    async def DeleteNode(
        self, request: plan_pb2.DeleteNodeRequest, context: Ctx
    ) -> plan_pb2.DeleteNodeResponse:
        if not request.name:
            raise InputError("missing", field="name")
        served = self.c.delete_node(request.name, force=request.force)
        return plan_pb2.DeleteNodeResponse(deleted=True, deployments=served)

    # Deployment strategies: parse and validate (strategy_wire), answer on the live fleet
    # in a worker thread (strategy_service), reply.

    async def AdviseTiers(
        self, request: plan_pb2.AdviseTiersRequest, context: Ctx
    ) -> plan_pb2.AdviseTiersResponse:
        return tiers_to_proto(await self.strategies.tiers(tiers_question(request)))

    async def AdviseBatch(
        self, request: plan_pb2.AdviseBatchRequest, context: Ctx
    ) -> plan_pb2.AdviseBatchResponse:
        return batch_to_proto(await self.strategies.batch(batch_question(request)))

    async def AdviseContext(
        self, request: plan_pb2.AdviseContextRequest, context: Ctx
    ) -> plan_pb2.AdviseContextResponse:
        return context_to_proto(await self.strategies.context(context_question(request)))

    async def EstimateCost(
        self, request: plan_pb2.EstimateCostRequest, context: Ctx
    ) -> plan_pb2.EstimateCostResponse:
        return cost_to_proto(await self.strategies.cost(cost_question(request)))

    async def MinCost(
        self, request: plan_pb2.MinCostRequest, context: Ctx
    ) -> plan_pb2.MinCostResponse:
        answer = await self.strategies.min_cost(min_cost_question(request))
        return min_cost_to_proto(answer, with_docs=request.include_plans)


def _solve_inputs(request: plan_pb2.SolveRequest) -> tuple[DeploymentSpec, Fleet | None]:
    """The spec and the optional fleet of a Solve request (run in a thread).

    Raises:
        InputError: naming the field.
    """
    spec = spec_from_proto(request.spec)
    check_spec(spec)
    if not request.fleet_json:
        return spec, None
    doc = load_json_field(request.fleet_json, "fleet", "fleet_json")
    try:
        return spec, parse_fleet(doc)
    except InputError as exc:
        raise InputError(str(exc), field=f"fleet_json.{exc.field}") from exc


def _checked_spec(message: plan_pb2.DeploymentSpec) -> DeploymentSpec:
    """The request's spec, parsed and checked (run in a thread).

    Raises:
        InputError: naming the field.
    """
    spec = spec_from_proto(message)
    check_spec(spec)
    return spec
