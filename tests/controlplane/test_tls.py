"""Mutual TLS with certificates from ``mixfleetctl certs init``: agents with the CA's client
certificates get in, anyone else is refused at the handshake or by role."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from agent_fakes import small_inventories
from mixfleet.v1 import agent_pb2, agent_pb2_grpc, plan_pb2, plan_pb2_grpc

from apis.wire.inventory import inventory_to_proto
from controlplane.server.certs import init_dev_pki, issue, token_for
from controlplane.server.inprocess import start_controller
from controlplane.server.services import TlsFiles
from policies.errors import InputError


def creds(d: Path, stem: str | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(d / "ca.pem").read_bytes(),
        private_key=(d / f"{stem}-key.pem").read_bytes() if stem else None,
        certificate_chain=(d / f"{stem}.pem").read_bytes() if stem else None,
    )


def test_mutual_tls_handshake_and_roles(tmp_path: Path) -> None:
    pki = init_dev_pki(tmp_path / "pki")
    issue(pki, "node-n1", "node:n1")
    other = init_dev_pki(tmp_path / "other")  # a CA the controller does not trust
    tls = TlsFiles(pki / "server.pem", pki / "server-key.pem", pki / "ca.pem")
    viewer = (("authorization", f"Bearer {token_for(pki / 'tokens', 'viewer')}"),)
    inv = small_inventories()[0]  # node n0
    register = agent_pb2.RegisterRequest(inventory=inventory_to_proto(inv))

    async def main() -> None:
        async with start_controller(tmp_path, tls=tls, token_file=pki / "tokens") as ctl:
            target = f"localhost:{ctl.port}"
            async with grpc.aio.secure_channel(target, creds(pki, "agent")) as ch:
                reply = await agent_pb2_grpc.AgentServiceStub(ch).Register(register)
                assert reply.node == "n0" and reply.session_id
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plan_pb2_grpc.PlanServiceStub(ch).ListNodes(plan_pb2.ListNodesRequest())
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

            async with grpc.aio.secure_channel(target, creds(pki, "node-n1")) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await agent_pb2_grpc.AgentServiceStub(ch).Register(register)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "node" in (err.value.details() or "")

            async with grpc.aio.secure_channel(target, creds(pki, "admin")) as ch:
                plans = plan_pb2_grpc.PlanServiceStub(ch)
                nodes = await plans.ListNodes(plan_pb2.ListNodesRequest(), metadata=viewer)
                assert [n.inventory.node for n in nodes.nodes] == ["n0"]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plans.DeleteDeployment(
                        plan_pb2.DeleteDeploymentRequest(name="x"), metadata=viewer
                    )
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

            for bad in (creds(pki, None), creds(other, "agent")):  # no cert; foreign CA
                async with grpc.aio.secure_channel(target, bad) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await agent_pb2_grpc.AgentServiceStub(ch).Register(register, timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            async with grpc.aio.insecure_channel(target) as ch:  # plaintext to a TLS port
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await agent_pb2_grpc.AgentServiceStub(ch).Register(register, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_certs_init_refuses_to_overwrite_and_keeps_keys_private(tmp_path: Path) -> None:
    d = init_dev_pki(tmp_path)
    for key in ("ca-key.pem", "server-key.pem", "agent-key.pem", "tokens"):
        assert (d / key).stat().st_mode & 0o077 == 0, key
    with pytest.raises(InputError, match="already holds a CA"):
        init_dev_pki(tmp_path)
    assert len(token_for(d / "tokens", "admin")) >= 16
