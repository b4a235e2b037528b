"""Measured traffic of each ``--deployment``: what the router saw of its requests, one
window at a time, sent to the controller as ``EngineService.ReportTraffic`` (issue: re-plan
on demand drift) and exported on ``/metrics``.

Per request routed to an instance of a watched deployment (:class:`Sample`):

* arrived: counted once per request when it arrives (its body read and valid) in a tier
  that one watched deployment serves alone: one that then waits for a batch slot, is
  refused with 429 or fails upstream is demand all the same (counted when routed, a queue
  or a stall would read as a drop in demand); one refused for its own fault (400, 413) is
  not. In a tier that several deployments or static instances share, when its first try
  is routed (only then is its deployment known).
* prompt tokens: the engine's ``usage.prompt_tokens`` (SGLang ``meta_info.prompt_tokens``)
  when its answer carries one, else the router's own estimate (:func:`.requests.
  estimate_work`: the tokenizer's count, or characters / 4).
* output tokens: the engine's ``completion_tokens`` when its answer carries one (the last
  one of a stream: SGLang's ``meta_info`` is cumulative, vLLM's and SGLang's OpenAI usage
  chunk comes last); else the streamed events but ``[DONE]``; else, for an answer without
  usage that was not streamed, the request's expected output (its ``max_tokens``).
* TTFT: arrival to the first body bytes of a streamed answer; TPOT: (last bytes - first
  bytes) / (output tokens - 1), of a streamed answer with two tokens or more. An answer
  that is not streamed shows neither (the router sees it whole).

* SLO: a streamed answer with a TTFT is *judged* against the deployment's SLO (the targets
  ``Instances.slo_ttft_ms`` / ``slo_tpot_ms`` from ``WatchInstances``; a deployment without
  one judges nothing) and *met* when its TTFT and its TPOT are both within their targets (a
  target of 0 is none; an answer of one token has no TPOT and meets that target). An
  answer that is not streamed is not judged: the router sees no TTFT or TPOT of it.

A window's report carries requests, judged and met requests, input/output mean and p90, TTFT/TPOT p50 and p99
(:func:`policies.serving.sim_types.percentiles`, as the serving simulator reports them);
a window with no request is sent too (demand fell to 0). A failed report is logged once
per streak of failures and never touches requests.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog
from mixfleet.v1 import engine_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram

from policies.serving.sim_types import percentiles
from policies.serving.traffic import Slo

log = structlog.get_logger("mixfleet.router.traffic")

_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
_TPOT_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)


def _last(pattern: re.Pattern[bytes], data: bytes) -> int | None:
    found = pattern.findall(data)
    return int(found[-1]) if found else None


@dataclass
class Sample:
    """What the router saw of one request (times from ``time.perf_counter``, seconds).

    Attributes:
        deployment: the watched deployment it went to.
        arrived_s: when it arrived.
        prompt_tokens: the router's estimate of its prompt, tokens.
        expected_output: its output limit (or the default), tokens.
        stream: the answer was streamed (``text/event-stream``).
        first_s, last_s: first and last body bytes of the answer (0 = none yet).
        events: streamed events seen (``data:`` lines, ``[DONE]`` included).
        before_last, last: the answer's last two reads (where a usage block comes; kept,
            not copied, per read).
        status: the engine's HTTP status (0 = no answer yet); only a 2xx answer counts.
    """

    deployment: str
    arrived_s: float
    prompt_tokens: int
    expected_output: int
    stream: bool = False
    first_s: float = 0.0
    last_s: float = 0.0
    events: int = 0
    before_last: bytes = b""
    last: bytes = b""
    status: int = 0

    def answer(self, status: int, content_type: str) -> None:
        """The engine's answer began: its status and content type."""
        self.status = status
        self.stream = content_type.startswith("text/event-stream")

    def body(self, data: bytes) -> None:
        """Bytes of the answer arrived now."""
        now = time.perf_counter()
        if not self.first_s:
            self.first_s = now
        self.last_s = now
        self.events += data.count(b"data:")
        self.before_last, self.last = self.last, data

    def counts(self) -> tuple[int, int]:
        """(prompt tokens, output tokens) by the rules of the module docstring."""
        tail = self.before_last[-4096:] + self.last[-4096:]
        usage = b"_tokens" in tail  # the regular expressions only where they may match
        prompt = _last(_PROMPT, tail) if usage else None
        output = _last(_COMPLETION, tail) if usage else None
        if output is None:
            if self.stream:
                output = max(self.events - (1 if b"[DONE]" in tail else 0), 0)
            else:
                output = self.expected_output
        return (self.prompt_tokens if prompt is None else prompt), output


@dataclass
class Window:
    """One deployment's measurements since its last report.

    Attributes:
        start_unix_s: when the window began (Unix time, seconds).
        requests: requests that arrived.
        input_tokens, output_tokens: per finished request, tokens.
        ttft_ms, tpot_ms: per streamed request, milliseconds.
        slo_judged, slo_met: streamed requests judged against the SLO, and those that met it.
    """

    start_unix_s: float
    requests: int = 0
    input_tokens: list[float] = field(default_factory=list)
    output_tokens: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    slo_judged: int = 0
    slo_met: int = 0

    def report(self, deployment: str, reporter: str, end_unix_s: float) -> engine_pb2.TrafficReport:
        """The ``TrafficReport`` of this window, ending at ``end_unix_s``."""
        inp, out = percentiles(self.input_tokens), percentiles(self.output_tokens)
        ttft, tpot = percentiles(self.ttft_ms), percentiles(self.tpot_ms)
        return engine_pb2.TrafficReport(
            deployment=deployment,
            reporter=reporter,
            start_unix_s=self.start_unix_s,
            end_unix_s=max(end_unix_s, self.start_unix_s + 1e-6),
            requests=self.requests,
            input_tokens_mean=inp.mean,
            input_tokens_p90=inp.p90,
            output_tokens_mean=out.mean,
            output_tokens_p90=out.p90,
            ttft_ms_p50=ttft.p50,
            ttft_ms_p99=ttft.p99,
            tpot_ms_p50=tpot.p50,
            tpot_ms_p99=tpot.p99,
            slo_judged=self.slo_judged,
            slo_met=self.slo_met,
        )


class TrafficBook:
    """The open windows of the watched deployments and their ``/metrics`` series.

    Args:
        deployments: the watched deployments.
        registry: the router's metrics registry.
        clock: Unix time, seconds (injectable for tests).
    """

    def __init__(
        self,
        deployments: Sequence[str],
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        now = clock()
        self.windows = {d: Window(now) for d in deployments}
        #: deployment -> its SLO (from its last ``Instances`` message; absent = none)
        self.slos: dict[str, Slo] = {}
        labels = ["deployment"]
        r = registry
        self.arrived = Counter(
            "mixfleet_router_traffic_requests", "Requests that arrived.", labels, registry=r
        )
        self.input_tokens = Counter(
            "mixfleet_router_traffic_input_tokens",
            "Prompt tokens of finished requests.",
            labels,
            registry=r,
        )
        self.output_tokens = Counter(
            "mixfleet_router_traffic_output_tokens",
            "Output tokens of finished requests.",
            labels,
            registry=r,
        )
        self.ttft = Histogram(
            "mixfleet_router_traffic_ttft_seconds",
            "Time to first token, streamed answers, s.",
            labels,
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "mixfleet_router_traffic_tpot_seconds",
            "Time per output token, streamed answers, s.",
            labels,
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self._children: dict[str, tuple[Counter, Counter, Counter, Histogram, Histogram]] = {}
        self.reports = Counter(
            "mixfleet_router_traffic_reports",
            "Traffic reports sent, by outcome (ok, failed).",
            ["deployment", "outcome"],
            registry=r,
        )

    def _kids(self, deployment: str) -> tuple[Counter, Counter, Counter, Histogram, Histogram]:
        """The series of ``deployment``, looked up once and kept."""
        kids = self._children.get(deployment)
        if kids is None:
            kids = self._children[deployment] = (
                self.arrived.labels(deployment),
                self.input_tokens.labels(deployment),
                self.output_tokens.labels(deployment),
                self.ttft.labels(deployment),
                self.tpot.labels(deployment),
            )
        return kids

    def set_slo(self, deployment: str, slo: Slo) -> None:
        """``deployment``'s SLO is now ``slo`` (no target at all, or a percentile of 0:
        none)."""
        if (slo.ttft_ms > 0 or slo.tpot_ms > 0) and slo.percentile > 0:
            self.slos[deployment] = slo
        else:
            self.slos.pop(deployment, None)

    def arrive(self, deployment: str) -> None:
        """A request of ``deployment`` arrived."""
        w = self.windows.get(deployment)
        if w is not None:
            w.requests += 1
            self._kids(deployment)[0].inc()

    def finish(self, sample: Sample) -> None:
        """A request measured by ``sample`` has ended with an answer."""
        w = self.windows.get(sample.deployment)
        if w is None or not 200 <= sample.status < 300:
            return
        prompt, output = sample.counts()
        w.input_tokens.append(prompt)
        w.output_tokens.append(output)
        _, inputs, outputs, ttft, tpot = self._kids(sample.deployment)
        inputs.inc(prompt)
        outputs.inc(output)
        if sample.stream and sample.first_s:
            ttft_s = sample.first_s - sample.arrived_s
            w.ttft_ms.append(ttft_s * 1e3)
            ttft.observe(ttft_s)
            tpot_ms = 0.0  # one token: no TPOT, its target holds
            if output > 1:
                tpot_s = (sample.last_s - sample.first_s) / (output - 1)
                tpot_ms = tpot_s * 1e3
                w.tpot_ms.append(tpot_ms)
                tpot.observe(tpot_s)
            slo = self.slos.get(sample.deployment)
            if slo is not None:
                w.slo_judged += 1
                w.slo_met += int(slo.met(ttft_s * 1e3, tpot_ms))

    def close(self, deployment: str, reporter: str) -> engine_pb2.TrafficReport:
        """End ``deployment``'s window now: its report; the next window starts."""
        now = self.clock()
        report = self.windows[deployment].report(deployment, reporter, now)
        self.windows[deployment] = Window(now)
        return report


async def report_forever(
    book: TrafficBook,
    send: Callable[[engine_pb2.TrafficReport], Awaitable[None]],
    *,
    reporter: str,
    window_s: float,
) -> None:
    """Every ``window_s`` seconds, close each deployment's window and send its report;
    a failure is logged once per streak (per deployment) and the next window goes on."""
    failing: set[str] = set()
    while True:
        await asyncio.sleep(window_s)
        for d in list(book.windows):
            report = book.close(d, reporter)
            try:
                await send(report)
            except Exception as exc:  # the reporter's boundary: requests never see it
                book.reports.labels(d, "failed").inc()
                if d not in failing:
                    failing.add(d)
                    log.warning(
                        "traffic report failed; later failures of this streak are not logged",
                        deployment=d,
                        error=type(exc).__name__,
                        detail=str(exc)[:200],
                    )
                continue
            book.reports.labels(d, "ok").inc()
            if d in failing:
                failing.discard(d)
                log.info("traffic reports sent again", deployment=d)
