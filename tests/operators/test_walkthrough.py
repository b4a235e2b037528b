"""The out-of-cluster walkthrough of docs/kubernetes.md as one test, against the fake API
server and (``MIXFLEET_E2E_KUBECONFIG``) a real one: the operator, the controller on the
Kubernetes store of the deployments' namespace, simulated agents writing plan files, and
``mixfleet-router`` in front of a loopback engine.

* a ModelDeployment is Solved and RolledOut, its PartitionPlan committed on its agent, and
  requests through the router reach the engine with the plan's DP rank pinned;
* an administrator cordons another GPUNode with ``kubectl apply --server-side
  --field-manager=admin`` (no ``--force-conflicts``; the kubernetes client's server-side
  apply under the same field manager where kubectl is not installed): no conflict, and the
  next deployment's plan avoids that node;
* a ModelDeployment with a bad field (an unknown model preset) gets ``Solved=False`` with
  the reason while the others proceed;
* deleting the first deployment removes every object it owned and its agent's plan files.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from k8s_builders import md_object, policy_object
from k8s_cluster import E2E_ENV, RUN_LABEL, Cluster, token_kubeconfig, wait_for
from mixfleet.v1 import engine_pb2, engine_pb2_grpc
from support.openai_engine import LoopbackEngine
from test_controller_and_operator import _check_requests_were_declared, _in_thread
from test_operator_e2e import condition, start_operator

from agents.agent import AgentSettings
from agents.backoff import BackoffSettings
from agents.simulate import SimulatedFleet
from apis.kube.client import (
    CONFIGMAPS,
    GPUNODES,
    MODEL_DEPLOYMENTS,
    PARTITION_PLANS,
    PLACEMENT_POLICIES,
    Kube,
)
from apis.kube.v1alpha1 import API_VERSION
from controlplane.router.state import rank_weights
from controlplane.server.inprocess import start_controller
from controlplane.store.kubernetes import KubernetesStore
from policies.hardware.fleet import Fleet

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NODES = (("a100-0", "A100-SXM4-80GB"), ("h100-0", "H100-SXM5-80GB"), ("h200-0", "H200-SXM-141GB"))
ONE_NODE = {"minGpus": 2, "maxGpus": 2}


def _fleet(cluster: Cluster) -> Fleet:
    """Three 2-GPU nodes of three generations (mixed-24 in small), named for this run."""
    return cluster.fleet("walkthrough", NODES)


def _kubeconfig(cluster: Cluster, tmp_path: Path) -> Path:
    if cluster.fake is None:
        return Path(os.environ[E2E_ENV])
    path = tmp_path / "kubeconfig"
    path.write_text(token_kubeconfig(cluster.fake.url))
    return path


def _cordon_as_admin(cluster: Cluster, k: Kube, node: str, kubeconfig: Path, tmp: Path) -> str:
    """``kubectl apply --server-side --field-manager=admin`` of ``spec.cordon: true``
    without ``--force-conflicts``; the client's own server-side apply under the field
    manager ``admin`` when kubectl is not installed. Returns which was used."""
    doc = {"apiVersion": API_VERSION, "kind": "GPUNode", "metadata": {"name": node}}
    doc["spec"] = {"cordon": True}
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        Kube(k.api_client, field_manager="admin").apply(GPUNODES, doc)
        return "client"
    manifest = tmp / "cordon.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    cmd = [kubectl, "--kubeconfig", str(kubeconfig), "apply", "--server-side"]
    cmd += ["--field-manager=admin", "-f", str(manifest)]
    env = {"HOME": str(tmp), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"gpunode.mixfleet.io/{node} serverside-applied" in done.stdout, done.stdout
    return "kubectl"


def _status(k: Kube, cluster: Cluster, name: str) -> dict[str, Any]:
    return dict((k.get(MODEL_DEPLOYMENTS, name, cluster.namespace) or {}).get("status") or {})


def _rolled_out(k: Kube, cluster: Cluster, name: str) -> bool:
    return (
        condition(k, cluster, name, "Solved").get("status") == "True"
        and condition(k, cluster, name, "RolledOut").get("status") == "True"
    )


def _owned_by(k: Kube, cluster: Cluster, name: str) -> list[str]:
    """PartitionPlans and ConfigMaps whose owner is the ModelDeployment ``name``."""
    out = []
    for res in (PARTITION_PLANS, CONFIGMAPS):
        items, _ = k.list(res, cluster.namespace)
        for o in items:
            refs = o["metadata"].get("ownerReferences") or []
            if any(r["kind"] == "ModelDeployment" and r["name"] == name for r in refs):
                out.append(f"{o['kind']}/{o['metadata']['name']}")
    return sorted(out)


def _files_of(plan_dir: Path, name: str) -> list[str]:
    """The files the agents keep for deployment ``name`` (under ``plan_dir/<node>/``)."""
    return sorted(str(p.relative_to(plan_dir)) for p in plan_dir.rglob(f"*{name}*") if p.is_file())


def _agent_settings(controller: str) -> AgentSettings:
    """The simulated agents' settings: plaintext to ``controller`` (host:port), reconnects
    0.05-0.3 s apart, 5 s RPC deadline."""
    return AgentSettings(
        controller=controller,
        insecure=True,
        backoff=BackoffSettings(initial_s=0.05, max_s=0.3, jitter=0.5),
        rpc_timeout_s=5.0,
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _through_the_router(controller: str, deployment: str, version: int, log: Path) -> int:
    """Start ``mixfleet-router`` (its own process) in front of a loopback engine with the
    deployment's DP ranks; wait until it routes on ``version``; send requests through it.
    Returns how many reached the engine with their rank pinned."""
    async with grpc.aio.insecure_channel(controller) as ch:
        routing = await engine_pb2_grpc.EngineServiceStub(ch).GetRouting(
            engine_pb2.GetRoutingRequest(deployment=deployment), timeout=30
        )
    assert routing.version == version
    ranks = len(rank_weights(routing))
    engine = await LoopbackEngine(engine="vllm", tokens_per_s=[2000.0] * ranks).start()
    port = _free_port()
    cmd = [sys.executable, "-m", "controlplane.cli", "router", "run"]
    cmd += ["--listen", f"127.0.0.1:{port}", "--controller", controller]
    cmd += ["--instance", f"url={engine.url},name=e0,deployment={deployment}"]
    cmd += ["--health-interval-s", "0.2", "--log-level", "warning"]
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 90
            while True:
                assert proc.returncode is None, log.read_text()
                with contextlib.suppress(aiohttp.ClientError, ValueError, KeyError, IndexError):
                    async with session.get(f"{url}/router/status") as r:
                        inst = (await r.json())["instances"][0]
                    if inst["version"] >= version and inst["healthy"]:
                        break
                assert time.monotonic() < deadline, f"router not on v{version}: {log.read_text()}"
                await asyncio.sleep(0.1)
            body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(16):
                async with session.post(
                    f"{url}/v1/chat/completions", json={**body, "max_tokens": 2}
                ) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
        return sum(1 for rec in engine.records if rec.pinned and 0 <= rec.rank < ranks)
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
        await engine.stop()


@dataclass
class _Walkthrough:
    """What the walkthrough's steps share: the cluster, the test's client, the simulated
    fleet, its node names, where its agents write plan files and the ModelDeployments'
    common fields (node selector, policy, one node)."""

    cluster: Cluster
    k: Kube
    sim: SimulatedFleet
    nodes: list[str]
    plan_dir: Path
    sel: dict[str, Any]

    def on(self, name: str) -> dict[str, int]:
        """node -> version of ``name`` its agent runs."""
        return {
            n: v for n in self.nodes if (v := self.sim.appliers[n].applied().get(name)) is not None
        }


async def _qwen3_rolled_out(w: _Walkthrough) -> tuple[str, int]:
    """A ModelDeployment ``qwen3``: Solved, RolledOut, its PartitionPlan committed on its
    agent, which wrote its plan files. Returns its node and plan version."""
    k, cluster = w.k, w.cluster
    qwen3 = md_object("qwen3", cluster.namespace, model="qwen3-30b-a3b", **w.sel)
    k.create(MODEL_DEPLOYMENTS, qwen3)
    await _in_thread(lambda: wait_for(lambda: _rolled_out(k, cluster, "qwen3"), what="qwen3 ready"))
    st = _status(k, cluster, "qwen3")
    version = st["currentPlan"]["version"]
    (qwen3_node,) = st["nodes"]
    await _in_thread(
        lambda: wait_for(lambda: w.on("qwen3") == {qwen3_node: version}, what="qwen3 on its agent")
    )
    plan = k.get(PARTITION_PLANS, f"qwen3-v{version}", cluster.namespace)
    assert plan is not None and plan["status"]["state"] == "Committed"
    assert _files_of(w.plan_dir, "qwen3")
    return qwen3_node, version


async def _cordoned_by_an_admin(w: _Walkthrough, node: str, kubeconfig: Path, tmp: Path) -> None:
    """An administrator cordons ``node`` without ``--force-conflicts``: stored, and the
    GPUNode has both the administrator and the controller among its field managers."""
    k = w.k
    _cordon_as_admin(w.cluster, k, node, kubeconfig, tmp)
    await _in_thread(
        lambda: wait_for(
            lambda: (k.get(GPUNODES, node) or {}).get("spec", {}).get("cordon"),
            what="cordon stored",
        )
    )
    node_obj = k.get(GPUNODES, node) or {"metadata": {}}
    managers = {m["manager"] for m in node_obj["metadata"].get("managedFields") or []}
    assert {"admin", "mixfleet-controller"} <= managers, managers


async def _next_avoids_the_cordon_bad_one_refused(
    w: _Walkthrough, cordoned: str, qwen3_node: str
) -> str:
    """The next deployment (``mixtral``) is placed on neither ``cordoned`` nor
    ``qwen3_node``; one with an unknown model (``broken``) gets ``Solved=False``; no plan
    uses the cordoned node and ``qwen3`` stays rolled out. Returns mixtral's node."""
    k, cluster = w.k, w.cluster
    mixtral = md_object("mixtral", cluster.namespace, **w.sel)
    k.create(MODEL_DEPLOYMENTS, mixtral)
    broken = md_object("broken", cluster.namespace, **{**w.sel, "model": "no-such-x"})
    k.create(MODEL_DEPLOYMENTS, broken)
    await _in_thread(
        lambda: wait_for(lambda: _rolled_out(k, cluster, "mixtral"), what="mixtral ready")
    )
    mixtral_node: str
    (mixtral_node,) = _status(k, cluster, "mixtral")["nodes"]
    assert mixtral_node not in (cordoned, qwen3_node)
    bad = await _in_thread(
        lambda: wait_for(
            lambda: (c := condition(k, cluster, "broken", "Solved")).get("status") == "False" and c,
            what="broken Solved=False",
        )
    )
    assert bad["reason"] == "UnknownModel" and "no-such-x" in bad["message"], bad
    items, _ = k.list(PARTITION_PLANS, cluster.namespace)
    assert all(cordoned not in p["spec"]["nodes"] for p in items)
    assert not w.sim.appliers[cordoned].applied()
    assert _rolled_out(k, cluster, "qwen3")
    return mixtral_node


async def _qwen3_deleted(w: _Walkthrough, mixtral_node: str) -> None:
    """Deleting ``qwen3`` removes every object it owned, its agent's part and plan files;
    ``mixtral`` keeps running its current plan on ``mixtral_node``."""
    k, cluster = w.k, w.cluster
    assert _owned_by(k, cluster, "qwen3")
    k.delete(MODEL_DEPLOYMENTS, "qwen3", cluster.namespace)
    await _in_thread(
        lambda: wait_for(
            lambda: (
                not w.on("qwen3")
                and not _files_of(w.plan_dir, "qwen3")
                and not _owned_by(k, cluster, "qwen3")
                and k.get(MODEL_DEPLOYMENTS, "qwen3", cluster.namespace) is None
            ),
            what="qwen3 gone: objects, agent, plan files",
        )
    )
    assert w.on("mixtral") == {
        mixtral_node: _status(k, cluster, "mixtral")["currentPlan"]["version"]
    }


def test_the_walkthrough_operator_controller_agents_router(
    cluster: Cluster, tmp_path: Path
) -> None:
    k = cluster.kube("mixfleet-test")
    k.create(
        PLACEMENT_POLICIES,
        policy_object(cluster.name("default"), policy="greedy", solverTimeLimitS=5, workers=1),
    )
    kubeconfig = _kubeconfig(cluster, tmp_path)
    fleet = _fleet(cluster)
    nodes = [n.name for n in fleet.nodes]
    plan_dir = tmp_path / "plans"
    sel = {"nodeSelector": {RUN_LABEL: cluster.run}, "policy": "greedy", **ONE_NODE}

    async def go() -> None:
        # The controller's store is the deployments' own namespace (docs: kubernetes:inference).
        store = KubernetesStore(cluster.kube("mixfleet-controller"), cluster.namespace)
        async with start_controller(tmp_path / "ctl", store=store) as ctl:
            sim = SimulatedFleet(fleet, _agent_settings(ctl.address), plan_dir=plan_dir)
            sim.start()
            operator = start_operator(cluster)
            w = _Walkthrough(cluster, k, sim, nodes, plan_dir, sel)
            try:
                await _in_thread(lambda: wait_for(lambda: _registered_all(cluster), what="nodes"))
                # ---- a ModelDeployment: Solved, RolledOut, committed on its agent
                qwen3_node, version = await _qwen3_rolled_out(w)
                # ---- requests through mixfleet-router reach the plan's ranks
                pinned = await _through_the_router(
                    ctl.address, "qwen3", version, tmp_path / "router.log"
                )
                assert pinned == 16
                # ---- an administrator cordons another node, without --force-conflicts
                cordoned = next(n for n in nodes if n != qwen3_node)
                await _cordoned_by_an_admin(w, cordoned, kubeconfig, tmp_path)
                # ---- the next deployment avoids the cordoned node; a bad one gets a condition
                mixtral_node = await _next_avoids_the_cordon_bad_one_refused(
                    w, cordoned, qwen3_node
                )
                # ---- deleting a deployment removes what it owned and its plan files
                await _qwen3_deleted(w, mixtral_node)
            finally:
                operator.stop()
                await sim.stop()

    asyncio.run(go())
    _check_requests_were_declared(cluster)


def _registered_all(cluster: Cluster) -> bool:
    """Every node of the walkthrough's fleet has registered."""
    return cluster.registered(_fleet(cluster))
