"""``mixfleet-router`` under large request bodies: 8 concurrent 30 MiB bodies, with the
default bounds (``--max-body-bytes`` 32 MiB, ``--max-inflight-body-bytes`` 128 MiB).

Run ``python -m bench.router_memory --out bench/results/router-memory.json``: one test engine
(``tests/support/openai_engine.py``) and the router as processes on loopback; the answers'
statuses and the router's resident memory before, at its peak (``VmHWM``) and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.router_peers import REPO, _free_port, _wait_ready, start_engines


def _vm(pid: int, key: str) -> float:
    """``VmRSS`` / ``VmHWM`` of a process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _bodies(url: str, n: int, size: int) -> list[int]:
    import aiohttp

    head, tail = b'{"prompt": "', b'", "max_tokens": 1}'
    body = head + b"x" * (size - len(head) - len(tail)) + tail
    async with aiohttp.ClientSession() as s:

        async def one() -> int:
            async with s.post(f"{url}/v1/completions", data=body) as r:
                await r.read()
                return r.status

        return list(await asyncio.gather(*(one() for _ in range(n))))


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = REPO / "bench" / ".peers-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    engines, urls = start_engines(1e6, log_dir)
    port = _free_port()
    argv = [sys.executable, "-m", "controlplane.cli", "router", "run", "--listen"]
    argv += [f"127.0.0.1:{port}", "--log-level", "warning", "--instance", f"url={urls[0]}"]
    router = subprocess.Popen(argv, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_ready(url, 60))
        before = _vm(router.pid, "VmRSS")
        statuses = asyncio.run(_bodies(url, args.bodies, args.body_mib << 20))
        time.sleep(1.0)
        doc = {
            "command": "python -m bench.router_memory " + " ".join(sys.argv[1:]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "bodies": args.bodies,
            "body_mib": args.body_mib,
            "statuses": sorted(statuses),
            "rss_mib": {
                "before": round(before, 1),
                "peak": round(_vm(router.pid, "VmHWM"), 1),
                "after": round(_vm(router.pid, "VmRSS"), 1),
            },
        }
    finally:
        router.terminate()
        router.wait(10)
        engines.stop()
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router_memory", allow_abbrev=False)
    p.add_argument("--bodies", type=int, default=8)
    p.add_argument("--body-mib", type=int, default=30)
    p.add_argument("--out", metavar="PATH")
    args = p.parse_args(argv)
    text = json.dumps(run(args), indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
