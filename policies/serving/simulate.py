"""The serving simulator: requests through a :class:`~policies.serving.plan.ServingPlan`,
event by event, to check what the planner predicts.

:func:`simulate` is a discrete-event simulation (a heap of events in simulated
microseconds, one seeded :class:`random.Random`, deterministic for a seed) of
``options.requests`` requests of a :class:`~policies.serving.traffic.Traffic`:

- **Arrivals** follow the traffic (Poisson, or gamma gaps for bursty traffic); prompt and
  output lengths are drawn from its distributions, in that order per request, from the
  same generator as the gaps.
- **Router**: pools are picked by smooth weighted round robin over their shares (nginx's
  algorithm: deterministic, every window of ``sum(shares)`` requests in proportion); inside
  a pool a request goes to the least loaded instance (aggregated and decode: fewest requests
  waiting or running; prefill: fewest prompt tokens waiting or in the forward; ties: the
  lowest index). An instance serves its own queue first come, first served.
- **Aggregated instance** (continuous batching with chunked prefill): at the start of each
  step it admits waiting requests while it runs fewer than ``batch_limit`` sequences and
  their reserved KV (prompt + full output, tokens) fits in the curve's KV capacity (a
  request larger than the capacity runs alone). A step decodes one token for every
  sequence past its prefill and prefills up to ``chunk_tokens`` prompt tokens of the
  admitted sequences in admission order; it lasts
  :meth:`~policies.serving.curves.StepCurve.mixed_step_us`. A sequence whose last prompt
  chunk ran gets its first token at the end of that step; each later step gives one more.
- **Prefill/decode pool**: a prefill instance runs a forward over waiting prompts, first
  come first served, up to ``chunk_tokens`` prompt tokens (at least one prompt; batched
  prompts cost the forward of their summed tokens); at its end the first token exists and
  every prompt's KV (``input tokens x kv_bytes_per_token`` of the prefill curve) moves over
  the pool's KV path: the transfers out of one prefill instance hold its bandwidth one
  after the other, first come first served (``bytes / bandwidth`` each), and each arrives
  ``latency_us`` after its last byte left. When it has arrived, the least loaded decode instance queues the request
  and admits it at its next step start as above; the first token reaches the client then
  (SGLang and Dynamo stream the whole output from the decode instance), so **TTFT** runs
  from arrival to that admission and includes the prefill queue, the forward, the transfer
  and the wait for a decode slot.
- **TTFT** (aggregated): arrival to the end of the step that ran the last prompt chunk.
  **TPOT**: ``(finish - first token) / (output tokens - 1)`` (requests of one output token
  have none and are left out of its percentiles, and meet any TPOT target).

Statistics cover the requests after the first ``warmup_requests``; the measured window
runs from the last warm-up arrival (0 without warm-up) to the last arrival (or to the time
limit), so the offered rate is measured requests over that window, goodput is those within
both SLOs over it, and throughput is the output tokens the instances produced inside it (a
short run is not diluted by the drain after the last arrival).

Pure: no I/O.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policies.cost import usd_per_million_tokens
from policies.errors import InputError
from policies.serving.plan import InstanceGroup, KvPath, ServingPlan, check_plan
from policies.serving.traffic import Slo, Traffic, check_slo, check_traffic

MAX_SIM_REQUESTS = 10_000_000
"""Most requests one simulation runs."""

_ARRIVAL, _STEP_END, _KV_READY = 0, 1, 2


@dataclass(frozen=True)
class SimOptions:
    """How long and how the simulation runs.

    Attributes:
        requests: requests to simulate (warm-up included).
        seed: seed of the random generator (arrivals and lengths).
        warmup_requests: the first requests, left out of the statistics.
        max_sim_s: stop at this simulated time, s (requests not finished by then count as
            missing their SLO); 0 = run until every request has finished.
    """

    requests: int = 10_000
    seed: int = 0
    warmup_requests: int = 0
    max_sim_s: float = 0.0


@dataclass(frozen=True)
class Percentiles:
    """Percentiles of one latency over the measured requests, ms (linear interpolation
    between order statistics; all 0 when there are none).

    Attributes:
        p50: median, ms.
        p90: 90th percentile, ms.
        p99: 99th percentile, ms.
        mean: mean, ms.
    """

    p50: float
    p90: float
    p99: float
    mean: float


@dataclass(frozen=True)
class RequestRecord:
    """One simulated request (times in simulated us from the start; -1 when it did not
    happen before the end of the simulation).

    Attributes:
        pool: index of the pool the router sent it to.
        arrival_us: arrival at the router.
        admitted_us: start of its prefill (aggregated: admission to a batch; P/D: the
            start of its prefill forward).
        first_token_us: its first token reached the client.
        finish_us: its last token.
        input_tokens: prompt length, tokens.
        output_tokens: output length, tokens.
    """

    pool: int
    arrival_us: float
    admitted_us: float
    first_token_us: float
    finish_us: float
    input_tokens: int
    output_tokens: int

    @property
    def ttft_ms(self) -> float:
        """Time to first token, ms (inf when it never came)."""
        return (
            (self.first_token_us - self.arrival_us) / 1e3 if self.first_token_us >= 0 else math.inf
        )

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first, ms (0 for one output token; inf
        when unfinished)."""
        if self.finish_us < 0:
            return math.inf
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_us - self.first_token_us) / 1e3 / (self.output_tokens - 1)


@dataclass(frozen=True)
class GroupReport:
    """How one instance group of a pool was used.

    Attributes:
        role: ``aggregated``, ``prefill`` or ``decode``.
        instances: instances in the group.
        utilisation: mean over its instances of the fraction of the simulated time spent
            in steps (0..1).
        mean_running: time-weighted mean of the sequences admitted and not finished, per
            instance, over the simulated time (prefill: prompts in the forward).
        mean_wait_ms: mean wait of a request from reaching the group's queue to its
            admission (aggregated, decode) or its forward's start (prefill), ms.
        max_queue: most requests waiting at one instance at once.
        steps: steps (forwards) run by all its instances.
    """

    role: str
    instances: int
    utilisation: float
    mean_running: float
    mean_wait_ms: float
    max_queue: int
    steps: int


@dataclass(frozen=True)
class PoolReport:
    """One pool's part of a simulation.

    Attributes:
        name: pool name.
        requests: measured requests the router sent it.
        attainment: fraction of them within both SLOs.
        ttft_p90_ms: their 90th-percentile TTFT, ms.
        tpot_p90_ms: their 90th-percentile TPOT, ms.
        usd_per_hour: price of its instances, USD per hour.
        kv_link_utilisation: prefill/decode: mean over its prefill instances of the
            fraction of the simulated time their KV path was sending (0..1); 0 aggregated.
        groups: its instance groups (aggregated, or prefill then decode).
    """

    name: str
    requests: int
    attainment: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    usd_per_hour: float
    kv_link_utilisation: float
    groups: tuple[GroupReport, ...]


@dataclass(frozen=True)
class SimReport:
    """What a simulation measured (over the measured requests: warm-up left out).

    Attributes:
        requests: measured requests.
        completed: of them, finished before the end of the simulation.
        met: of them, within both SLOs.
        window_s: measured window (last warm-up arrival to last arrival), s.
        duration_s: simulated time at the end, s.
        offered_rps: measured requests over the window, requests per second.
        ttft_ms: time to first token of the requests that got one, ms.
        tpot_ms: time per output token after the first, of the finished requests with more
            than one output token, ms.
        attainment: ``met / requests`` (0..1).
        slo_met: whether ``attainment`` reaches the SLO's percentile.
        goodput_rps: requests within both SLOs per second of the window.
        goodput_tokens_per_s: their output tokens per second of the window.
        throughput_rps: requests (any, warm-up included) that finished inside the window, per
            second of it.
        throughput_tokens_per_s: output tokens the instances produced inside the window, per
            second of it (in overload: what the plan can serve).
        usd_per_hour: price of every instance of the plan, USD per hour.
        usd_per_million_tokens: USD per million output tokens served
            (``usd_per_hour / 3600 / throughput_tokens_per_s * 1e6``; inf with no tokens).
        usd_per_million_good_tokens: the same per million output tokens within the SLOs.
        pools: per pool.
        records: every request, warm-up included, in arrival order.
    """

    requests: int
    completed: int
    met: int
    window_s: float
    duration_s: float
    offered_rps: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    attainment: float
    slo_met: bool
    goodput_rps: float
    goodput_tokens_per_s: float
    throughput_rps: float
    throughput_tokens_per_s: float
    usd_per_hour: float
    usd_per_million_tokens: float
    usd_per_million_good_tokens: float
    pools: tuple[PoolReport, ...]
    records: tuple[RequestRecord, ...]


# ---------------------------------------------------------------------- the engine


class _Requests:
    """Per-request columns (lists indexed by request id)."""

    __slots__ = ("admitted", "arrival", "finish", "first", "inp", "out", "pool")

    def __init__(self) -> None:
        self.arrival: list[float] = []
        self.admitted: list[float] = []
        self.first: list[float] = []
        self.finish: list[float] = []
        self.inp: list[int] = []
        self.out: list[int] = []
        self.pool: list[int] = []


class _Instance:
    """One engine instance: its queue, its running sequences and its counters."""

    __slots__ = (
        "busy",
        "busy_us",
        "capacity",
        "chunk",
        "ctx_sum",
        "curve",
        "finish_at",
        "group",
        "index",
        "link_busy_us",
        "link_free",
        "max_queue",
        "n_dec",
        "prefill_tokens",
        "prefilling",
        "queued_at",
        "reserved",
        "running",
        "running_us",
        "slots",
        "step",
        "step_dec",
        "step_done",
        "step_start",
        "steps",
        "wait_us",
        "waited",
        "waiting",
    )

    def __init__(self, group: InstanceGroup, gid: int, index: int) -> None:
        self.group = gid
        self.index = index
        self.link_free = 0.0  # prefill role: when its KV path is free, us
        self.link_busy_us = 0.0
        self.curve = group.curve
        self.slots = group.slots()
        self.chunk = group.chunk_tokens
        self.capacity = group.curve.capacity_tokens()
        self.waiting: deque[int] = deque()
        self.queued_at: dict[int, float] = {}
        self.prefilling: deque[list[int]] = deque()  # [request, prompt tokens left]
        self.prefill_tokens = 0  # prefill role: prompt tokens waiting or in the forward
        self.finish_at: dict[int, list[int]] = {}
        self.n_dec = 0
        self.ctx_sum = 0
        self.reserved = 0
        self.running = 0
        self.step = -1
        self.steps = 0
        self.busy = False
        self.busy_us = 0.0
        self.running_us = 0.0
        self.step_start = 0.0
        self.step_dec = 0
        self.step_done: list[int] = []
        self.max_queue = 0
        self.wait_us = 0.0
        self.waited = 0

    def load(self) -> int:
        return len(self.waiting) + self.running

    def enqueue(self, rid: int, now: float) -> None:
        self.waiting.append(rid)
        self.queued_at[rid] = now
        if len(self.waiting) > self.max_queue:
            self.max_queue = len(self.waiting)


class _Sim:
    """One run of :func:`simulate` (mutable state kept off the public types)."""

    def __init__(
        self, plan: ServingPlan, traffic: Traffic, slo: Slo | None, options: SimOptions
    ) -> None:
        self.plan = plan
        self.traffic = traffic
        self.slo = slo if slo is not None else Slo(ttft_ms=0.0, tpot_ms=0.0, percentile=100.0)
        self.options = options
        self.rng = random.Random(options.seed)
        self.input_len = traffic.input_len.sampler(self.rng)
        self.output_len = traffic.output_len.sampler(self.rng)
        self.req = _Requests()
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.horizon_us = options.max_sim_s * 1e6 if options.max_sim_s > 0 else math.inf
        # groups[g] = (pool index, role, instances); pool_groups[p] = group indexes
        self.groups: list[tuple[int, str, list[_Instance]]] = []
        self.pool_groups: list[tuple[int, ...]] = []
        self.kv_paths: list[KvPath | None] = []
        for p, pool in enumerate(plan.pools):
            ids = []
            roles = (
                (("aggregated", pool.instances),)
                if pool.instances is not None
                else (("prefill", pool.prefill), ("decode", pool.decode))
            )
            for role, group in roles:
                assert group is not None
                gid = len(self.groups)
                insts = [_Instance(group, gid, k) for k in range(group.count)]
                self.groups.append((p, role, insts))
                ids.append(gid)
            self.pool_groups.append(tuple(ids))
            self.kv_paths.append(pool.kv_path)
        self.weights = [p.share for p in plan.pools]
        self.current = [0.0] * len(plan.pools)
        self.now = 0.0
        # the measured window (last warm-up arrival to last arrival) and the output tokens
        # produced in it, us and tokens
        self.win_start = 0.0 if options.warmup_requests == 0 else math.inf
        self.win_end = math.inf
        self.window_tokens = 0

    # -------------------------------------------------------------- events

    def push(self, t: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def run(self) -> None:
        self.push(self.traffic.gap_s(self.rng) * 1e6, _ARRIVAL, 0, 0)
        instances = [g[2] for g in self.groups]
        while self.events:
            t, _, kind, a, b = heapq.heappop(self.events)
            if t > self.horizon_us:
                break
            self.now = t
            if kind == _ARRIVAL:
                self.arrive(a)
            elif kind == _STEP_END:
                inst = instances[a][b]
                if self.groups[a][1] == "prefill":
                    self.end_forward(inst, a)
                else:
                    self.end_step(inst)
            else:
                self.kv_ready(a, b)

    def arrive(self, rid: int) -> None:
        r = self.req
        r.arrival.append(self.now)
        r.inp.append(self.input_len())
        r.out.append(self.output_len())
        r.admitted.append(-1.0)
        r.first.append(-1.0)
        r.finish.append(-1.0)
        p = self.route()
        r.pool.append(p)
        if rid + 1 == self.options.warmup_requests:
            self.win_start = self.now
        if rid + 1 == self.options.requests:
            self.win_end = self.now
        if rid + 1 < self.options.requests:
            self.push(self.now + self.traffic.gap_s(self.rng) * 1e6, _ARRIVAL, rid + 1, 0)
        gid = self.pool_groups[p][0]
        role = self.groups[gid][1]
        group = self.groups[gid][2]
        if role == "prefill":
            inst = min(group, key=lambda x: x.prefill_tokens)
            inst.prefill_tokens += r.inp[rid]
            inst.enqueue(rid, self.now)
            if not inst.busy:
                self.start_forward(inst, gid)
        else:
            inst = min(group, key=_Instance.load)
            inst.enqueue(rid, self.now)
            if not inst.busy:
                self.start_step(inst, gid)

    def route(self) -> int:
        """Smooth weighted round robin over the pools' shares."""
        cur, w = self.current, self.weights
        best = 0
        for k in range(len(cur)):
            cur[k] += w[k]
            if cur[k] > cur[best]:
                best = k
        cur[best] -= sum(w)
        return best

    # -------------------------------------------------------------- aggregated and decode

    def start_step(self, inst: _Instance, gid: int) -> None:
        r = self.req
        now = self.now
        decode_only = self.groups[gid][1] == "decode"
        while inst.waiting:
            rid = inst.waiting[0]
            need = r.inp[rid] + r.out[rid]
            if inst.running and (
                inst.running >= inst.slots or inst.reserved + need > inst.capacity
            ):
                break
            inst.waiting.popleft()
            inst.wait_us += now - inst.queued_at.pop(rid)
            inst.waited += 1
            inst.reserved += need
            inst.running += 1
            if decode_only:  # arrives with its KV and first token: decodes from this step
                r.first[rid] = now
                if r.out[rid] <= 1:
                    self.finish(inst, rid, r.inp[rid] + 1, joined=False)
                    continue
                self.join_decode(inst, rid, inst.step, r.inp[rid] + 1)
            else:
                r.admitted[rid] = now
                inst.prefilling.append([rid, r.inp[rid]])
        if not inst.running:
            inst.busy = False
            return
        inst.step += 1
        budget = inst.chunk
        done: list[int] = []
        prefill = 0
        for item in inst.prefilling:
            if budget <= 0:
                break
            take = min(item[1], budget)
            item[1] -= take
            budget -= take
            prefill += take
            if item[1] == 0:
                done.append(item[0])
        for _ in done:
            inst.prefilling.popleft()
        n = inst.n_dec
        dt = inst.curve.mixed_step_us(n, inst.ctx_sum / n if n else 0.0, prefill)
        inst.busy = True
        inst.steps += 1
        inst.step_start = now
        inst.step_dec = n
        inst.step_done = done
        inst.busy_us += dt
        inst.running_us += inst.running * dt
        self.push(now + dt, _STEP_END, gid, inst.index)

    def join_decode(self, inst: _Instance, rid: int, after_step: int, context: int) -> None:
        """``rid`` decodes from the step after ``after_step``, with ``context`` tokens."""
        left = self.req.out[rid] - 1
        inst.finish_at.setdefault(after_step + left, []).append(rid)
        inst.n_dec += 1
        inst.ctx_sum += context

    def finish(self, inst: _Instance, rid: int, context: int, *, joined: bool) -> None:
        r = self.req
        r.finish[rid] = self.now
        inst.reserved -= r.inp[rid] + r.out[rid]
        inst.running -= 1
        if joined:
            inst.n_dec -= 1
            inst.ctx_sum -= context

    def produced(self, tokens: int) -> None:
        """``tokens`` output tokens came out now (counted when inside the window)."""
        if self.win_start <= self.now <= self.win_end:
            self.window_tokens += tokens

    def end_step(self, inst: _Instance) -> None:
        r = self.req
        self.produced(inst.step_dec + len(inst.step_done))
        inst.ctx_sum += inst.step_dec
        for rid in inst.finish_at.pop(inst.step, ()):
            self.finish(inst, rid, r.inp[rid] + r.out[rid], joined=True)
        for rid in inst.step_done:
            r.first[rid] = self.now
            if r.out[rid] <= 1:
                self.finish(inst, rid, 0, joined=False)
            else:
                self.join_decode(inst, rid, inst.step, r.inp[rid] + 1)
        inst.step_done = []
        self.start_step(inst, inst.group)

    # -------------------------------------------------------------- prefill role

    def start_forward(self, inst: _Instance, gid: int) -> None:
        r = self.req
        if not inst.waiting:
            inst.busy = False
            return
        batch: list[int] = []
        tokens = 0
        while inst.waiting:
            rid = inst.waiting[0]
            if batch and tokens + r.inp[rid] > inst.chunk:
                break
            inst.waiting.popleft()
            inst.wait_us += self.now - inst.queued_at.pop(rid)
            inst.waited += 1
            r.admitted[rid] = self.now
            batch.append(rid)
            tokens += r.inp[rid]
        dt = inst.curve.prefill_time_us(tokens)
        inst.busy = True
        inst.steps += 1
        inst.step_done = batch
        inst.busy_us += dt
        inst.running_us += len(batch) * dt
        self.push(self.now + dt, _STEP_END, gid, inst.index)

    def end_forward(self, inst: _Instance, gid: int) -> None:
        r = self.req
        p = self.groups[gid][0]
        path = self.kv_paths[p]
        assert path is not None
        self.produced(len(inst.step_done))  # the first tokens
        for rid in inst.step_done:
            inst.prefill_tokens -= r.inp[rid]
            if r.out[rid] <= 1:  # nothing left to decode: the first token is the answer
                r.first[rid] = r.finish[rid] = self.now
                continue
            send = path.send_us(inst.curve.kv_transfer_bytes(r.inp[rid]))
            sent = max(self.now, inst.link_free) + send
            inst.link_free = sent
            inst.link_busy_us += send
            self.push(sent + path.latency_us, _KV_READY, rid, p)
        inst.step_done = []
        self.start_forward(inst, gid)

    def kv_ready(self, rid: int, p: int) -> None:
        gid = self.pool_groups[p][1]
        inst = min(self.groups[gid][2], key=_Instance.load)
        inst.enqueue(rid, self.now)
        if not inst.busy:
            self.start_step(inst, gid)

    # -------------------------------------------------------------- the report

    def report(self) -> SimReport:
        r = self.req
        o = self.options
        n = len(r.arrival)
        w = min(o.warmup_requests, n)
        start = r.arrival[w - 1] if w else 0.0
        # the last arrival; the end of the run when the time limit came first
        end = r.arrival[-1] if n == o.requests else self.now
        window_s = max(end - start, 0.0) / 1e6
        records = tuple(
            RequestRecord(
                pool=r.pool[i],
                arrival_us=r.arrival[i],
                admitted_us=r.admitted[i],
                first_token_us=r.first[i],
                finish_us=r.finish[i],
                input_tokens=r.inp[i],
                output_tokens=r.out[i],
            )
            for i in range(n)
        )
        measured = records[w:]
        done = [x for x in measured if x.finish_us >= 0]
        good = [x for x in done if self.slo.met(x.ttft_ms, x.tpot_ms)]
        ttfts = [x.ttft_ms for x in measured if x.first_token_us >= 0]
        tpots = [x.tpot_ms for x in done if x.output_tokens > 1]
        good_tokens = sum(x.output_tokens for x in good)
        usd_h = self.plan.usd_per_hour()
        attainment = len(good) / len(measured) if measured else 0.0
        thr_tokens = self.window_tokens / window_s if window_s > 0 else 0.0
        finished_in = sum(1 for x in records if start <= x.finish_us <= end)
        good_tps = good_tokens / window_s if window_s > 0 else 0.0
        return SimReport(
            requests=len(measured),
            completed=len(done),
            met=len(good),
            window_s=window_s,
            duration_s=self.now / 1e6,
            offered_rps=len(measured) / window_s if window_s > 0 else 0.0,
            ttft_ms=percentiles(ttfts),
            tpot_ms=percentiles(tpots),
            attainment=attainment,
            slo_met=bool(measured) and attainment * 100.0 >= self.slo.percentile,
            goodput_rps=len(good) / window_s if window_s > 0 else 0.0,
            goodput_tokens_per_s=good_tps,
            throughput_rps=finished_in / window_s if window_s > 0 else 0.0,
            throughput_tokens_per_s=thr_tokens,
            usd_per_hour=usd_h,
            usd_per_million_tokens=usd_per_million_tokens(usd_h, thr_tokens),
            usd_per_million_good_tokens=usd_per_million_tokens(usd_h, good_tps),
            pools=self.pool_reports(measured),
            records=records,
        )

    def pool_reports(self, measured: Sequence[RequestRecord]) -> tuple[PoolReport, ...]:
        total_us = max(self.now, 1e-9)
        out = []
        for p, pool in enumerate(self.plan.pools):
            mine = [x for x in measured if x.pool == p]
            good = sum(1 for x in mine if x.finish_us >= 0 and self.slo.met(x.ttft_ms, x.tpot_ms))
            groups = []
            link = 0.0
            for gid in self.pool_groups[p]:
                _, role, insts = self.groups[gid]
                if role == "prefill":
                    link = min(1.0, sum(i.link_busy_us for i in insts) / len(insts) / total_us)
                waited = sum(i.waited for i in insts)
                groups.append(
                    GroupReport(
                        role=role,
                        instances=len(insts),
                        utilisation=min(1.0, sum(i.busy_us for i in insts) / len(insts) / total_us),
                        mean_running=sum(i.running_us for i in insts) / len(insts) / total_us,
                        mean_wait_ms=sum(i.wait_us for i in insts) / waited / 1e3
                        if waited
                        else 0.0,
                        max_queue=max(i.max_queue for i in insts),
                        steps=sum(i.steps for i in insts),
                    )
                )
            out.append(
                PoolReport(
                    name=pool.name,
                    requests=len(mine),
                    attainment=good / len(mine) if mine else 0.0,
                    ttft_p90_ms=percentiles([x.ttft_ms for x in mine if x.first_token_us >= 0]).p90,
                    tpot_p90_ms=percentiles(
                        [x.tpot_ms for x in mine if x.finish_us >= 0 and x.output_tokens > 1]
                    ).p90,
                    usd_per_hour=pool.usd_per_hour(),
                    kv_link_utilisation=link,
                    groups=tuple(groups),
                )
            )
        return tuple(out)


def percentiles(values: Sequence[float]) -> Percentiles:
    """p50/p90/p99 and mean of ``values`` (linear interpolation between order statistics,
    as numpy's default); all 0 for none."""
    if not values:
        return Percentiles(0.0, 0.0, 0.0, 0.0)
    s = sorted(values)
    return Percentiles(
        p50=quantile_sorted(s, 0.5),
        p90=quantile_sorted(s, 0.9),
        p99=quantile_sorted(s, 0.99),
        mean=math.fsum(s) / len(s),
    )


def quantile_sorted(s: Sequence[float], q: float) -> float:
    """The ``q`` quantile (fraction) of sorted ``s``, linear between order statistics."""
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def check_options(options: SimOptions, path: str = "options") -> None:
    """Validate simulation options.

    Raises:
        InputError: naming the option.
    """
    n = options.requests
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SIM_REQUESTS:
        raise InputError(
            f"must be a whole number in [1, {MAX_SIM_REQUESTS}], got {n!r}",
            field=f"{path}.requests",
        )
    s = options.seed
    if isinstance(s, bool) or not isinstance(s, int):
        raise InputError(f"must be a whole number, got {s!r}", field=f"{path}.seed")
    w = options.warmup_requests
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < n:
        raise InputError(
            f"must be a whole number in [0, requests) = [0, {n}), got {w!r}",
            field=f"{path}.warmupRequests",
        )
    m = options.max_sim_s
    if isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m) or m < 0:
        raise InputError(
            f"must be a finite number of seconds >= 0 (0 = until all finish), got {m!r}",
            field=f"{path}.maxSimS",
        )


def simulate(
    plan: ServingPlan, traffic: Traffic, slo: Slo | None, options: SimOptions = SimOptions()
) -> SimReport:
    """Simulate ``options.requests`` requests of ``traffic`` through ``plan`` (the module
    docstring gives the semantics); deterministic for ``options.seed``. Without an SLO
    (None) every finished request counts as within it, and ``slo_met`` means all finished.

    Raises:
        InputError: an invalid plan, traffic, SLO or option (the field is named).
    """
    check_plan(plan)
    check_traffic(traffic, "traffic")
    if slo is not None:
        check_slo(slo, "slo")
    check_options(options)
    sim = _Sim(plan, traffic, slo, options)
    sim.run()
    return sim.report()


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def report_to_doc(report: SimReport) -> dict[str, Any]:
    """The JSON document of a report (``mixfleetctl serve simulate -o json``): every field
    but the per-request records; infinities (no tokens served) as null."""

    def pct(p: Percentiles) -> dict[str, float]:
        return {"p50": p.p50, "p90": p.p90, "p99": p.p99, "mean": p.mean}

    return {
        "requests": report.requests,
        "completed": report.completed,
        "met": report.met,
        "windowS": report.window_s,
        "durationS": report.duration_s,
        "offeredRequestsPerS": report.offered_rps,
        "ttftMs": pct(report.ttft_ms),
        "tpotMs": pct(report.tpot_ms),
        "attainment": report.attainment,
        "sloMet": report.slo_met,
        "goodputRequestsPerS": report.goodput_rps,
        "goodputOutputTokensPerS": report.goodput_tokens_per_s,
        "throughputRequestsPerS": report.throughput_rps,
        "throughputOutputTokensPerS": report.throughput_tokens_per_s,
        "usdPerHour": report.usd_per_hour,
        "usdPerMillionTokens": _finite_or_none(report.usd_per_million_tokens),
        "usdPerMillionGoodTokens": _finite_or_none(report.usd_per_million_good_tokens),
        "pools": [
            {
                "name": p.name,
                "requests": p.requests,
                "attainment": p.attainment,
                "ttftP90Ms": p.ttft_p90_ms,
                "tpotP90Ms": p.tpot_p90_ms,
                "usdPerHour": p.usd_per_hour,
                "kvLinkUtilisation": p.kv_link_utilisation,
                "groups": [
                    {
                        "role": g.role,
                        "instances": g.instances,
                        "utilisation": g.utilisation,
                        "meanRunning": g.mean_running,
                        "meanWaitMs": g.mean_wait_ms,
                        "maxQueue": g.max_queue,
                        "steps": g.steps,
                    }
                    for g in p.groups
                ],
            }
            for p in report.pools
        ],
    }
