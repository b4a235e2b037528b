"""``mixfleet-agent`` command line: bad flags and files give one error line and exit 2."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import types
from pathlib import Path

import pytest
from fake_controller import FakeAgentService, start_fake, wait_for
from support.waits import HANG_GUARD_S

from agents.agent import AgentSettings
from agents.cli import _rewrite_simulate_fleet, main
from agents.discovery.static import load_fleet_file
from agents.simulate import SimulatedFleet

REPO = Path(__file__).resolve().parents[2]
MIXED_24 = str(REPO / "examples" / "fleets" / "mixed-24.yaml")


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "COMMAND"),
        (["run", "--controller", "h:1", "--insecure"], "--plan-dir"),
        (
            ["run", "--controller", "h:1", "--plan-dir", "p", "--discovery", "static"],
            "needs --fleet-file and --node",
        ),
        (
            [
                "run",
                "--controller",
                "h:1",
                "--plan-dir",
                "p",
                "--discovery",
                "static",
                "--fleet-file",
                MIXED_24,
                "--node",
                "a100-0",
            ],
            "--insecure",
        ),
        (
            [
                "run",
                "--controller",
                "h:1",
                "--insecure",
                "--plan-dir",
                "p",
                "--discovery",
                "static",
                "--fleet-file",
                MIXED_24,
                "--node",
                "zz-9",
            ],
            "pick one of a100-0",
        ),
        (
            [
                "run",
                "--controller",
                "h:1",
                "--insecure",
                "--tls-ca",
                "ca.pem",
                "--plan-dir",
                "p",
                "--discovery",
                "static",
                "--fleet-file",
                MIXED_24,
                "--node",
                "a100-0",
            ],
            "exclude each other",
        ),
        (
            [
                "run",
                "--controller",
                "h:1",
                "--tls-ca",
                "ca.pem",
                "--plan-dir",
                "p",
                "--discovery",
                "static",
                "--fleet-file",
                MIXED_24,
                "--node",
                "a100-0",
            ],
            "missing --tls-cert",
        ),
        (
            [
                "run",
                "--controller",
                "nocolon",
                "--insecure",
                "--plan-dir",
                "p",
                "--discovery",
                "static",
                "--fleet-file",
                MIXED_24,
                "--node",
                "a100-0",
            ],
            "HOST:PORT",
        ),
        (
            [
                "run",
                "--controller",
                "h:1",
                "--insecure",
                "--plan-dir",
                "p",
                "--discovery",
                "static",
                "--fleet-file",
                MIXED_24,
                "--node",
                "a100-0",
                "--hook-phases",
                "later",
            ],
            "--hook-phases",
        ),
        (["--simulate-fleet", "missing.yaml", "--controller", "h:1", "--insecure"], "missing.yaml"),
        (["simulate", "--fleet", MIXED_24, "--controller", "h:1"], "--insecure"),
        (["run", "--bogus"], "required: --controller, --plan-dir"),
    ],
)
def test_bad_usage_is_one_error_line_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert needle in _one_error(capsys)


def test_calibrate_slot_without_module_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(name: str) -> types.ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr("agents.cli.importlib.import_module", missing)
    assert main(["calibrate", "--quick"]) == 2
    assert "agents.calibrate is missing" in _one_error(capsys)


def test_calibrate_hands_its_own_flags_to_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []
    fake = types.ModuleType("agents.calibrate")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--gpus", type=int, default=0)

    def fake_main(ns: argparse.Namespace) -> int:
        seen.append(ns)
        return 0

    fake.add_arguments = add_arguments  # type: ignore[attr-defined]
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agents.calibrate", fake)
    assert main(["calibrate", "--gpus", "2"]) == 0
    assert seen[0].gpus == 2
    assert main(["calibrate", "--nope"]) == 2


def test_simulate_fleet_flag_is_rewritten_to_the_simulate_command() -> None:
    assert _rewrite_simulate_fleet(["--simulate-fleet", "f.yaml", "--insecure"]) == [
        "simulate",
        "--fleet",
        "f.yaml",
        "--insecure",
    ]
    assert _rewrite_simulate_fleet(["--controller", "h:1", "--simulate-fleet=f.yaml"]) == [
        "simulate",
        "--fleet",
        "f.yaml",
        "--controller",
        "h:1",
    ]


def test_refused_simulated_agents_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    import grpc

    svc = FakeAgentService(refuse_register=grpc.StatusCode.UNAUTHENTICATED)
    ready = threading.Event()
    port_box: list[int] = []
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        server, port = await start_fake(svc)
        port_box.append(port)
        ready.set()
        await server.wait_for_termination(timeout=20)

    t = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    t.start()
    assert ready.wait(HANG_GUARD_S)
    rc = main(
        [
            "--simulate-fleet",
            MIXED_24,
            "--controller",
            f"127.0.0.1:{port_box[0]}",
            "--insecure",
            "--log-level",
            "error",
        ]
    )
    assert rc == 1
    line = _one_error(capsys)
    assert "3 simulated agent(s) failed" in line and "UNAUTHENTICATED" in line


@pytest.mark.parametrize("address", ["bad host", "-x", "[::1]", "h:8000", "a" * 64])
def test_a_bad_advertise_address_is_one_error_line(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--simulate-fleet", MIXED_24, "--controller", "h:1", "--insecure"]
    assert main([*argv, "--advertise-address", address]) == 2
    assert "--advertise-address: " in _one_error(capsys)


def test_advertise_address_reaches_every_simulated_inventory() -> None:
    svc = FakeAgentService()

    async def go() -> list[str]:
        server, port = await start_fake(svc)
        settings = AgentSettings(controller=f"127.0.0.1:{port}", insecure=True)
        sim = SimulatedFleet(load_fleet_file(MIXED_24), settings, address="127.0.0.1")
        sim.start()
        try:
            await wait_for(lambda: len(svc.registers) == 3, what="3 registrations")
            return [r.inventory.address for r in svc.registers]
        finally:
            await sim.stop()
            await server.stop(None)

    assert asyncio.run(go()) == ["127.0.0.1"] * 3


def test_run_advertises_its_address_in_every_inventory(capsys: pytest.CaptureFixture[str]) -> None:
    from agents.cli import _with_address
    from policies.hardware.inventory import NodeInventory

    discover = _with_address(lambda: NodeInventory("n0", ()), "fd00::7")
    assert discover().address == "fd00::7" and discover().node == "n0"
    run = ["run", "--controller", "h:1", "--insecure", "--plan-dir", "p", "--discovery"]
    static = ["static", "--fleet-file", MIXED_24, "--node", "a100-0"]
    assert main([*run, *static, "--advertise-address", "10.0.0.1:80"]) == 2
    assert "--advertise-address: " in _one_error(capsys)
