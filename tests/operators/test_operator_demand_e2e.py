"""Demand drift in Kubernetes mode, end to end: a router's ``ReportTraffic`` windows reach
the real controller on the Kubernetes store, which writes the measured demand and, after a
sustained drift, the traffic to plan for in its part of the ModelDeployment's status
(``status.controller.demand``); the real operator then plans the deployment for that
traffic and adds an engine instance beside the running ones. The controller's clock is
injected, so 70 s of traffic take no time.

Runs against the fake API server always and against a real cluster when
``MIXFLEET_E2E_KUBECONFIG`` is set (the ``cluster`` fixture)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from k8s_builders import md_object
from k8s_cluster import RUN_LABEL, Cluster, wait_for
from mixfleet.v1 import engine_pb2, engine_pb2_grpc
from test_operator_e2e import condition, status
from test_operator_instances_e2e import CHAT, instances, start

from apis.kube.client import MODEL_DEPLOYMENTS, Kube
from controlplane.server.inprocess import start_controller
from controlplane.store.kubernetes import KubernetesStore

pytestmark = pytest.mark.slow

T0 = 1_800_000_000.0
"""When the routers' first window starts, Unix s (the controller's injected clock)."""


def window(start_s: float, requests_per_s: float) -> engine_pb2.TrafficReport:
    """One router's 10 s window of ``chat``'s traffic, at CHAT's stated lengths."""
    return engine_pb2.TrafficReport(
        deployment="chat",
        reporter="router-0",
        start_unix_s=start_s,
        end_unix_s=start_s + 10.0,
        requests=round(requests_per_s * 10),
        input_tokens_mean=1024.0,
        input_tokens_p90=1280.0,
        output_tokens_mean=256.0,
        output_tokens_p90=320.0,
        ttft_ms_p50=300.0,
        ttft_ms_p99=900.0,
        tpot_ms_p50=20.0,
        tpot_ms_p99=45.0,
    )


async def _operator_plans_for_measured(k: Kube, cluster: Cluster) -> None:
    """The operator plans ``chat`` for the measured 100 requests/s the controller chose: a
    third instance beside the two that keep running, the demand's source in its status."""

    def names() -> list[str]:
        return [o["metadata"]["name"] for o in instances(k, cluster, "chat")]

    await asyncio.to_thread(
        lambda: wait_for(
            lambda: names() == ["chat-decode-0", "chat-prefill-0", "chat-prefill-1"],
            what="a third instance",
        )
    )
    st = await asyncio.to_thread(
        lambda: wait_for(
            lambda: (s := status(k, cluster, "chat")).get("demandFrom") == "Measured" and s,
            what="the parent planned for the measured demand",
        )
    )
    assert st["demandRequestsPerSecond"] == pytest.approx(100.0)
    assert st["plannedRequestsPerSecond"] == pytest.approx(100.0)
    assert [i["name"] for i in st["instances"]] == [
        "chat-prefill-0",
        "chat-prefill-1",
        "chat-decode-0",
    ]
    assert not any(i.get("draining") for i in st["instances"])
    solved = condition(k, cluster, "chat", "Solved")
    assert "(the measured demand: measured 100 requests/s" in solved["message"]
    # The operator's status writes left the controller's part alone.
    assert st["controller"]["demand"]["planned"]["requestsPerS"] == pytest.approx(100.0)


def test_a_sustained_rise_in_measured_demand_adds_an_instance(
    cluster: Cluster, fleet3: Kube, tmp_path: Path
) -> None:
    k = fleet3
    store = KubernetesStore(cluster.kube("mixfleet-controller"), cluster.namespace)
    now = [T0]

    def names() -> list[str]:
        return [o["metadata"]["name"] for o in instances(k, cluster, "chat")]

    async def go() -> None:
        async with (
            start_controller(tmp_path, store=store, run_loop=False, clock=lambda: now[0]) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            engine = engine_pb2_grpc.EngineServiceStub(ch)
            spec = {**CHAT, "nodeSelector": {RUN_LABEL: cluster.run}}
            k.create(MODEL_DEPLOYMENTS, md_object("chat", cluster.namespace, **spec))
            await asyncio.to_thread(
                lambda: wait_for(
                    lambda: names() == ["chat-decode-0", "chat-prefill-0"], what="two instances"
                )
            )
            st = await asyncio.to_thread(
                lambda: wait_for(
                    lambda: (s := status(k, cluster, "chat")).get("demandFrom") and s,
                    what="the parent's status",
                )
            )
            assert (st["demandFrom"], st["demandRequestsPerSecond"]) == ("Spec", 20.0)

            async def feed(start_s: float, seconds: float, rps: float) -> None:
                t = start_s
                while t < start_s + seconds:
                    now[0] = t + 11.0
                    assert (await engine.ReportTraffic(window(t, rps))).accepted
                    t += 10.0

            # Within the band (20 requests/s +- 25 %): measured, nothing re-planned.
            await feed(T0, 70.0, 22.0)
            doc = status(k, cluster, "chat")["controller"]["demand"]
            assert doc["measured"]["requestsPerS"] == pytest.approx(22.0)
            assert "planned" not in doc and doc["replans"] == 0
            # Five times the stated demand for over a minute: the controller chooses it.
            await feed(T0 + 70.0, 70.0, 100.0)
            doc = status(k, cluster, "chat")["controller"]["demand"]
            assert doc["planned"]["requestsPerS"] == pytest.approx(100.0)
            assert doc["replans"] == 1 and "above the planned 20" in doc["lastReplanReason"]

            await _operator_plans_for_measured(k, cluster)

    op = start(cluster)
    try:
        asyncio.run(go())
    finally:
        op.stop()
