"""A small OpenAI-compatible engine on loopback, for the router's tests and benchmark.

It serves ``/v1/chat/completions``, ``/v1/completions``, ``/generate`` (SSE when ``stream``
is true, else one JSON answer), ``/v1/models``, ``/health`` and SGLang's expert-distribution
recorder endpoints; it records the DP rank each request asked for, generates ``max_tokens``
tokens at the rate of the rank that serves it, and can be killed (listening socket closed,
every connection aborted, as a crashed process leaves them) and started again on its port.

Where the rank is read, per ``engine`` (the engines' own code):

* ``sglang`` (0.5.23): body ``routed_dp_rank`` (deprecated alias ``data_parallel_rank``,
  ``srt/entrypoints/openai/protocol.py`` and ``srt/managers/io_struct.py``); on the OpenAI
  endpoints the header ``X-Data-Parallel-Rank`` wins over the body
  (``OpenAIServingBase.extract_routed_dp_rank_from_header``, ``serving_base.py`` 271-293).
* ``vllm`` (0.33.0): header ``X-data-parallel-rank`` only, an unparsable value ignored
  (``_get_data_parallel_rank``, ``vllm/entrypoints/generate/base/serving.py`` 216-228).
* ``trtllm`` (main, ``tensorrt_llm/serve/openai_protocol.py`` at 0076e939): no rank field.
  The request models forbid extra fields, so a body with ``attention_dp_rank`` or
  ``attention_dp_relax`` (``SchedulingParams`` fields of the LLM API only) is refused with
  400 ``{"error": "..."}`` as ``validation_exception_handler`` (``serve/openai_server.py``)
  answers; every request is balanced by the engine.

A request without a rank is balanced round-robin (the engine's own equal balancing).

Prefill/decode roles (``role``), speaking the protocol of ``engine`` (what the router's
:mod:`controlplane.router.pd` sends, from the engines' own routers): :mod:`support.pd_side`.
Run on its own (from ``tests/``): ``python -m support.openai_engine --port P
--role prefill|decode|aggregated --protocol sglang|vllm``.

Recorder endpoints, as SGLang 0.5.23 answers them (``srt/entrypoints/http_server.py``
1267-1297: GET or POST, 200, plain text ``"Start recording the expert distribution.\\n"``,
``"Stop recording the expert distribution.\\n"``, ``"Dump expert distribution record.\\n"``).
The counts do not come back in the answer: the stat recorder's dump writes
``expert_distribution_recorder_{time.time()}.pt`` into ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``
holding ``dict(rank=0, logical_count=int32 tensor [steps, num_layers, num_experts],
average_utilization_rate_over_window=...)`` and resets the buffer while recording goes on
(``srt/eplb/expert_distribution.py``: ``_StatAccumulator.dump``, ``_dump_to_file``,
``dump_record`` -> ``_reset``; ``start_record`` clears and starts). Here one generated token
of one request is one step; which experts it selects follows a fixed skewed pattern.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from support import pd_side

#: Body fields trtllm-serve's request models do not have (they forbid extra fields).
TRTLLM_FORBIDDEN = ("attention_dp_rank", "attention_dp_relax")


@dataclass
class Record:
    """One request the engine received.

    Attributes:
        path: endpoint. rank: the rank that served it. pinned: the request named the rank.
        request_id: the ``X-Request-Id`` header, else "". tokens: tokens it sent back.
        done: it finished (False: cut by a kill or a client disconnect). limit: the output
        limit it stated, tokens (None: none, the engine's default applies).
    """

    path: str
    rank: int
    pinned: bool
    request_id: str
    tokens: int = 0
    done: bool = False
    limit: int | None = None


@dataclass
class LoopbackEngine:
    """The engine (module docstring).

    Attributes:
        engine: ``sglang`` | ``vllm`` | ``trtllm``: where the rank is read.
        tokens_per_s: generation rate of each DP rank (its length is the number of ranks).
        model: name in ``/v1/models``.
        num_layers, num_experts, top_k: shape of the expert recorder.
        dump_dir: where the recorder writes its dumps.
        port: bound port (0 before :meth:`start`, kept after a kill for a new start).
        stamp: put ``"mono_s": time.monotonic()`` (the sending time, a clock shared by the
            processes of one host) into every streamed chunk, for latency benchmarks.
        held: ranks that hold every request they receive, generating nothing until
            :meth:`release` (a rank stalled as far as the router can see, whatever the
            machine's speed).
        role: ``aggregated`` | ``prefill`` | ``decode`` (:mod:`support.pd_side`).
        fail_status: answer every generation request with this HTTP status (0 = serve).
        max_model_len: the longest output a request may ask for, tokens (a larger limit
            is refused with 400, as vLLM refuses one past the model's context).
        pd_wait_s: longest wait of a decode request for its prefill's KV, seconds.
        pd_seen: the disaggregation fields of each request a prefill/decode role received.
    """

    engine: str = "sglang"
    tokens_per_s: list[float] = field(default_factory=lambda: [1000.0])
    model: str = "test-model"
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    dump_dir: Path | None = None
    port: int = 0
    stamp: bool = False
    held: frozenset[int] = frozenset()
    role: str = "aggregated"
    fail_status: int = 0
    max_model_len: int = 1 << 17
    pd_wait_s: float = 30.0
    records: list[Record] = field(default_factory=list)
    pd_seen: list[dict[str, Any]] = field(default_factory=list)
    _kv: dict[str, asyncio.Event] = field(default_factory=dict)
    _released: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.AbstractServer | None = None
    _runner: web.AppRunner | None = None
    _protocols: set[Any] = field(default_factory=set)
    _rr: itertools.count[int] = field(default_factory=itertools.count)
    _recording: bool = False
    _steps: list[list[list[int]]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.router.add_post(path, self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/loopback/kv/{key}", self._kv_wait)
        for verb, text in (
            ("start", "Start recording the expert distribution.\n"),
            ("stop", "Stop recording the expert distribution.\n"),
            ("dump", "Dump expert distribution record.\n"),
        ):
            handler = self._recorder(verb, text)
            app.router.add_route("GET", f"/{verb}_expert_distribution_record", handler)
            app.router.add_route("POST", f"/{verb}_expert_distribution_record", handler)
        return app

    async def start(self) -> LoopbackEngine:
        """Listen on 127.0.0.1 (the same port again after a kill)."""
        if self._runner is None:
            self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None)
            await self._runner.setup()
        handler = self._runner.server
        assert handler is not None

        def factory() -> Any:
            p = handler()
            self._protocols.add(p)
            return p

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, "127.0.0.1", self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def kill(self) -> None:
        """Stop as a crash does: no new connection, every open one aborted mid-stream."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for p in list(self._protocols):
            t = getattr(p, "transport", None)
            if t is not None:
                t.abort()
        self._protocols.clear()

    async def stop(self) -> None:
        self.kill()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def hold(self, ranks: frozenset[int]) -> None:
        """From now on ``ranks`` hold the requests they receive until :meth:`release`."""
        self.held = ranks
        self._released = asyncio.Event()

    def release(self) -> None:
        """Let the :attr:`held` ranks generate (held requests, then every new one)."""
        self._released.set()

    # ----------------------------------------------------------------- serving

    def _rank_of(self, request: web.Request, body: dict[str, Any]) -> int | None:
        if self.engine == "vllm":
            value = request.headers.get("X-data-parallel-rank")
            try:
                return int(value) if value is not None else None
            except ValueError:
                return None
        if self.engine == "trtllm":
            return None
        header = request.headers.get("X-Data-Parallel-Rank")
        if header is not None and request.path != "/generate":
            return int(header)
        r = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        return r if isinstance(r, int) else None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.fail_status:
            return web.json_response(
                {"error": {"message": "injected failure"}}, status=self.fail_status
            )
        if self.role != "aggregated":
            answer = await pd_side.serve(self, request, body)
            if answer is not None:
                return answer
        extra = sorted(k for k in TRTLLM_FORBIDDEN if k in body)
        if self.engine == "trtllm" and extra:
            return web.json_response(
                {"error": f"{extra}: Extra inputs are not permitted"}, status=400
            )
        pinned = self._rank_of(request, body)
        n = len(self.tokens_per_s)
        if pinned is not None and not 0 <= pinned < n:
            return web.json_response(
                {"error": {"message": f"rank {pinned} out of range [0, {n})"}}, status=400
            )
        rank = pinned if pinned is not None else next(self._rr) % n
        rec = Record(
            request.path, rank, pinned is not None, request.headers.get("X-Request-Id", "")
        )
        self.records.append(rec)
        stream = _lax_bool(body.get("stream", False))
        if stream is None:  # the engines' request models declare a boolean (pydantic, lax)
            return web.json_response(
                {"error": {"message": "stream: Input should be a valid boolean"}}, status=400
            )
        if request.path == "/generate":  # SGLang's SamplingParams: 128 when unset
            sp = body.get("sampling_params") or {}
            rec.limit, default = _stated(sp.get("max_new_tokens")), 128
        elif request.path == "/v1/chat/completions":  # vLLM's order (max_tokens if null)
            rec.limit = _stated(body.get("max_completion_tokens"), body.get("max_tokens"))
            default = 16  # vLLM would run to the context's end; a test engine stops sooner
        else:  # /v1/completions knows max_tokens only (vLLM 0.33, SGLang 0.5.23): 16 unset
            rec.limit, default = _stated(body.get("max_tokens")), 16
        tokens = default if rec.limit is None else rec.limit
        if not 0 <= tokens <= self.max_model_len:
            return web.json_response(
                {"error": {"message": f"max_tokens {tokens} is outside 0..{self.max_model_len}"}},
                status=400,
            )
        if rank in self.held:
            await self._released.wait()  # the event of the hold in force on arrival
        delay = 1.0 / self.tokens_per_s[rank]
        if not stream:
            await asyncio.sleep(delay * tokens)
            self._record_steps(tokens)
            rec.tokens, rec.done = tokens, True
            return web.json_response(self.answer(request.path, "t" * tokens, tokens, done=True))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            await asyncio.sleep(delay)
            self._record_steps(1)
            chunk = self.answer(request.path, "t", i + 1, done=i == tokens - 1)
            if self.stamp:
                chunk["mono_s"] = time.monotonic()
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            rec.tokens += 1
        await resp.write(b"data: [DONE]\n\n")
        rec.done = True
        await resp.write_eof()
        return resp

    def answer(self, path: str, text: str, n: int, *, done: bool) -> dict[str, Any]:
        """One answer (or streamed chunk) of ``path`` carrying ``text``; ``n`` tokens so far."""
        finish = "length" if done else None
        if path == "/generate":
            return {"text": text, "meta_info": {"completion_tokens": n, "finish_reason": finish}}
        if path.endswith("chat/completions"):
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
            return {"object": "chat.completion", "model": self.model, "choices": [choice]}
        return {
            "object": "text_completion",
            "model": self.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        }

    def kv_ready(self, key: str) -> None:
        """The KV of ``key`` (an SGLang room, a vLLM request) is here: decodes may read it."""
        self._kv.setdefault(key, asyncio.Event()).set()

    async def _kv_wait(self, request: web.Request) -> web.Response:
        """``GET /loopback/kv/{key}``: 200 once the KV of ``key`` is ready, 404 after
        :attr:`pd_wait_s` (the transfer a decode server makes from its prefill server)."""
        event = self._kv.setdefault(request.match_info["key"], asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), self.pd_wait_s)
        except TimeoutError:
            return web.Response(status=404, text="no such KV")
        return web.Response(text="ok")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "test"}
        return web.json_response({"object": "list", "data": [card]})

    # ----------------------------------------------------------------- recorder

    def _record_steps(self, steps: int) -> None:
        if not self._recording:
            return
        for _ in range(steps):
            s = len(self._steps)
            row = [[0] * self.num_experts for _ in range(self.num_layers)]
            for layer in range(self.num_layers):
                for k in range(self.top_k):  # skewed: low experts chosen more often
                    e = ((s * (layer + 1) + k) % (self.num_experts + 3)) % self.num_experts
                    row[layer][e] += 1
            self._steps.append(row)

    def _recorder(self, verb: str, text: str) -> Any:
        async def handle(request: web.Request) -> web.Response:
            if verb == "start":
                self._steps.clear()
                self._recording = True
            elif verb == "stop":
                self._recording = False
            else:
                self._dump()
            return web.Response(text=text)

        return handle

    def _dump(self) -> None:
        import torch

        assert self.dump_dir is not None, "LoopbackEngine.dump_dir is needed to dump"
        shape = (len(self._steps), self.num_layers, self.num_experts)
        count = torch.tensor(self._steps, dtype=torch.int32).reshape(shape)
        output = {"rank": 0, "logical_count": count, "average_utilization_rate_over_window": None}
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        torch.save(output, str(self.dump_dir / f"expert_distribution_recorder_{time.time()}.pt"))
        self._steps.clear()

    def share(self, path: str | None = None) -> list[float]:
        """Fraction of the recorded requests each rank served."""
        recs = [r for r in self.records if path is None or r.path == path]
        n = len(self.tokens_per_s)
        counts = [sum(1 for r in recs if r.rank == i) for i in range(n)]
        total = sum(counts) or 1
        return [c / total for c in counts]


_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _lax_bool(value: Any) -> bool | None:
    """``value`` as pydantic 2's lax mode reads a boolean field (the engines' ``stream``):
    booleans, 0 and 1, and the strings of yes and no (null reads as false: vLLM's field is
    optional); None for anything else."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int | float) and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    return None


def _stated(*limits: Any) -> int | None:
    """The first output limit the request sets (not null), or None."""
    limit = next((v for v in limits if v is not None), None)
    return None if limit is None else int(limit)


def main(argv: list[str] | None = None) -> None:
    """``python -m support.openai_engine``: serve one loopback engine until interrupted."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m support.openai_engine", description=__doc__)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--role", choices=pd_side.ROLES, default="aggregated")
    p.add_argument("--protocol", choices=("sglang", "vllm", "trtllm"), default="sglang")
    p.add_argument("--ranks", type=int, default=1, help="DP ranks")
    p.add_argument("--tokens-per-s", type=float, default=100.0, help="per rank, tokens/s")
    args = p.parse_args(argv)
    if args.role != "aggregated" and args.protocol == "trtllm":
        p.error("--role prefill|decode needs --protocol sglang|vllm")

    async def serve() -> None:
        engine = LoopbackEngine(
            engine=args.protocol,
            role=args.role,
            port=args.port,
            tokens_per_s=[args.tokens_per_s] * max(1, args.ranks),
        )
        await engine.start()
        print(f"{args.role} {args.protocol} engine on {engine.url}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
