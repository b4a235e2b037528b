"""``mixfleet-router`` side by side with the Rust routers (sglang-router, vllm-router) in one
run: router CPU per streamed request, added time to first token, short requests per second,
engines ejected.

Run ``python -m bench.router --peers --out bench/results/router-peers.json``. The peers are
installed from PyPI into their own virtual environment (``--peers-venv``, default
``bench/.peers-venv``, git-ignored) when missing: ``sglang-router`` and ``vllm-router`` at the
versions of :data:`PEERS`.

Set-up, all on loopback: 8 test engines (``tests/support/openai_engine.py``, one DP rank
each, in one process) that stream fixed-pace chunks; each router in its own process(es) in
front of the 8 (round robin for the peers, the plan's equal weights for mixfleet); one
client process. Every path (``direct``: the client spreads requests over the 8 engines
itself, then each router) runs in every round, the order rotated by one each round, so
all see the same moments of a shared host; only ratios within a round are compared.

* ``streams``: closed-loop clients (100, 500), each sending one streamed completion of
  ``--chunks`` chunks after the other for ``--seconds``; the chunk pace is set so the
  engines send about ``--chunk-rate`` chunks/s in all. Per path: requests completed,
  errors (non-200 or cut), time to first token (TTFT: request start to the first data
  chunk; requests started in a pass's first second are not counted) p50 / p99, and the
  router's CPU time (user + system of its processes, from
  ``/proc``) per completed request. Added TTFT = path percentile - direct percentile,
  same round.
* ``short``: closed-loop non-streamed requests without generation, 64 clients: requests/s,
  the ratio to direct in the same round, and the router's CPU per request.
* ``ejected``: mixfleet's ``mixfleet_router_ejections_total`` after the run; for the peers
  (and ``mixfleet-w2``, whose ``/metrics`` is per worker) the requests that failed (an
  ejected engine shows as errors).

Paths (``--paths``): ``mixfleet`` (one process), ``mixfleet-w2`` (``--workers 2``),
``sglang``, ``vllm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.router_client import pct
from bench.router_peers_report import finish, summary
from policies.errors import InputError

REPO = Path(__file__).resolve().parents[1]

#: The peers and the versions measured (PyPI).
PEERS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}
DEFAULT_VENV = REPO / "bench" / ".peers-venv"
ENGINES = 8
TICK_S = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ensure_peers(venv: Path) -> Path:
    """The peers' virtual environment, made and filled from PyPI when a peer is missing."""
    py = venv / "bin" / "python"
    missing = [p for p in PEERS if not (venv / "bin" / p).exists()]
    if missing:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pins = [f"{p}=={v}" for p, v in PEERS.items()]
        subprocess.run([str(py), "-m", "pip", "install", "-q", *pins], check=True)
    return venv


def _peer_versions(venv: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        rows = json.loads(out.stdout)
    except ValueError:
        return {}
    return {r["name"]: r["version"] for r in rows if r["name"] in PEERS}


def _engines_main(ports: Sequence[int], tokens_per_s: float) -> None:
    """Child: the 8 test engines on one uvloop event loop until killed."""
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "proto")]
    import uvloop
    from support.openai_engine import LoopbackEngine

    async def serve() -> None:
        for port in ports:
            await LoopbackEngine(tokens_per_s=[tokens_per_s], port=port, stamp=False).start()
        await asyncio.Event().wait()

    uvloop.run(serve())


@dataclass
class Proc:
    """A started process and the command that started it."""

    name: str
    popen: subprocess.Popen[bytes]
    url: str

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process and every descendant still alive."""
        return sum(_cpu_s(pid) for pid in _tree(self.popen.pid))

    def stop(self) -> None:
        for pid in reversed(_tree(self.popen.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK_S  # utime, stime


PINNED: dict[str, frozenset[int]] = {}
"""CPUs per role (``router``, ``engines``, ``client``) from ``--pin``; a role without an entry
runs wherever the kernel puts it. Set once by :func:`run`."""


def parse_pin(text: str) -> dict[str, frozenset[int]]:
    """``router=0-1;engines=2-3;client=4-7`` -> CPUs per role (``;`` between roles, ``,`` and
    ``-`` within one).

    Raises:
        InputError: an unknown role, or a CPU list that is not numbers and ranges.
    """
    out: dict[str, frozenset[int]] = {}
    for part in filter(None, text.split(";")):
        role, _, cpus = part.partition("=")
        if role not in ("router", "engines", "client"):
            raise InputError(f"--pin: role {role!r}: choose router, engines or client")
        chosen: set[int] = set()
        for item in cpus.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise InputError(f"--pin {role}: {cpus!r} is not a CPU list like 0-1,4")
            chosen.update(range(int(lo), int(hi or lo) + 1))
        out[role] = frozenset(chosen)
    return out


def _start(name: str, argv: Sequence[str], url: str, log_dir: Path) -> Proc:
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - the process owns it
    cpus = PINNED.get("engines" if name == "engines" else "router")
    popen = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        preexec_fn=None if cpus is None else (lambda: os.sched_setaffinity(0, cpus)),
    )
    return Proc(name, popen, url)


def start_engines(tokens_per_s: float, log_dir: Path) -> tuple[Proc, list[str]]:
    ports = [_free_port() for _ in range(ENGINES)]
    code = (
        "import sys; sys.path[:0] = ['.']; from bench.router_peers import _engines_main; "
        f"_engines_main({ports!r}, {tokens_per_s!r})"
    )
    proc = _start("engines", [sys.executable, "-c", code], "", log_dir)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    return proc, urls


def start_routers(
    engines: Sequence[str], venv: Path, log_dir: Path, only: Sequence[str]
) -> dict[str, Proc]:
    """Every router in front of ``engines``, each on its own port."""
    procs: dict[str, Proc] = {}
    for name in ("mixfleet", "mixfleet-w2"):
        if name not in only:
            continue
        port = _free_port()
        workers = ["--workers", "2"] if name == "mixfleet-w2" else []
        argv = [
            sys.executable,
            "-m",
            "controlplane.cli",
            "router",
            "run",
            "--listen",
            f"127.0.0.1:{port}",
            "--log-level",
            "warning",
            "--queue-limit",
            "100000",
            *workers,
            *itertools.chain.from_iterable(
                ("--instance", f"url={u},name=e{i}") for i, u in enumerate(engines)
            ),
        ]
        procs[name] = _start(name, argv, f"http://127.0.0.1:{port}", log_dir)
    for peer, exe in (("sglang", "sglang-router"), ("vllm", "vllm-router")):
        if peer not in only:
            continue
        port = _free_port()
        launch = ["launch"] if peer == "sglang" else []
        argv = [
            str(venv / "bin" / exe),
            *launch,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--log-level",
            "warn" if peer == "sglang" else "warning",
            "--prometheus-port",  # both default to 29000
            str(_free_port()),
            "--worker-urls",
            *engines,
        ]
        procs[peer] = _start(peer, argv, f"http://127.0.0.1:{port}", log_dir)
    return procs


async def _wait_ready(url: str, timeout_s: float) -> None:
    import aiohttp

    end = time.monotonic() + timeout_s
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not serve within {timeout_s} s")
            await asyncio.sleep(0.2)


# ------------------------------------------------------------------ clients


#: Seconds at the start of a timed pass whose requests' TTFT is not kept (connections open).
WARMUP_S = 1.0


async def _streams(
    urls: Sequence[str], clients: int, chunks: int, seconds: float
) -> dict[str, Any]:
    """``clients`` closed loops of streamed completions for ``seconds``; spread over
    ``urls`` (one URL: a router; several: the engines directly). TTFT is kept for the
    requests started after the first :data:`WARMUP_S` seconds (every connection is open by
    then, on every path); completions and failures count all."""
    import aiohttp

    ttft: list[float] = []
    done = [0, 0]  # completed, failed
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": chunks, "stream": True})
    headers = {"Content-Type": "application/json"}
    end = time.monotonic() + seconds
    warm = end - seconds + WARMUP_S
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:

        async def loop(i: int) -> None:
            url = urls[i % len(urls)] + "/v1/completions"
            await asyncio.sleep(0.5 * i / clients)  # spread the starts
            while time.monotonic() < end:
                t0 = time.monotonic()
                first = 0.0
                ok = False
                try:
                    async with s.post(url, data=body, headers=headers) as r:
                        if r.status == 200:
                            async for _ in r.content.iter_any():
                                if not first:
                                    first = time.monotonic()
                            ok = True
                        else:
                            await r.read()
                except (aiohttp.ClientError, TimeoutError):
                    await asyncio.sleep(0.05)
                if ok and first:
                    done[0] += 1
                    if t0 >= warm:
                        ttft.append(first - t0)
                else:
                    done[1] += 1

        await asyncio.gather(*(loop(i) for i in range(clients)))
    return {
        "completed": done[0],
        "failed": done[1],
        "ttft_ms": {"p50": pct(ttft, 0.5) * 1e3, "p99": pct(ttft, 0.99) * 1e3},
    }


async def _short(urls: Sequence[str], clients: int, seconds: float) -> dict[str, Any]:
    import aiohttp

    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 0})
    headers = {"Content-Type": "application/json"}
    done = [0, 0]
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def loop(i: int) -> None:
            url = urls[i % len(urls)] + "/v1/completions"
            while time.monotonic() < end:
                try:
                    async with s.post(url, data=body, headers=headers) as r:
                        await r.read()
                        done[0 if r.status == 200 else 1] += 1
                except aiohttp.ClientError:
                    done[1] += 1

        t0 = time.monotonic()
        await asyncio.gather(*(loop(i) for i in range(clients)))
        wall = time.monotonic() - t0
    return {"requests_per_s": round(done[0] / wall, 1), "failed": done[1]}


def _rotated(names: Sequence[str], round_: int) -> list[str]:
    k = round_ % len(names)
    return [*names[k:], *names[:k]]


# ------------------------------------------------------------------ run


def _ejections(url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("mixfleet_router_ejections_total{")
    )


@contextlib.contextmanager
def _fleet(
    tokens_per_s: float, venv: Path, log_dir: Path, paths: Sequence[str]
) -> Iterator[tuple[list[str], dict[str, Proc]]]:
    """The engines (``tokens_per_s`` tokens/s per stream) and the routers of ``paths`` in
    front of them, started and answering: (engine URLs, routers by name); all stopped when
    the block ends."""
    engines, urls = start_engines(tokens_per_s, log_dir)
    routers = start_routers(urls, venv, log_dir, paths)
    try:
        for p in routers.values():
            asyncio.run(_wait_ready(p.url, 60))
        asyncio.run(_wait_ready(urls[0], 60))
        yield urls, routers
    finally:
        for p in routers.values():
            p.stop()
        engines.stop()


def _on_path(
    name: str,
    urls: list[str],
    routers: dict[str, Proc],
    measure: Callable[[list[str]], dict[str, Any]],
) -> tuple[dict[str, Any], float]:
    """``measure`` run on one path, the engines directly (``direct``) or one router: its
    result and the CPU seconds that router spent meanwhile (0.0 for ``direct``)."""
    router = routers.get(name)
    cpu0 = router.cpu_s() if router is not None else 0.0
    res = measure(urls if router is None else [router.url])
    return res, (router.cpu_s() - cpu0 if router is not None else 0.0)


def _level(
    streams: int, args: Any, venv: Path, log_dir: Path, paths: Sequence[str]
) -> dict[str, Any]:
    interval_s = streams / args.chunk_rate
    rounds: list[dict[str, Any]] = []

    def measure(targets: list[str]) -> dict[str, Any]:
        return asyncio.run(_streams(targets, streams, args.chunks, args.seconds))

    with _fleet(1.0 / interval_s, venv, log_dir, paths) as (urls, routers):
        names = ["direct", *routers]
        for i in range(args.rounds):
            row: dict[str, Any] = {"order": _rotated(names, i)}
            for name in row["order"]:
                res, cpu = _on_path(name, urls, routers, measure)
                if name in routers:
                    res["router_cpu_ms_per_request"] = round(
                        cpu * 1e3 / max(res["completed"], 1), 4
                    )
                row[name] = res
            row["load_average_1m"] = round(os.getloadavg()[0], 2)
            for name in routers:
                row[name]["added_ttft_ms"] = {
                    q: round(row[name]["ttft_ms"][q] - row["direct"]["ttft_ms"][q], 3)
                    for q in ("p50", "p99")
                }
            rounds.append(row)
            log_line = {
                n: (row[n].get("router_cpu_ms_per_request"), row[n].get("added_ttft_ms"))
                for n in routers
            }
            print(f"{streams} streams, round {i + 1}: {log_line}", file=sys.stderr, flush=True)
        ejected = {"mixfleet": _ejections(routers["mixfleet"].url)} if "mixfleet" in routers else {}
    return {
        "streams": streams,
        "chunk_interval_ms": round(interval_s * 1e3, 1),
        "rounds": rounds,
        "summary": summary(rounds, list(routers)),
        "mixfleet_ejections": ejected.get("mixfleet"),
    }


def _short_part(args: Any, venv: Path, log_dir: Path, paths: Sequence[str]) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []

    def measure(targets: list[str]) -> dict[str, Any]:
        return asyncio.run(_short(targets, 64, args.short_s))

    with _fleet(1e6, venv, log_dir, paths) as (urls, routers):
        names = ["direct", *routers]
        for i in range(args.rounds):
            row: dict[str, Any] = {"order": _rotated(names, i)}
            for name in row["order"]:
                row[name], cpu = _on_path(name, urls, routers, measure)
                if name in routers:
                    done = row[name]["requests_per_s"] * args.short_s
                    row[name]["router_cpu_ms_per_request"] = round(cpu * 1e3 / max(done, 1), 4)
            for name in routers:
                row[name]["vs_direct"] = round(
                    row[name]["requests_per_s"] / row["direct"]["requests_per_s"], 3
                )
            rounds.append(row)
            print(
                f"short, round {i + 1}: " + str({n: row[n]["vs_direct"] for n in routers}),
                file=sys.stderr,
                flush=True,
            )
    return {
        "clients": 64,
        "rounds": rounds,
        "vs_direct_median": {
            n: round(statistics.median(r[n]["vs_direct"] for r in rounds), 3) for n in routers
        },
    }


def run(args: Any) -> dict[str, Any]:
    """The peers comparison (module docstring); the results document."""
    paths = [p for p in args.paths.split(",") if p]
    PINNED.clear()
    PINNED.update(parse_pin(args.pin))
    if "client" in PINNED:
        os.sched_setaffinity(0, PINNED["client"])
    venv = ensure_peers(Path(args.peers_venv)) if {"sglang", "vllm"} & set(paths) else None
    log_dir = Path(args.log_dir or (REPO / "bench" / ".peers-logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load0 = os.getloadavg()[0]
    venv_path = venv or Path(args.peers_venv)
    levels = [_level(int(n), args, venv_path, log_dir, paths) for n in args.streams.split(",")]
    short = _short_part(args, venv_path, log_dir, paths)
    doc: dict[str, Any] = {
        "command": "python -m bench.router " + " ".join(sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "load_average_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "pinned_cpus": {k: sorted(v) for k, v in sorted(PINNED.items())},
            "peers": _peer_versions(venv_path) if venv else {},
            "mixfleet_loop": "uvloop",
        },
        "settings": {
            "engines": ENGINES,
            "chunks": args.chunks,
            "chunk_rate_per_s": args.chunk_rate,
            "seconds_per_path": args.seconds,
            "short_s": args.short_s,
            "rounds": args.rounds,
            "paths": paths,
            "peer_policy": "round_robin",
        },
        "streams": levels,
        "short": short,
        "wall_s": round(time.time() - started, 1),
    }
    return finish(doc)
