"""``mixfleet-agent``: the node agent's command line.

Commands::

    mixfleet-agent run --controller HOST:PORT (--tls-cert C --tls-key K --tls-ca CA | --insecure)
                       [--discovery nvml|static] [--fleet FILE --node NAME]
                       --plan-dir DIR [--hook CMD] ...
    mixfleet-agent simulate --fleet FILE --controller HOST:PORT [--advertise-address HOST] ...
    mixfleet-agent --simulate-fleet FILE --controller HOST:PORT ...   (same as simulate)
    mixfleet-agent calibrate ...                                      (agents.calibrate)

Logs are JSON lines on stderr carrying the node name. Exit status: 0 stopped by a signal
or finished; 1 the controller refused the agent (credentials, inventory); 2 bad flags or
files (one ``error: ...`` line, no traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from agents.agent import Agent, AgentFatalError, AgentSettings, TlsFiles
from agents.applier import HOOK_PHASES, ApplierSettings, PlanApplier
from agents.backoff import BackoffSettings
from agents.discovery.base import DiscoveryError
from agents.discovery.static import StaticDiscovery, load_fleet_file
from agents.discovery.sysfs import SysfsNicDiscovery
from agents.logs import LEVELS, configure_logging
from agents.simulate import SimulatedFleet
from apis.cliargs import (
    StrictParser,
    add_version_arg,
    non_negative_float,
    positive_float,
    positive_int,
)
from apis.documents import read_limited
from policies.errors import InputError, MixfleetError
from policies.hardware.inventory import NodeInventory
from policies.limits import check_host_address, decode_utf8

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _UsageError(Exception):
    """A bad command line, worded for the user."""


class _Parser(StrictParser):
    """A :class:`apis.cliargs.StrictParser` whose usage errors are one ``error:`` line."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message}. To fix: see '{self.prog} --help'")


# --------------------------------------------------------------------------- parser


def _add_connection_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("controller connection")
    g.add_argument("--controller", required=True, metavar="HOST:PORT", help="controller address")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", help="this agent's certificate")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="its private key")
    g.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA of the controller")
    g.add_argument(
        "--tls-server-name",
        default="",
        metavar="NAME",
        help="name expected in the controller's certificate (default: the host)",
    )
    g.add_argument(
        "--insecure", action="store_true", help="plaintext connection (loopback development)"
    )
    g.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="bearer token file (default: $MIXFLEET_TOKEN when set)",
    )
    g.add_argument(
        "--heartbeat-interval",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="heartbeat period in seconds (default: the controller's)",
    )
    g.add_argument(
        "--max-backoff", type=positive_float, default=4.0, metavar="S", help="longest retry delay"
    )
    p.add_argument("--log-level", choices=LEVELS, default="info")


def _add_address_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup, whose: str) -> None:
    p.add_argument(
        "--advertise-address",
        default="",
        metavar="HOST",
        help=f"host name or IP address at which {whose} engines serve, as routers reach them "
        "(default: the node name)",
    )


def _advertise_address(args: argparse.Namespace) -> str:
    """``--advertise-address``, checked (``""`` when not given: the node name).

    Raises:
        InputError: neither an IP address nor a host name.
    """
    address: str = args.advertise_address
    if address:
        check_host_address(address, "--advertise-address")
    return address


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mixfleet-agent",
        description="mixfleet node agent: reports the node's GPUs and applies plans.",
    )
    add_version_arg(parser, "mixfleet-agent")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="run the agent of this node")
    _add_connection_flags(run)
    d = run.add_argument_group("discovery")
    d.add_argument("--discovery", choices=("nvml", "amdsmi", "static"), default="nvml")
    d.add_argument(
        "--fleet",
        "--fleet-file",
        dest="fleet_file",
        type=Path,
        metavar="FILE",
        help="Fleet file (static discovery; --fleet-file is the older name)",
    )
    d.add_argument("--node", default="", metavar="NAME", help="node name (default: host name)")
    _add_address_flag(d, "this node's")
    d.add_argument(
        "--label", action="append", default=[], metavar="K=V", help="node label (nvml; repeat)"
    )
    d.add_argument("--sysfs-root", type=Path, default=Path("/sys"), metavar="DIR")
    d.add_argument("--no-sysfs", action="store_true", help="do not read RDMA NICs from sysfs")
    d.add_argument(
        "--nic-fabric",
        action="append",
        default=[],
        metavar="DEV[/PORT]=FABRIC",
        help="fabric of an RDMA device or port (repeat)",
    )
    d.add_argument("--default-fabric", default="default", metavar="NAME")
    d.add_argument(
        "--rediscover-interval",
        type=positive_float,
        default=None,
        metavar="S",
        help="refresh GPU health this often (default 30 with nvml, never with static)",
    )
    a = run.add_argument_group("plan applier")
    a.add_argument("--plan-dir", type=Path, required=True, metavar="DIR")
    a.add_argument("--hook", default="", metavar="CMD", help="run after staging and commit")
    a.add_argument("--hook-timeout", type=positive_float, default=30.0, metavar="S")
    a.add_argument(
        "--hook-phases",
        default=",".join(HOOK_PHASES),
        metavar="P[,P]",
        help="phases the hook runs in: prepare, commit",
    )
    run.set_defaults(handler=_cmd_run)

    sim = sub.add_parser(
        "simulate", help="one simulated agent per node of a Fleet file, in this process"
    )
    _add_connection_flags(sim)
    sim.add_argument("--fleet", type=Path, required=True, metavar="FILE", help="Fleet file")
    sim.add_argument(
        "--plan-dir", type=Path, default=None, metavar="DIR", help="write plans under DIR/<node>"
    )
    sim.add_argument("--hook", default="", metavar="CMD")
    sim.add_argument("--agents-per-channel", type=positive_int, default=100, metavar="N")
    _add_address_flag(sim, "every simulated node's")
    sim.set_defaults(handler=_cmd_simulate)

    # Listed for --help only: main() hands "calibrate ..." to _cmd_calibrate, which lets
    # agents.calibrate declare its own flags.
    sub.add_parser("calibrate", help="measure this node's GPUs (see 'calibrate --help')")
    return parser


def _rewrite_simulate_fleet(argv: list[str]) -> list[str]:
    """``--simulate-fleet FILE ...`` (no command) -> ``simulate --fleet FILE ...``."""
    for i, a in enumerate(argv):
        if a == "--simulate-fleet" and i + 1 < len(argv):
            return ["simulate", "--fleet", argv[i + 1], *argv[:i], *argv[i + 2 :]]
        if a.startswith("--simulate-fleet="):
            return ["simulate", "--fleet", a.split("=", 1)[1], *argv[:i], *argv[i + 1 :]]
    return argv


# --------------------------------------------------------------------------- settings


def _pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k or not v:
            raise InputError(f"expected KEY=VALUE, got {item!r}", field=flag)
        out[k] = v
    return out


def _agent_settings(args: argparse.Namespace) -> AgentSettings:
    tls_parts = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
    given = [k for k, v in tls_parts.items() if v is not None]
    tls = None
    if given:
        if args.insecure:
            raise InputError("--insecure and TLS files exclude each other", field="--insecure")
        missing = [k for k, v in tls_parts.items() if v is None]
        if missing:
            raise InputError(
                f"mutual TLS needs all three files; missing {', '.join(missing)}",
                field=missing[0],
            )
        for flag, path in tls_parts.items():
            if not Path(path).is_file():
                raise InputError(f"no such file {str(path)!r}", field=flag)
        tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    token = os.environ.get("MIXFLEET_TOKEN", "")
    if args.token_file is not None:
        where = f"token file {str(args.token_file)!r}"
        try:  # size, UTF-8 (with the byte offset) and emptiness checked before use
            token = decode_utf8(read_limited(args.token_file, "token file", "token"), where)
        except InputError as exc:
            raise InputError(str(exc), field="--token-file") from exc
        token = token.strip()
        if not token:
            raise InputError(
                f"{where} is empty. To fix: write the token in it", field="--token-file"
            )
    if ":" not in args.controller:
        raise InputError(f"expected HOST:PORT, got {args.controller!r}", field="--controller")
    return AgentSettings(
        controller=args.controller,
        tls=tls,
        insecure=bool(args.insecure),
        token=token,
        heartbeat_interval_s=args.heartbeat_interval,
        rediscover_interval_s=getattr(args, "rediscover_interval", None) or 0.0,
        backoff=BackoffSettings(initial_s=min(0.5, args.max_backoff), max_s=args.max_backoff),
    )


def _hook(args: argparse.Namespace) -> tuple[str, ...] | None:
    try:
        return ApplierSettings.parse_hook(args.hook)
    except ValueError as exc:
        raise InputError(f"cannot split the command: {exc}", field="--hook") from exc


# --------------------------------------------------------------------------- commands


async def _until_signal(coro_stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, coro_stop.set)
    await coro_stop.wait()


def _cmd_run(args: argparse.Namespace) -> int:
    if args.discovery == "static":
        if args.fleet_file is None or not args.node:
            raise InputError("static discovery needs --fleet-file and --node", field="--fleet-file")
        if args.rediscover_interval is None:
            args.rediscover_interval = 0.0
    elif args.rediscover_interval is None:
        args.rediscover_interval = 30.0
    settings = _agent_settings(args)
    phases = tuple(p for p in args.hook_phases.split(",") if p)
    bad = [p for p in phases if p not in HOOK_PHASES]
    if bad or not phases:
        raise InputError(
            f"unknown phase(s) {bad}; choose from {', '.join(HOOK_PHASES)}", field="--hook-phases"
        )
    fabrics = _pairs(args.nic_fabric, "--nic-fabric")
    labels = _pairs(args.label, "--label")
    discover = _with_address(_discovery(args, fabrics, labels), _advertise_address(args))
    node = discover().node  # fail fast, before any connection, on a discovery problem
    try:
        applier = PlanApplier(
            ApplierSettings(
                plan_dir=args.plan_dir,
                node=node,
                hook=_hook(args),
                hook_timeout_s=args.hook_timeout,
                hook_phases=phases,
            )
        )
    except OSError as exc:
        raise InputError(
            f"cannot use plan directory {str(args.plan_dir)!r}: {exc.strerror or exc}",
            field="--plan-dir",
        ) from exc
    applier.recover()
    configure_logging(args.log_level)
    agent = Agent(settings, discover, applier)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run())
        waiter = asyncio.create_task(_until_signal(stop))
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        agent.stop()
        waiter.cancel()
        await task

    asyncio.run(main())
    return EXIT_OK


def _discovery(
    args: argparse.Namespace, fabrics: dict[str, str], labels: dict[str, str]
) -> Callable[[], NodeInventory]:
    if args.discovery == "static":
        static = StaticDiscovery.from_file(args.fleet_file, args.node)
        return static.discover
    backend: Any
    if args.discovery == "amdsmi":  # AMD GPUs; the amdsmi module loads on first use
        from agents.discovery.amdsmi import AmdSmiDiscovery

        backend = AmdSmiDiscovery(node_name=args.node, labels=labels)
    else:
        try:
            nvml_mod = importlib.import_module("agents.discovery.nvml")
        except ModuleNotFoundError as exc:
            raise DiscoveryError(
                "NVML discovery is not available in this build. To fix: use --discovery "
                "static --fleet-file F --node NAME"
            ) from exc
        backend = nvml_mod.NvmlDiscovery(node_name=args.node, watch_xid=True, labels=labels)
    nics = None
    if not args.no_sysfs:
        nics = SysfsNicDiscovery(
            args.sysfs_root,
            fabrics=fabrics,
            default_fabric=args.default_fabric,
            node_name=args.node or None,
        )

    def discover() -> NodeInventory:
        inv: NodeInventory = backend.discover()
        return nics.augment(inv) if nics is not None else inv

    return discover


def _with_address(
    discover: Callable[[], NodeInventory], address: str
) -> Callable[[], NodeInventory]:
    """``discover`` whose inventories carry ``address`` (unchanged when it is ``""``)."""
    if not address:
        return discover

    def with_address() -> NodeInventory:
        return replace(discover(), address=address)

    return with_address


def _cmd_simulate(args: argparse.Namespace) -> int:
    settings = _agent_settings(args)
    address = _advertise_address(args)
    fleet = load_fleet_file(args.fleet)
    configure_logging(args.log_level)
    sim = SimulatedFleet(
        fleet,
        settings,
        plan_dir=args.plan_dir,
        hook=_hook(args),
        agents_per_channel=args.agents_per_channel,
        address=address,
    )

    async def main() -> None:
        stop = asyncio.Event()
        sim.start()
        waiter = asyncio.create_task(_until_signal(stop))
        everyone = asyncio.create_task(sim.wait())
        await asyncio.wait({waiter, everyone}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        everyone.cancel()
        await sim.stop()

    asyncio.run(main())
    if sim.errors:
        node, exc = next(iter(sim.errors.items()))
        if isinstance(exc, AgentFatalError | InputError | DiscoveryError):
            raise AgentFatalError(f"{len(sim.errors)} simulated agent(s) failed; {node}: {exc}")
        raise exc
    return EXIT_OK


def _cmd_calibrate(argv: Sequence[str]) -> int:
    """``mixfleet-agent calibrate ...``: :mod:`agents.calibrate` adds its own flags
    (``add_arguments(parser)``) and runs with ``main(namespace)``; imported only here."""
    try:
        mod = importlib.import_module("agents.calibrate")
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        what = (
            "module agents.calibrate is missing"
            if missing == "agents.calibrate"
            else f"it needs {missing or exc}"
        )
        print(
            f"error: calibration is not available in this installation ({what}). To fix: "
            "install mixfleet with GPU support (pip install 'mixfleet[gpu]') on a GPU node",
            file=sys.stderr,
        )
        return EXIT_USAGE
    parser = _Parser(
        prog="mixfleet-agent calibrate",
        description="Measure this node's GPUs (GEMM, attention, HBM, all-to-all).",
    )
    add_arguments = getattr(mod, "add_arguments", None)
    if callable(add_arguments):
        add_arguments(parser)
    rc = mod.main(parser.parse_args(list(argv)))
    return int(rc or 0)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring)."""
    raw = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        if raw[:1] == ["calibrate"]:  # calibrate parses its own flags
            return _cmd_calibrate(raw[1:])
        args = parser.parse_args(_rewrite_simulate_fleet(raw))
        return int(args.handler(args))
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except (InputError, DiscoveryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AgentFatalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except MixfleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
