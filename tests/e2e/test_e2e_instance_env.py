"""An engine instance's role and ports reach the node agent: a real in-process controller
(SQLite store, gRPC on loopback) and real agents (disk applier, a hook that records its
environment) on three simulated 4-GPU H100 nodes.

A plain deployment (Mixtral-8x7B, no traffic or SLO) gets ``MIXFLEET_ROLE=""``,
``MIXFLEET_INSTANCE_OF=""`` and ports ``0`` in the hook's environment, the engine env files
and no ``instance`` in the written ``plan.json``. Deleted, its GPUs go to Qwen3-30B-A3B
(SGLang) stated by traffic and SLOs, which the controller cuts into engine instances: on
every node of an instance, in both hook phases, the hook sees the instance's role, the
deployment it serves, and the engine and bootstrap ports of its stored record - where
``EngineService.WatchInstances`` tells routers to look. The COMMIT replayed when a stream
opens carries them too, also when read back from the store alone (a restarted controller).
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from e2e_support import Client, agent_settings, eventually, fleet, read_env, read_part, spec
from grpc import aio
from mixfleet.v1 import agent_pb2, plan_pb2

from agents.applier.env import parse_env
from agents.simulate import SimulatedFleet
from apis.wire.deployment import spec_to_proto
from controlplane.server.controller import Controller
from controlplane.server.controller.instance_records import InstanceRecord
from controlplane.server.controller.rollout import Rollouts
from controlplane.server.inprocess import FAST, start_controller
from controlplane.store import Store
from controlplane.wire.plans import assignment_to_proto
from policies.estimate.engines import EngineSpec
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import DeploymentSpec, WorkloadSpec

PLANNED = DeploymentSpec(
    "q",
    model="qwen3-30b-a3b",
    policy="greedy",
    workload=WorkloadSpec(kv_cache_dtype="fp8"),
    engine=EngineSpec("sglang"),
    traffic=Traffic(45.0, LengthDist(4096, 5120), LengthDist(512, 640)),
    slo=Slo(ttft_ms=2000, tpot_ms=50, percentile=90),
    disaggregation="auto",
    prepare_timeout_s=10.0,
)

INSTANCE_VARS = (
    "MIXFLEET_ROLE",
    "MIXFLEET_INSTANCE_OF",
    "MIXFLEET_ENGINE_PORT",
    "MIXFLEET_BOOTSTRAP_PORT",
)


def _hook(out: Path) -> tuple[str, ...]:
    """A hook writing its MIXFLEET_ environment to ``out/<node>.<deployment>.<phase>.env``."""
    target = shlex.quote(str(out)) + '/"$MIXFLEET_NODE.$MIXFLEET_DEPLOYMENT.$MIXFLEET_HOOK_PHASE"'
    return ("sh", "-c", f"env | grep '^MIXFLEET_' > {target}.tmp && mv {target}.tmp {target}.env")


def _hook_env(out: Path, node: str, deployment: str, phase: str) -> dict[str, str] | None:
    path = out / f"{node}.{deployment}.{phase}.env"
    return parse_env(path.read_text()) if path.exists() else None


def _records(store: Store) -> dict[str, InstanceRecord]:
    out = {}
    for d in store.list_deployments():
        r = InstanceRecord.from_status(d.status)
        if r is not None and not r.dropped:
            out[d.name] = r
    return out


def test_instance_role_and_ports_reach_the_hook(tmp_path: Path) -> None:
    plan_dir, out = tmp_path / "plans", tmp_path / "hook"
    out.mkdir()

    async def go() -> None:
        async with start_controller(tmp_path / "ctl", settings=FAST) as ctl:
            sim = SimulatedFleet(
                fleet(3, 4), agent_settings(ctl.address), plan_dir=plan_dir, hook=_hook(out)
            )
            sim.start()
            channel = aio.insecure_channel(ctl.address)
            c = Client(channel)
            try:
                # ---- a plain deployment: empty role, zero ports
                await c.apply(spec())
                await c.wait_committed("mixtral", 1)
                record = await c.plan("mixtral")
                for node in record.nodes:
                    await _check_node(plan_dir, out, node, "mixtral", None)
                await c.plans.DeleteDeployment(
                    plan_pb2.DeleteDeploymentRequest(name="mixtral"), timeout=10
                )

                # ---- a deployment stated by demand: each instance's role and ports
                await c.apply(spec_to_proto(PLANNED))

                async def instances_committed() -> dict[str, InstanceRecord]:
                    recs = _records(ctl.controller.store)
                    if not recs:
                        return {}
                    for name in recs:
                        d = ctl.controller.store.get_deployment(name)
                        if d is None or d.committed_version is None:
                            return {}
                    return recs

                recs = await eventually(
                    instances_committed, timeout_s=120, what="q's instances committed"
                )
                roles = {r.role for r in recs.values()}
                assert roles <= {"aggregated", "prefill", "decode"} and roles, recs
                for name, r in recs.items():
                    plan = ctl.controller.store.committed_plan(name)
                    assert plan is not None and r.port > 0 and r.of == "q"
                    assert (r.bootstrap_port > 0) == (r.role == "prefill")
                    for node in plan.nodes:
                        await _check_node(plan_dir, out, node, name, r)
                        _check_replay(ctl.controller, node, name, r)
            finally:
                await sim.stop()
                await channel.close(None)

    asyncio.run(go())


async def _check_node(
    plan_dir: Path, out: Path, node: str, name: str, r: InstanceRecord | None
) -> None:
    """Both hook phases, the engine env file and plan.json of ``name`` on ``node`` carry
    instance ``r`` (None: a plain deployment, empty and zero)."""
    want = ["", "", "0", "0"] if r is None else [r.role, r.of, str(r.port), str(r.bootstrap_port)]
    for phase in ("prepare", "commit"):
        env = await eventually(
            _probe(out, node, name, phase), what=f"{phase} hook of {name} on {node}"
        )
        assert env["MIXFLEET_DEPLOYMENT"] == name
        assert [env[k] for k in INSTANCE_VARS] == want, (name, node, env)
    part = read_part(plan_dir, node, name)
    assert part is not None
    if r is None:
        assert "instance" not in part
    else:
        assert part["instance"] == {
            "role": r.role,
            "of": r.of,
            "engine_port": r.port,
            "bootstrap_port": r.bootstrap_port,
        }
    gpu_env = read_env(plan_dir, node, name, _first_gpu(part))
    assert [gpu_env[k] for k in INSTANCE_VARS] == want


def _check_replay(controller: Controller, node: str, name: str, r: InstanceRecord) -> None:
    """The COMMIT a stream opening replays carries the instance too: from the controller's
    memory, and from the store alone (as after a restart)."""
    live = controller.rollouts
    fresh = Rollouts(live.ctx, live.nodes, live.watchers, on_commit=lambda _: None)
    for rollouts, cached in ((live, True), (fresh, False)):
        events, _ = rollouts.snapshot(node, {}, cached=cached)
        (msg,) = [assignment_to_proto(e) for e in events if e.deployment == name]
        assert msg.phase == agent_pb2.ASSIGNMENT_PHASE_COMMIT and msg.part_json
        got = (msg.role, msg.instance_of, msg.engine_port, msg.bootstrap_port)
        assert got == (r.role, r.of, r.port, r.bootstrap_port), (cached, got)


def _first_gpu(part: dict[str, Any]) -> int:
    """The device index of the part's first GPU (``.../gpu<i>``)."""
    return int(str(part["gpus"][0]["gpu"]).rsplit("gpu", 1)[-1])


def _probe(
    out: Path, node: str, deployment: str, phase: str
) -> Callable[[], Awaitable[dict[str, str] | None]]:
    """A probe for :func:`eventually`: the hook's recorded environment, None until written."""

    async def probe() -> dict[str, str] | None:
        return _hook_env(out, node, deployment, phase)

    return probe
