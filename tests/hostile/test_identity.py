"""Who may act for whom: each forgery the probe of the controller found, refused.

* a node certificate plus an agent token registers as another node (the token overrode the
  certificate's node binding);
* acks with an empty session (a fleet credential acking PREPARED or COMMITTED for a node whose
  agent never staged or applied), and acks from a stale session of the node's agent;
* an ack for version 2^64-1 (INTERNAL before: SQLite cannot hold it).

Real gRPC on loopback; mutual TLS with certificates from ``mixfleetctl certs init``.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from mixfleet.v1 import agent_pb2, agent_pb2_grpc
from support.fuzztarget import FuzzTarget
from support.protofuzz import methods, small_inventories

from apis.wire.inventory import inventory_to_proto
from controlplane.errors import PermissionDeniedError
from controlplane.server.auth import Authenticator, load_tokens
from controlplane.server.certs import init_dev_pki, issue
from controlplane.server.inprocess import start_controller
from controlplane.server.services import TlsFiles

AGENT_TOKEN = "agent-token-0123456789abcdef"
N1_TOKEN = "node-n1-token-0123456789abcdef"


def _creds(d: Path, stem: str) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(d / "ca.pem").read_bytes(),
        private_key=(d / f"{stem}-key.pem").read_bytes(),
        certificate_chain=(d / f"{stem}.pem").read_bytes(),
    )


def _register(node_index: int) -> agent_pb2.RegisterRequest:
    return agent_pb2.RegisterRequest(inventory=inventory_to_proto(small_inventories()[node_index]))


def test_a_node_credential_acts_only_for_its_node_whatever_the_token_says(
    tmp_path: Path,
) -> None:
    pki = init_dev_pki(tmp_path / "pki")
    issue(pki, "node-n1", "node:n1")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{AGENT_TOKEN} agent fleet\n{N1_TOKEN} agent node:n1\n")
    tls = TlsFiles(pki / "server.pem", pki / "server-key.pem", pki / "ca.pem")

    def bearer(token: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),)

    async def code(cert: str, token: str | None, node_index: int, port: int) -> grpc.StatusCode:
        async with grpc.aio.secure_channel(f"localhost:{port}", _creds(pki, cert)) as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            try:
                await stub.Register(
                    _register(node_index), metadata=bearer(token) if token else None, timeout=10
                )
            except grpc.aio.AioRpcError as exc:
                assert "n1" in (exc.details() or ""), exc.details()
                return exc.code()
            return grpc.StatusCode.OK

    async def main() -> None:
        async with start_controller(tmp_path, tls=tls, token_file=tokens) as ctl:
            denied, ok = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK
            # node:n1 certificate: n0 refused with or without a fleet-wide agent token
            assert await code("node-n1", AGENT_TOKEN, 0, ctl.port) == denied
            assert await code("node-n1", None, 0, ctl.port) == denied
            assert await code("node-n1", AGENT_TOKEN, 1, ctl.port) == ok
            # a token bound to n1 (name node:n1) behind the fleet-wide agent certificate
            assert await code("agent", N1_TOKEN, 0, ctl.port) == denied
            assert await code("agent", N1_TOKEN, 1, ctl.port) == ok
            assert await code("agent", AGENT_TOKEN, 0, ctl.port) == ok  # fleet-wide: any node

    asyncio.run(main())


def test_token_and_certificate_bound_to_different_nodes_are_refused(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{N1_TOKEN} agent node:n1\n{AGENT_TOKEN} agent fleet\n")
    auth = Authenticator(load_tokens(tokens), dev_mode=False)
    md = [("authorization", f"Bearer {N1_TOKEN}")]
    assert auth.identify(md, ["node:n1"]).node == "n1"
    with pytest.raises(PermissionDeniedError, match=r"bound to node 'n1'.*'n0'"):
        auth.identify(md, ["node:n0"])
    fleet = auth.identify([("authorization", f"Bearer {AGENT_TOKEN}")], ["node:n0"])
    assert fleet.role == "agent" and fleet.node == "n0" and not fleet.may_act_for("n1")


def test_tokens_are_compared_in_constant_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every known token is compared (with hmac.compare_digest) even when the first matches."""
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"token-number-{i:04d}-abcdef viewer\n" for i in range(5)))
    auth = Authenticator(load_tokens(tokens), dev_mode=False)
    calls: list[bytes] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(a)
        return real(a, b)

    monkeypatch.setattr("controlplane.server.auth.hmac.compare_digest", counting)
    assert (
        auth.identify([("authorization", "Bearer token-number-0000-abcdef")], []).role == "viewer"
    )
    assert len(calls) == 5


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    with FuzzTarget(Path(tmp_path_factory.mktemp("acks"))) as t:
        yield t


def _ack(
    target: FuzzTarget, node: str, session: str, state: int, version: int = 1
) -> tuple[str, str]:
    ack = next(m for m in methods() if m.name == "Ack")
    out = target.call(
        ack,
        agent_pb2.AckRequest(
            node=node,
            session_id=session,
            deployment="mx",
            version=version,
            state=state,  # type: ignore[arg-type]
        ),
    )
    return out.code, out.detail


def test_acks_need_the_live_session_of_the_nodes_agent(target: FuzzTarget) -> None:
    """mx's plan version 1 is being prepared on n0..n2 (dev mode: every caller may ack)."""
    target.reset()
    prepared, committed = agent_pb2.ACK_STATE_PREPARED, agent_pb2.ACK_STATE_COMMITTED
    for state in (prepared, committed):
        code, detail = _ack(target, "n1", "", state)
        assert code == "FAILED_PRECONDITION" and "session_id" in detail, (code, detail)
    stale = target.sessions["n0"]
    target.reset()  # n0 registers again: its old session is stale
    assert target.sessions["n0"] != stale
    code, detail = _ack(target, "n0", stale, prepared)
    assert code == "FAILED_PRECONDITION" and "stale session" in detail, (code, detail)
    assert _ack(target, "n0", target.sessions["n0"], prepared)[0] == "OK"
    # the refused acks left no trace: only n0 counts as prepared
    ctl = target.running.controller  # type: ignore[union-attr]
    assert set(ctl.acks_of("mx", 1)) == {"n0"}


def test_an_ack_for_a_version_beyond_the_store_is_invalid_not_internal(target: FuzzTarget) -> None:
    target.reset()
    session = target.sessions["n0"]
    for version in ((1 << 64) - 1, 1 << 63):
        code, detail = _ack(target, "n0", session, agent_pb2.ACK_STATE_PREPARED, version)
        assert code == "INVALID_ARGUMENT" and detail.startswith("version:"), (code, detail)
