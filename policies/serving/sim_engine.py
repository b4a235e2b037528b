"""The serving simulator's engine: the event loop, the instances' queues and steps, and
the report built from them. The semantics (router, aggregated and prefill/decode
instances, TTFT, TPOT, the measured window) are written out in
:mod:`policies.serving.simulate`, whose :func:`~policies.serving.simulate.simulate` checks
its inputs and runs a :class:`Simulation`.

Pure: no I/O.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence

from policies.advice.cost import usd_per_million_tokens
from policies.serving.plan import InstanceGroup, KvPath, ServingPlan
from policies.serving.sim_types import (
    GroupReport,
    PoolReport,
    RequestRecord,
    SimOptions,
    SimReport,
    percentiles,
)
from policies.serving.traffic import Slo, Traffic

_ARRIVAL, _STEP_END, _KV_READY = 0, 1, 2


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


class Simulation:
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
