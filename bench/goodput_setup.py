"""The goodput benchmark's fixed setup (:mod:`bench.goodput`): models, fleets, prompt and
output lengths, the SLO, traffic and deployment specs, and the yardstick every plan is
measured by (:func:`max_goodput`: the serving simulator's requests within the SLOs at the
arrival rate that gives the most of them, at or just below the largest rate where 90% of
requests meet the SLO, in steady state: :func:`sim_options`).

Units: requests per second, tokens, milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from policies.estimate.engines import EngineSpec
from policies.hardware.fleet import Fleet, parse_fleet
from policies.serving.plan import ServingPlan
from policies.serving.simulate import SimOptions, simulate
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.serving.traffic import request_lifetime_s as lifetime_at_slo
from policies.spec.build import DeploymentSpec, WorkloadSpec

MODELS = {"dsv3": "deepseek-v3", "qwen235b": "qwen3-235b-a22b"}
FLEETS = ("hopper-blackwell-24", "mixed-24", "mixed-64", "ada-hopper", "homog-32")
LENGTHS = {"4096-512": (4096, 512), "1024-1024": (1024, 1024)}
SLO = Slo(ttft_ms=2000.0, tpot_ms=50.0, percentile=90.0)
HUGE_DEMAND_RPS = 10_000.0
SIM = SimOptions(requests=4000, seed=1, warmup_requests=400)
"""The least a simulation of the yardstick runs (:func:`sim_options` lengthens it)."""
WINDOW_LIFETIMES = 3.0
"""The yardstick's warm-up and its measured window, each at least this many lifetimes of a
request within the SLO (:func:`request_lifetime_s`): a shorter run measures the fleet's
start, while batches fill, not its steady state."""
PEAK_STEPS = 5
"""How many rates below the largest passing one the yardstick also simulates, one
:data:`PEAK_STEP` apart, for the peak of the goodput curve (:func:`max_goodput`)."""
PEAK_STEP = 0.01
"""The spacing of those rates, a fraction of the largest passing rate."""
ROOT = Path(__file__).resolve().parent.parent


def example_fleet(name: str) -> Fleet:
    """The fleet ``examples/fleets/<name>.yaml``."""
    return parse_fleet(yaml.safe_load((ROOT / "examples" / "fleets" / f"{name}.yaml").read_text()))


def traffic(isl: int, osl: int, rps: float) -> Traffic:
    """Poisson traffic with lognormal lengths (p90 = 1.25 x mean)."""
    return Traffic(rps, LengthDist(isl, isl * 1.25), LengthDist(osl, osl * 1.25))


def spec(name: str, model: str, tr: Traffic, slo: Slo = SLO, priority: int = 0) -> DeploymentSpec:
    """A deployment of ``model`` with FP8 KV on SGLang (vLLM for Mixtral)."""
    return DeploymentSpec(
        name,
        model=model,
        workload=WorkloadSpec(kv_cache_dtype="fp8"),
        engine=EngineSpec(name="vllm" if model.startswith("mixtral") else "sglang"),
        priority=priority,
        traffic=tr,
        slo=slo,
    )


_LOWEST_POWER = -10
"""The yardstick's lowest bracket, 2^-10 requests/s (a plan failing there scores 0)."""


def request_lifetime_s(tr: Traffic) -> float:
    """How long a request within the SLO lives at most, s
    (:func:`policies.serving.traffic.request_lifetime_s` at :data:`SLO`)."""
    life = lifetime_at_slo(tr, SLO)
    if life is None:
        raise ValueError("the benchmark's SLO names both targets")
    return life


def sim_options(tr: Traffic, rate: float) -> SimOptions:
    """The yardstick's simulation at ``rate`` requests/s: a warm-up and a measured window of
    :data:`WINDOW_LIFETIMES` request lifetimes each, or :data:`SIM`'s counts where those are
    more. (4,000 requests at 200 requests/s arrive in 20 s, less than one 1,024-token output
    lives at 45 ms per token: no batch fills and no queue forms, and a plan's goodput there
    is what its instances absorb while they fill.)"""
    n = math.ceil(rate * WINDOW_LIFETIMES * request_lifetime_s(tr))
    warmup = max(SIM.warmup_requests, n)
    measured = max(SIM.requests - SIM.warmup_requests, n)
    return replace(SIM, requests=warmup + measured, warmup_requests=warmup)


def attained(plan: ServingPlan, tr: Traffic, rate: float) -> tuple[bool, float, Any]:
    """Simulate ``plan`` at ``rate`` requests/s (:func:`sim_options`): ``(>= 90% within the
    SLOs, goodput requests/s, the simulator's report)``."""
    rep = simulate(plan, replace(tr, requests_per_s=rate), SLO, sim_options(tr, rate))
    return rep.attainment >= SLO.percentile / 100.0, rep.goodput_rps, rep


def max_goodput(plan: ServingPlan | None, tr: Traffic, guess_rps: float) -> dict[str, Any]:
    """The simulated goodput yardstick: the most requests/s within the SLOs at an arrival
    rate where >= 90% of requests meet them.

    First the largest such rate, the **edge**: bracketed between two powers of two (the
    first that fails, scanning up from ``guess_rps``, and the largest below it that
    passes), then bisected 8 times; the bracket does not depend on the guess, so two plans
    that serve alike score alike whatever capacity each was planned at. Then the **peak**:
    the edge and :data:`PEAK_STEPS` rates below it, :data:`PEAK_STEP` of it apart, each
    simulated; the goodput is the most requests/s within the SLOs among those that pass.
    At the edge a plan's queues start to grow and the share within the SLOs falls steeply
    with the rate (on homog-32 DeepSeek-V3 1024/1024, from 99.5% to 91.8% within 1% of
    it), so the requests within the SLOs there depend on where the bisection stopped, not
    on the plan. The edge stays in the result (``rate_rps``, ``edge_goodput_rps``)."""
    lo, edge_good = (0.0, 0.0) if plan is None or guess_rps <= 0 else _edge(plan, tr, guess_rps)
    if plan is None or lo == 0.0:
        keys = ("rate_rps", "edge_goodput_rps", "peak_rate_rps", "goodput_rps")
        return dict.fromkeys((*keys, "goodput_tokens_per_s"), 0.0)
    peak_rate, best = lo, edge_good
    for i in range(1, PEAK_STEPS + 1):
        rate = lo * (1.0 - PEAK_STEP * i)
        ok, good, _ = attained(plan, tr, rate)
        if ok and good > best:
            peak_rate, best = rate, good
    return {
        "rate_rps": round(lo, 4),
        "edge_goodput_rps": round(edge_good, 4),
        "peak_rate_rps": round(peak_rate, 4),
        "goodput_rps": round(best, 4),
        "goodput_tokens_per_s": round(best * tr.output_len.mean, 1),
    }


def _edge(plan: ServingPlan, tr: Traffic, guess_rps: float) -> tuple[float, float]:
    """The largest rate with >= 90% of requests within the SLOs (:func:`max_goodput`), and
    the requests/s within them there; ``(0, 0)`` when not even 2^-10 requests/s passes."""
    k = math.ceil(math.log2(guess_rps))
    lo, best = 0.0, 0.0
    while True:
        ok, good, _ = attained(plan, tr, 2.0**k)
        if not ok:
            break
        lo, best, k = 2.0**k, good, k + 1
    hi = 2.0**k
    j = k - 1
    while lo == 0.0 and j >= _LOWEST_POWER:
        ok, good, _ = attained(plan, tr, 2.0**j)
        if ok:
            lo, best = 2.0**j, good
        else:
            hi, j = 2.0**j, j - 1
    if lo == 0.0:
        return 0.0, 0.0
    for _ in range(8):
        mid = (lo + hi) / 2
        ok, good, _ = attained(plan, tr, mid)
        if ok:
            lo, best = mid, good
        else:
            hi = mid
    return lo, best
