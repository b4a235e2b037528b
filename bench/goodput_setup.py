"""The goodput benchmark's fixed setup (:mod:`bench.goodput`): models, fleets, prompt and
output lengths, the SLO, traffic and deployment specs, and the yardstick every plan is
measured by (:func:`max_goodput`: the serving simulator's goodput at the largest rate where
90% of requests meet the SLO).

Units: requests per second, tokens, milliseconds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from policies.engines import EngineSpec
from policies.fleet import Fleet, parse_fleet
from policies.serving.plan import ServingPlan
from policies.serving.simulate import SimOptions, simulate
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec import DeploymentSpec, WorkloadSpec

MODELS = {"dsv3": "deepseek-v3", "qwen235b": "qwen3-235b-a22b"}
FLEETS = ("hopper-blackwell-24", "mixed-24", "mixed-64", "ada-hopper", "homog-32")
LENGTHS = {"4096-512": (4096, 512), "1024-1024": (1024, 1024)}
SLO = Slo(ttft_ms=2000.0, tpot_ms=50.0, percentile=90.0)
HUGE_DEMAND_RPS = 10_000.0
SIM = SimOptions(requests=4000, seed=1, warmup_requests=400)
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


def attained(plan: ServingPlan, tr: Traffic, rate: float) -> tuple[bool, float, Any]:
    """Simulate ``plan`` at ``rate`` requests/s: ``(>= 90% within the SLOs, goodput requests/s,
    the simulator's report)``."""
    rep = simulate(plan, replace(tr, requests_per_s=rate), SLO, SIM)
    return rep.attainment >= SLO.percentile / 100.0, rep.goodput_rps, rep


def max_goodput(plan: ServingPlan | None, tr: Traffic, guess_rps: float) -> dict[str, Any]:
    """The simulated goodput yardstick: the largest rate with >= 90% of requests within the
    SLOs (bisection from ``guess_rps``), and the goodput there."""
    if plan is None or guess_rps <= 0:
        return {"rate_rps": 0.0, "goodput_rps": 0.0, "goodput_tokens_per_s": 0.0}
    lo, hi = 0.0, guess_rps * 1.5
    ok, good, _ = attained(plan, tr, hi)
    while ok:
        lo, hi = hi, hi * 1.5
        ok, good, _ = attained(plan, tr, hi)
    best = 0.0
    for _ in range(8):
        mid = (lo + hi) / 2
        ok, good, _ = attained(plan, tr, mid)
        if ok:
            lo, best = mid, good
        else:
            hi = mid
    if best == 0.0 and lo > 0:
        _, best, _ = attained(plan, tr, lo)
    return {
        "rate_rps": round(lo, 4),
        "goodput_rps": round(best, 4),
        "goodput_tokens_per_s": round(best * tr.output_len.mean, 1),
    }
