"""No request makes the controller fail: every RPC of AgentService, PlanService and
EngineService gets generated messages (random, and valid ones with fields replaced by edge
values; :mod:`support.protofuzz`) over real gRPC on loopback. A call that comes back
INTERNAL, UNKNOWN or UNAVAILABLE, hangs (no answer within its deadline), or leaves the controller
unable to answer its health check fails the test with the request that did it.

Bounded: :data:`EXAMPLES` requests per RPC, a fixed seed (``derandomize``), the ILP held to
1 s; about 20 s in all on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import HealthCheck, Phase, given, settings
from mixfleet.v1 import agent_pb2, plan_pb2
from support.fuzztarget import CALL_TIMEOUT_S, FAILURES, FuzzTarget, base_spec
from support.protofuzz import methods, request_batches, rpc_name, small_inventories

from apis.wire.deployment import spec_to_proto
from apis.wire.inventory import inventory_to_proto

#: Requests per RPC.
EXAMPLES = 25


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    with FuzzTarget(Path(tmp_path_factory.mktemp("fuzz"))) as t:
        yield t


def _shown(request: Any) -> str:
    items = request if isinstance(request, list) else [request]
    text = "\n---\n".join(text_format.MessageToString(r, as_one_line=True) for r in items)
    return text if len(text) < 2000 else text[:2000] + "..."


@pytest.mark.parametrize("method", methods(), ids=rpc_name)
def test_no_request_makes_the_controller_fail(target: FuzzTarget, method: MethodDescriptor) -> None:
    target.reset()
    bases = target.bases()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )
    @given(request_batches(method, bases))
    def one(request: object) -> None:
        out = target.call(method, request)  # type: ignore[arg-type]
        assert out.code not in FAILURES, (
            f"{rpc_name(method)} -> {out.code}: {out.detail}\nrequest: {_shown(request)}"
        )
        assert out.code != "DEADLINE_EXCEEDED", (  # hung: no answer within CALL_TIMEOUT_S
            f"{rpc_name(method)} unanswered after {CALL_TIMEOUT_S:.0f} s\nrequest: {_shown(request)}"
        )

    one()
    assert target.alive() and target.serving(), "the controller stopped answering"


def _register_n0(node: str = "n0", **gpu: Any) -> agent_pb2.RegisterRequest:
    inv = small_inventories()[0]
    inv = replace(inv, node=node, gpus=tuple(replace(g, **gpu) for g in inv.gpus))
    return agent_pb2.RegisterRequest(inventory=inventory_to_proto(inv))


def _load_json_spec(raw: bytes) -> plan_pb2.SolveRequest:
    spec = spec_to_proto(base_spec())
    spec.workload.load_json = raw
    return plan_pb2.SolveRequest(spec=spec)


#: What the generator found (INTERNAL before the fix), kept as fixed examples:
#: (RPC, request, the field the INVALID_ARGUMENT must name).
FOUND = [
    ("GetPlan", plan_pb2.GetPlanRequest(deployment="mx", version=(1 << 64) - 1), "version"),
    ("DiffPlans", plan_pb2.DiffPlansRequest(deployment="mx", from_version=1 << 63), "from_"),
    ("Solve", _load_json_spec(b"[[1.0], 2.0]"), "load"),
    ("Solve", _load_json_spec(b"[[[1.0]], 2.0]"), "load"),
    # a GPU of ~0 HBM bandwidth: the ILP of a later dry run divided by zero or failed in HiGHS
    ("Register", _register_n0(hbm_bandwidth_gbytes_per_s=1e-300), "hbm_bandwidth"),
    ("Register", _register_n0(memory_bytes=1), "memory_bytes"),
    ("Register", _register_n0(measured={"hbm_gbytes_per_s": 5e-324}), "measured"),
    # node names with spaces, '%' or a right-to-left override registered and were shown
    ("Register", _register_n0("é\u202e"), "inventory.node"),
    ("Register", _register_n0("%s%n"), "not a host name"),
]


@pytest.mark.parametrize(("rpc", "request_", "field"), FOUND, ids=[f[0] for f in FOUND])
def test_what_the_generator_found_stays_refused(
    target: FuzzTarget, rpc: str, request_: Any, field: str
) -> None:
    target.reset()
    method = next(m for m in methods() if m.name == rpc)
    out = target.call(method, request_)
    assert out.code == "INVALID_ARGUMENT" and field in out.detail, (out.code, out.detail)


def test_a_node_without_nics_beside_networked_ones_is_planned_not_internal(
    target: FuzzTarget,
) -> None:
    """Found by the generator: a node registered with no NIC made the communication time of
    a plan spanning it 0 / 0 = NaN, and the ILP divided by a capacity of 0 (INTERNAL)."""
    target.reset()
    inv = small_inventories()[0]
    lonely = replace(
        inv,
        node="m2",
        nics=(),
        gpus=tuple(replace(g, uuid=f"{g.uuid}-m2", nvlink_domain="m2") for g in inv.gpus),
    )
    methods_by_name = {m.name: m for m in methods()}
    register = agent_pb2.RegisterRequest(inventory=inventory_to_proto(lonely))
    assert target.call(methods_by_name["Register"], register).code == "OK"
    spec = spec_to_proto(replace(base_spec(), policy="ilp", solver_time_limit_s=1.0))
    out = target.call(methods_by_name["Solve"], plan_pb2.SolveRequest(spec=spec))
    # Now refused before any solve: the lonely node has no path to the others.
    assert out.code == "FAILED_PRECONDITION", (out.code, out.detail)
    assert "nodes 'm2' and 'n0' cannot reach each other" in out.detail, out.detail
