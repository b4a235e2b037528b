"""Expert-load reporter: drives SGLang's expert-distribution recorder and streams what it
counted to the controller (``EngineService.ReportExpertLoad``), so measured load triggers
re-planning.

It runs beside the engine (on the node of the engine's rank 0, where SGLang writes its
dumps), as ``python -m agents.loadreport``. SGLang 0.5.23's recorder, read from its source:

* ``POST /start_expert_distribution_record`` clears the record and starts recording;
  ``POST /dump_expert_distribution_record`` dumps and resets while recording goes on
  (``srt/entrypoints/http_server.py``, ``srt/eplb/expert_distribution.py``
  ``start_record`` / ``dump_record`` -> ``_reset``). Both answer 200 with a line of text: the
  counts do not come back over HTTP.
* With ``--expert-distribution-recorder-mode stat`` the dump is written by rank 0 to
  ``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_{time}.pt``
  (default dir ``/tmp``): ``torch.save(dict(rank, logical_count=[steps, num_layers,
  num_logical_experts] int32 summed over ranks, average_utilization_rate_over_window))``
  (``_StatAccumulator.dump``, ``_dump_to_file``). Reading it needs torch (the ``gpu`` extra).

Every ``window_s`` the reporter asks for a dump, reads the new file(s), sums
``logical_count`` over the steps into one ``[num_layers][num_experts]`` window (all decoder
layers, dense rows zero: the controller accepts MoE-only or all-layer rows), deletes the
file, and sends the window with the committed plan version (``GetRouting``). Windows that
could not be sent are kept (at most ``max_pending``) and sent with the next ones.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc import aio
from mixfleet.v1 import engine_pb2, engine_pb2_grpc

from agents.agent.connection import AgentSettings, TlsFiles, make_channel
from policies.errors import InputError

log = structlog.get_logger("mixfleet.loadreport")

DUMP_GLOB = "expert_distribution_recorder_*.pt"


@dataclass(frozen=True)
class ReporterSettings:
    """What the reporter drives and where it reports.

    Attributes:
        engine_url: the SGLang server, ``http://HOST:PORT``.
        dump_dir: ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` of the engine.
        deployment: the deployment the engine serves.
        engine_id: who reports (a rank or replica name).
        window_s: seconds per window.
        engine_api_key: SGLang ``--admin-api-key`` / ``--api-key`` ("" = none).
        max_pending: windows kept while the controller is unreachable.
        http_timeout_s: timeout of each recorder call, seconds.
    """

    engine_url: str
    dump_dir: Path
    deployment: str
    engine_id: str
    window_s: float = 60.0
    engine_api_key: str = ""
    max_pending: int = 60
    http_timeout_s: float = 30.0


def read_dump(path: Path) -> list[list[float]]:
    """``logical_count`` of one dump summed over its steps: ``[num_layers][num_experts]``.

    Raises:
        InputError: the file is not a recorder dump.
    """
    import torch

    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
        count = data["logical_count"]
    except Exception as exc:
        raise InputError(f"not an expert distribution dump: {exc}", field=str(path)) from exc
    if count.dim() != 3:
        raise InputError(f"logical_count has shape {tuple(count.shape)}", field=str(path))
    rows: list[list[float]] = count.sum(dim=0).double().tolist()
    return rows


def _call(s: ReporterSettings, endpoint: str) -> None:
    req = urllib.request.Request(f"{s.engine_url}/{endpoint}", data=b"", method="POST")
    if s.engine_api_key:
        req.add_header("Authorization", f"Bearer {s.engine_api_key}")
    with urllib.request.urlopen(req, timeout=s.http_timeout_s) as r:
        r.read()


class LoadReporter:
    """The reporter's loop (module docstring)."""

    def __init__(
        self, settings: ReporterSettings, channel: aio.Channel, metadata: Sequence[tuple[str, str]]
    ) -> None:
        self.s = settings
        self.stub = engine_pb2_grpc.EngineServiceStub(channel)
        self.metadata = tuple(metadata)
        self.pending: list[engine_pb2.ExpertLoadWindow] = []
        self.sent = 0

    async def start_recording(self) -> None:
        await asyncio.to_thread(_call, self.s, "start_expert_distribution_record")

    async def window(self, start_s: float) -> engine_pb2.ExpertLoadWindow | None:
        """Dump, read and delete the new files; the window they make (None: no steps)."""
        await asyncio.to_thread(_call, self.s, "dump_expert_distribution_record")
        total: list[list[float]] | None = None
        for path in sorted(self.s.dump_dir.glob(DUMP_GLOB)):
            rows = await asyncio.to_thread(read_dump, path)
            path.unlink(missing_ok=True)
            if total is None:
                total = rows
            else:
                total = [
                    [a + b for a, b in zip(x, y, strict=True)]
                    for x, y in zip(total, rows, strict=True)
                ]
        if not total or not total[0] or not any(any(r) for r in total):
            return None
        return engine_pb2.ExpertLoadWindow(
            deployment=self.s.deployment,
            engine_id=self.s.engine_id,
            start_unix_s=start_s,
            end_unix_s=max(time.time(), start_s + 1e-3),
            num_layers=len(total),
            num_experts=len(total[0]),
            counts=[c for row in total for c in row],
            plan_version=await self._plan_version(),
        )

    async def _plan_version(self) -> int:
        try:
            r = await self.stub.GetRouting(
                engine_pb2.GetRoutingRequest(
                    deployment=self.s.deployment, format=engine_pb2.ROUTING_FORMAT_NATIVE
                ),
                metadata=self.metadata,
                timeout=10.0,
            )
        except aio.AioRpcError:
            return 0
        return int(r.version)

    async def send_pending(self) -> bool:
        """Stream the pending windows; True when the controller took them all."""
        if not self.pending:
            return True
        batch = list(self.pending)
        try:
            reply = await self.stub.ReportExpertLoad(iter(batch), metadata=self.metadata)
        except aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                log.error("controller refused the windows", details=exc.details())
                self.pending.clear()  # a bad window is permanent: do not resend it
            else:
                log.warning("cannot report load; keeping the windows", code=exc.code().name)
            return False
        del self.pending[: len(batch)]
        self.sent += reply.windows_accepted
        return True

    async def run(self) -> None:
        """Record, dump and report every ``window_s`` until cancelled."""
        await self.start_recording()
        start = time.time()
        while True:
            await asyncio.sleep(self.s.window_s)
            try:
                w = await self.window(start)
            except (OSError, InputError) as exc:
                log.warning("no window from the engine", error=str(exc))
                w = None
            start = time.time()
            if w is not None:
                self.pending.append(w)
                del self.pending[: max(0, len(self.pending) - self.s.max_pending)]
            await self.send_pending()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agents.loadreport``: flags in ``--help``."""
    p = argparse.ArgumentParser(
        prog="python -m agents.loadreport", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--engine-url", required=True)
    p.add_argument("--dump-dir", required=True, type=Path)
    p.add_argument("--deployment", required=True)
    p.add_argument("--engine-id", default="rank0")
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--controller", required=True)
    p.add_argument("--token", default="")
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--tls-ca", type=Path)
    p.add_argument("--insecure", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.window_s <= 0:
            raise InputError("must be > 0", field="--window-s")
        tls = None
        if args.tls_ca is not None:
            if args.tls_cert is None or args.tls_key is None:
                raise InputError("needs --tls-cert and --tls-key too", field="--tls-ca")
            tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
        agent = AgentSettings(args.controller, tls=tls, insecure=args.insecure, token=args.token)
        channel = make_channel(agent)
    except InputError as exc:
        print(f"error: {exc}")
        return 2
    settings = ReporterSettings(
        args.engine_url.rstrip("/"), args.dump_dir, args.deployment, args.engine_id, args.window_s
    )
    md = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    try:
        asyncio.run(LoadReporter(settings, channel, md).run())
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
