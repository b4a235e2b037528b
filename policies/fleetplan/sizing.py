"""What one engine instance serves within an SLO: its batch limit, its capacity in requests
per second, and the latencies it is predicted to give - read from its step curve
(:class:`policies.serving.curves.StepCurve`) and the deployment's length distributions.

The model is the serving simulator's (:mod:`policies.serving.simulate`) in steady state,
without queueing beyond one step:

**Aggregated** (continuous batching with chunked prefill). With ``B`` sequences decoding, a
request leaves every ``OSL`` steps on average, so each step also prefills ``B x ISL / OSL``
prompt tokens (at most the chunk budget ``C``) of the requests that replace them::

    t(B)     = mixed_step_us(B, ISL + OSL/2, min(C, B ISL / OSL))        (mean lengths)
    TPOT(B)  = t(B)
    TTFT(B)  = t(B) + ceil((ISL_q + P(B)) / C) * mixed_step_us(B, ., min(C, P(B) + ISL_q))
    rate(B)  = B / (OSL t(B))   [and B <= C OSL / ISL: the chunk budget limits the prompts]

(``ISL_q`` the prompt length at the SLO's percentile: the wait for the running step, then
the steps that run the prompt's chunks). The **batch limit** is the largest ``B`` with
``TPOT(B) <= tpot``, ``TTFT(B) <= ttft`` and ``B (ISL + OSL) <= KV capacity`` (the
simulator reserves prompt + output per admitted sequence); the **capacity** is
``rate(B) x utilisation`` (an instance planned at its full rate queues without bound), or
with ``queueing`` (the planner's setting) ``utilisation`` x the rate its ``B`` slots, each
held ``(ceil(ISL / C) + OSL - 1) t(B)``, take while no more than the SLO's miss share of
requests waits longer than ``ttft - TTFT(B)`` for one (:func:`queue_rate`, Erlang C).

**Prefill** (a batched forward of up to ``T`` prompt tokens): ``TTFT = 2 P(T) + KV transfer
+ one decode step`` (the running forward, its own, the transfer of ``ISL_q`` tokens' KV, the
wait for a decode slot) must meet the target with ``T >= ISL_q``; ``T`` is the budget of
the highest ``rate = T / (ISL P(T))`` among those (larger forwards amortise the fixed cost,
but past a point the attention of the prompts batched makes a token dearer: the largest
budget is not the fastest), no more than the instance's NICs move: ``bandwidth / (ISL x KV
bytes per token)``.

A deployment that states its batch (``tokensPerGpu``, decode phase) caps ``B`` of its
aggregated and decode instances at that many sequences per GPU.

**Decode**: ``TPOT(B) = decode_us(B, ISL + OSL/2) <= tpot``, ``B (ISL + OSL) <=`` KV
capacity, ``rate = B / (OSL TPOT(B))``, and no more than its NICs receive; in a pair with
``queueing``, the rate its slots take while the wait for one fits in what the TTFT target
leaves after ``2 P(T)``, the transfer and one step.

Units: microseconds (``_us``), milliseconds (``_ms``), tokens, requests per second, bytes,
GB/s (1e9 bytes per second). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from policies.fleetplan.queueing import slo_rate
from policies.serving.curves import StepCurve
from policies.serving.plan import DEFAULT_CHUNK_TOKENS
from policies.serving.traffic import LengthDist, Slo, Traffic

UTILISATION = 0.85
"""Share of an instance's capacity the planner fills: of its rate at the batch limit, or
with ``queueing`` of the rate its slots hold within the TTFT target
(:func:`policies.fleetplan.queueing.slo_rate`)."""


@dataclass(frozen=True)
class Sizing:
    """What one instance of a variant serves within the SLO.

    Attributes:
        batch_limit: most sequences it runs at once (aggregated, decode), or its prompt-token
            budget per forward (prefill), tokens.
        requests_per_s: requests per second it serves within the SLO (its capacity).
        ttft_ms: predicted TTFT at the SLO's percentile at its capacity, ms.
        tpot_ms: predicted TPOT at its capacity, ms (prefill: 0, decode sets it).
        reason: why it serves nothing within the SLO ("" when it does).
    """

    batch_limit: int
    requests_per_s: float
    ttft_ms: float
    tpot_ms: float
    reason: str = ""

    @property
    def ok(self) -> bool:
        """It serves some traffic within the SLO."""
        return self.requests_per_s > 0 and not self.reason


@dataclass(frozen=True)
class Lengths:
    """The length figures sizing uses, tokens.

    Attributes:
        isl: mean prompt length.
        osl: mean output length.
        isl_q: prompt length at the SLO's percentile.
        osl_q: output length at the SLO's percentile.
        quantiles: ``(q, prompt length at q)`` for :data:`_QUANTILES`.
    """

    isl: float
    osl: float
    isl_q: float
    osl_q: float

    @staticmethod
    def of(traffic: Traffic, slo: Slo) -> Lengths:
        """The lengths of ``traffic`` at ``slo``'s percentile."""
        q = slo.percentile / 100.0
        return Lengths(
            isl=traffic.input_len.mean,
            osl=max(1.0, traffic.output_len.mean),
            isl_q=traffic.input_len.quantile(q),
            osl_q=traffic.output_len.quantile(q),
            quantiles=tuple((x, traffic.input_len.quantile(x)) for x in _QUANTILES),
        )

    quantiles: tuple[tuple[float, float], ...] = ()

    def quantile_isl(self, q: float) -> float:
        """The prompt length at quantile ``q`` (one of :data:`_QUANTILES`), tokens."""
        return dict(self.quantiles).get(q, self.isl)

    @property
    def context(self) -> float:
        """Mean context of a decoding sequence, tokens."""
        return self.isl + self.osl / 2.0


def _limit(slo_ms: float) -> float:
    """An SLO target in us (inf when there is none)."""
    return slo_ms * 1000.0 if slo_ms > 0 else math.inf


def _largest(ok: Callable[[int], bool], hi: int) -> int:
    """The largest ``b`` in ``[1, hi]`` with ``ok(b)`` (monotone: true up to a point), or 0."""
    if hi < 1 or not ok(1):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _mem_batch(curve: StepCurve, n: Lengths) -> int:
    """Sequences whose reserved KV (prompt + output, mean lengths) fit, at most 2^20."""
    return min(1 << 20, int(curve.capacity_tokens() // max(1.0, n.isl + n.osl)))


def _capped(hi: int, cap: int | None) -> int:
    """``hi``, at most ``cap`` when one is given."""
    return hi if cap is None else min(hi, cap)


_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)
"""Prompt-length quantiles one arriving prompt's prefill cost is averaged over."""


def prefill_extra_us(curve: StepCurve, n: Lengths, arrivals: float, chunk: int) -> float:
    """Mean time a step gains from the prompts that arrive in it, us: ``k`` prompts arrive
    (Poisson with mean ``arrivals``) and are prefilled in the step, which costs
    ``mixed_step_us - decode_us`` (the forward's fixed cost once). Averaging the step over
    the arrivals, not the step of the mean arrivals: the prefill cost per token grows with
    the chunk. Tokens beyond the chunk budget run in later steps at the full chunk's cost
    per token (every prompt token is prefilled once)."""
    if arrivals <= 0:
        return 0.0
    over = min(curve.decode_step_us[0][0], curve.prefill_us[0])
    full = curve.prefill_time_us(chunk) - over

    def cost(tokens: float) -> float:
        if tokens <= chunk:
            return curve.prefill_time_us(tokens) - over
        return full * tokens / chunk

    one = sum(cost(n.quantile_isl(q)) for q in _QUANTILES) / len(_QUANTILES)
    total = 0.0
    p = math.exp(-arrivals)
    for k in range(1, 256):
        p *= arrivals / k
        total += p * (one if k == 1 else cost(k * n.isl))
        if p < 1e-12 and k > arrivals:
            break
    return total


def aggregated_step_us(curve: StepCurve, n: Lengths, batch: float, chunk: int) -> float:
    """Mean step time of an aggregated instance decoding ``batch`` sequences, us: the
    decode step plus the prefill of the ``batch / OSL`` prompts arriving per step."""
    return curve.decode_us(batch, n.context) + prefill_extra_us(curve, n, batch / n.osl, chunk)


def aggregated_ttft_us(curve: StepCurve, n: Lengths, batch: float, chunk: int) -> float:
    """Queueing-free TTFT of an aggregated instance at ``batch``, at the percentile, us:
    the running step, then the step(s) that run the prompt's chunks."""
    steps = math.ceil(n.isl_q / chunk)
    own = curve.mixed_step_us(batch, n.context, min(float(chunk), n.isl_q))
    return aggregated_step_us(curve, n, batch, chunk) + steps * own


def size_aggregated(
    curve: StepCurve,
    traffic: Traffic,
    slo: Slo,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    utilisation: float = UTILISATION,
    queueing: bool = False,
    batch_cap: int | None = None,
) -> Sizing:
    """Batch limit and capacity of one aggregated instance (see the module docstring);
    with ``queueing`` the capacity is ``utilisation`` of the rate its ``B`` slots hold
    while the wait for one keeps the TTFT target (:func:`queue_rate`), not of ``rate(B)``;
    ``batch_cap`` (a stated batch) bounds ``B`` too."""
    n = Lengths.of(traffic, slo)
    tpot, ttft = _limit(slo.tpot_ms), _limit(slo.ttft_ms)
    hi = min(_mem_batch(curve, n), int(chunk_tokens * n.osl / max(1.0, n.isl)) or 1)
    hi = _capped(hi, batch_cap)
    if hi < 1:
        return Sizing(0, 0.0, 0.0, 0.0, "one request's KV does not fit in the instance")

    def ok(b: int) -> bool:
        return (
            aggregated_step_us(curve, n, b, chunk_tokens) <= tpot
            and aggregated_ttft_us(curve, n, b, chunk_tokens) <= ttft
        )

    b = _largest(ok, hi)
    t1 = aggregated_step_us(curve, n, 1, chunk_tokens)
    if b == 0:
        return Sizing(
            0,
            0.0,
            aggregated_ttft_us(curve, n, 1, chunk_tokens) / 1e3,
            t1 / 1e3,
            f"even one sequence misses the SLO (TPOT {t1 / 1e3:.1f} ms, TTFT "
            f"{aggregated_ttft_us(curve, n, 1, chunk_tokens) / 1e3:.0f} ms)",
        )
    t = aggregated_step_us(curve, n, b, chunk_tokens)
    ttft0 = aggregated_ttft_us(curve, n, b, chunk_tokens)
    rate = b / (n.osl * t * 1e-6)
    if queueing:
        # A slot is held from admission: the prompt's chunks, then one step per token.
        steps = math.ceil(n.isl / chunk_tokens) + n.osl - 1.0
        rate = queue_rate(b, steps * t * 1e-6, ttft - ttft0, traffic, slo)
    return Sizing(b, rate * utilisation, ttft0 / 1e3, t / 1e3)


def queue_rate(
    slots: int,
    hold_s: float,
    slack_us: float,
    traffic: Traffic,
    slo: Slo,
    *,
    prompts: bool = False,
) -> float:
    """Requests/s ``slots`` slots held ``hold_s`` s each take while at most the share of
    requests the SLO's percentile lets miss wait longer than ``slack_us`` (what the TTFT
    target leaves after the queueing-free TTFT) for a slot: Erlang C
    (:func:`policies.fleetplan.queueing.slo_rate`) with the variation of the output
    lengths (with ``prompts``, of the prompt lengths: one prefill server holding each
    prompt for its share of a forward) and of the gaps between arrivals
    (:attr:`Traffic.gap_cv2`). Without a TTFT target, the rate at which every slot is
    busy."""
    if math.isinf(slack_us):
        return slots / hold_s
    miss = 1.0 - slo.percentile / 100.0
    held = traffic.input_len if prompts else traffic.output_len
    return slo_rate(slots, hold_s, slack_us * 1e-6, miss, _cv2(held), traffic.gap_cv2)


def _cv2(dist: LengthDist) -> float:
    """Squared coefficient of variation of a length distribution (its histogram, or the
    lognormal of its mean and p90)."""
    if dist.histogram:
        total = sum(w for _, w in dist.histogram)
        mean = sum(x * w for x, w in dist.histogram) / total
        var = sum(w * (x - mean) ** 2 for x, w in dist.histogram) / total
        return var / (mean * mean) if mean > 0 else 0.0
    _, sigma = dist.lognormal()
    return math.expm1(sigma * sigma)


def decode_capacity(
    curve: StepCurve,
    traffic: Traffic,
    slo: Slo,
    *,
    utilisation: float = UTILISATION,
    batch_cap: int | None = None,
) -> Sizing:
    """Batch limit and capacity of one decode instance (KV arrives from a prefill pool;
    the NIC limit is applied by :func:`size_pair`). ``ttft_ms`` is one decode step (the
    wait for a slot); ``batch_cap`` (a stated batch) bounds the batch too."""
    n = Lengths.of(traffic, slo)
    tpot = _limit(slo.tpot_ms)
    hi = _capped(_mem_batch(curve, n), batch_cap)
    b = _largest(lambda b: curve.decode_us(b, n.context) <= tpot, hi)
    t1 = curve.decode_us(1, n.context)
    if hi < 1:
        return Sizing(0, 0.0, 0.0, 0.0, "one request's KV does not fit in the instance")
    if b == 0:
        return Sizing(0, 0.0, t1 / 1e3, t1 / 1e3, f"one decode step takes {t1 / 1e3:.1f} ms")
    t = curve.decode_us(b, n.context)
    return Sizing(b, b / (n.osl * t * 1e-6) * utilisation, t / 1e3, t / 1e3)


@dataclass(frozen=True)
class PairSizing:
    """A prefill variant feeding a decode variant.

    Attributes:
        prefill: the prefill instance's sizing (``batch_limit`` = its prompt-token budget).
        decode: the decode instance's sizing.
        kv_transfer_ms: moving one prompt's KV (at the percentile length), ms.
    """

    prefill: Sizing
    decode: Sizing
    kv_transfer_ms: float


def size_pair(
    prefill: StepCurve,
    decode: StepCurve,
    traffic: Traffic,
    slo: Slo,
    *,
    kv_gbytes_per_s: float,
    kv_latency_us: float,
    prefill_nic_gbytes_per_s: float,
    decode_nic_gbytes_per_s: float,
    utilisation: float = UTILISATION,
    queueing: bool = False,
    decode_batch_cap: int | None = None,
) -> PairSizing:
    """Sizing of a prefill/decode pair over a KV path of ``kv_gbytes_per_s`` (one transfer's
    bandwidth) whose instances have NICs of ``*_nic_gbytes_per_s`` in all (see the module
    docstring); with ``queueing`` the decode side's capacity is ``utilisation`` of what its
    slots hold while the wait for one fits in the TTFT the prefill leaves
    (:func:`queue_rate`); ``decode_batch_cap`` bounds the decode side's batch."""
    n = Lengths.of(traffic, slo)
    d = decode_capacity(decode, traffic, slo, utilisation=utilisation, batch_cap=decode_batch_cap)
    kv_bytes = prefill.kv_bytes_per_token * n.isl
    kv_us = kv_latency_us + prefill.kv_bytes_per_token * n.isl_q / (kv_gbytes_per_s * 1e3)
    if d.ok:
        # The decode side also receives every prompt's KV through its NICs.
        nic = decode_nic_gbytes_per_s * 1e9 / kv_bytes * utilisation
        d = Sizing(d.batch_limit, min(d.requests_per_s, nic), d.ttft_ms, d.tpot_ms)
    ttft = _limit(slo.ttft_ms) - kv_us - d.ttft_ms * 1e3
    lo_t = max(1, math.ceil(n.isl_q))
    top = max(lo_t, prefill.prefill_grid[-1])

    def ok(t: int) -> bool:
        return 2.0 * prefill.prefill_time_us(t) <= ttft

    budget = 0
    if ok(lo_t):
        # Budgets from ISL_q up, on a geometric ladder; the one of the highest rate. A
        # larger forward amortises the fixed cost but its attention grows with the prompts
        # batched, so past a point a token costs more (the rate is not monotone).
        budget = lo_t
        best = lo_t / prefill.prefill_time_us(lo_t)
        t = lo_t
        while t < top:
            t = min(top, int(t * 1.25) + 1)
            if not ok(t):
                break
            if t / prefill.prefill_time_us(t) > best * (1.0 + 1e-9):
                budget, best = t, t / prefill.prefill_time_us(t)
    if budget == 0:
        p = prefill.prefill_time_us(lo_t)
        why = (
            f"a {lo_t}-token prompt's prefill ({p / 1e3:.0f} ms, twice with the running "
            f"forward) and KV transfer ({kv_us / 1e3:.0f} ms) exceed the TTFT target"
        )
        return PairSizing(Sizing(0, 0.0, (2 * p + kv_us) / 1e3, 0.0, why), d, kv_us / 1e3)
    p = prefill.prefill_time_us(budget)
    if queueing and d.ok:
        hold_s = n.osl * d.tpot_ms * 1e-3
        held = queue_rate(d.batch_limit, hold_s, ttft - 2.0 * p, traffic, slo)
        d = replace(d, requests_per_s=min(d.requests_per_s, held * utilisation))
    rate = budget / (n.isl * p * 1e-6)
    if queueing:
        # The prompts ahead: one server working through prompt tokens, a prompt's share of
        # a forward each. Its own forward also takes the first budget - ISL_q tokens of
        # them, so only the work beyond waits longer than what TTFT leaves after 2 P(T).
        ahead_us = ttft - 2.0 * p + p * max(0.0, budget - n.isl_q) / budget
        rate = min(rate, queue_rate(1, 1.0 / rate, ahead_us, traffic, slo, prompts=True))
    nic = prefill_nic_gbytes_per_s * 1e9 / kv_bytes
    sized = Sizing(
        budget,
        min(rate, nic) * utilisation,
        (2 * p + kv_us) / 1e3 + d.ttft_ms,
        0.0,
    )
    return PairSizing(sized, d, kv_us / 1e3)
