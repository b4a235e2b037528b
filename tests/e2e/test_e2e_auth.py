"""Mutual TLS between agents and the controller: the right certificate registers; a
certificate from another CA, a plaintext agent, a node certificate used for another node and
an unknown bearer token are refused, and none of them becomes a node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from e2e_support import Client, agent_settings, eventually, fleet
from support.waits import HANG_GUARD_S

from agents.agent import Agent, AgentFatalError, TlsFiles
from agents.applier import MemoryApplier
from controlplane.server.certs import init_dev_pki, issue
from controlplane.server.inprocess import start_controller
from controlplane.server.services import TlsFiles as ServerTls
from policies.hardware.inventory import inventory_from_node


def _agent(address: str, node: str, tls: TlsFiles | None, token: str = "") -> Agent:
    inv = inventory_from_node(fleet(3, 2).node(node))
    settings = agent_settings(address, tls=tls, token=token)
    return Agent(settings, lambda: inv, MemoryApplier(node))


def test_only_the_right_credentials_get_in(tmp_path: Path) -> None:
    pki = init_dev_pki(tmp_path / "pki")
    issue(pki, "node-n0", "node:n0")
    other = init_dev_pki(tmp_path / "other")

    def creds(d: Path, stem: str) -> TlsFiles:
        return TlsFiles(d / f"{stem}.pem", d / f"{stem}-key.pem", pki / "ca.pem")

    server_tls = ServerTls(pki / "server.pem", pki / "server-key.pem", pki / "ca.pem")

    async def go() -> None:
        async with start_controller(
            tmp_path / "ctl", tls=server_tls, token_file=pki / "tokens"
        ) as ctl:
            admin = creds(pki, "admin")
            channel = grpc.aio.secure_channel(
                ctl.address,
                grpc.ssl_channel_credentials(
                    admin.ca.read_bytes(), admin.key.read_bytes(), admin.cert.read_bytes()
                ),
            )
            c = Client(channel)
            good = _agent(ctl.address, "n0", creds(pki, "agent"))
            foreign = _agent(ctl.address, "n1", creds(other, "agent"))
            plaintext = _agent(ctl.address, "n2", None)
            tasks = [asyncio.create_task(a.run()) for a in (good, foreign, plaintext)]
            try:
                await eventually(lambda: _nodes(c, {"n0"}), what="the good agent registered")

                # A node-bound certificate may act only for its own node.
                wrong_node = _agent(ctl.address, "n1", creds(pki, "node-n0"))
                with pytest.raises(AgentFatalError, match="PERMISSION_DENIED"):
                    await asyncio.wait_for(wrong_node.run(), 10)
                right_node = _agent(ctl.address, "n0", creds(pki, "node-n0"))
                right_task = asyncio.create_task(right_node.run())
                await eventually(lambda: _registrations(right_node), what="node cert accepted")
                right_node.stop()
                await asyncio.wait_for(right_task, HANG_GUARD_S)

                # An unknown bearer token is refused even with a valid certificate.
                bad_token = _agent(ctl.address, "n2", creds(pki, "agent"), token="x" * 32)
                with pytest.raises(AgentFatalError, match="UNAUTHENTICATED"):
                    await asyncio.wait_for(bad_token.run(), 10)

                # The foreign-CA and plaintext agents never got a session; they keep
                # retrying (a failed TLS handshake looks like an unreachable controller).
                await asyncio.sleep(0.5)
                assert foreign.stats.registrations == 0 and foreign.stats.last_error
                assert plaintext.stats.registrations == 0 and plaintext.stats.last_error
                assert set(await c.nodes()) == {"n0"}
            finally:
                for a in (good, foreign, plaintext):
                    a.stop()
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
                await channel.close(None)

    asyncio.run(go())


async def _nodes(c: Client, want: set[str]) -> bool:
    return set(await c.nodes()) == want


async def _registrations(a: Agent) -> bool:
    return a.stats.registrations > 0
