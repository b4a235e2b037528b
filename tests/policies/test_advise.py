"""Batch sizing and long-context advice: invariants checked against fresh solves."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import fleet, fleet_doc, tiny_model

from policies.advice.advise import (
    advise_batch,
    advise_context,
    equal_split_start,
    plan_context_capacity,
    solve_batch,
)
from policies.deployment import Deployment, engine_redundancy, try_solve
from policies.errors import InputError
from policies.estimate.costmodel import build_cost_table
from policies.hardware.fleet import Fleet, parse_fleet
from policies.model.architecture import ModelSpec, from_hf_config
from policies.request import SolverOptions

OPTIONS = SolverOptions(time_limit_s=5.0, workers=1)


def gqa_model() -> ModelSpec:
    """A Qwen3-shaped MoE whose memory is mostly KV cache (16 KiB per token)."""
    return from_hf_config(
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 4,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "intermediate_size": 2048,
            "vocab_size": 32000,
            "torch_dtype": "bfloat16",
        },
        name="tiny-gqa",
    )


def same_speed_more_memory() -> Fleet:
    """Two H100 nodes; the second one's GPUs have twice the memory and the same speed."""
    doc = fleet_doc([("small", "H100-SXM5-80GB", 2, 900.0), ("big", "H100-SXM5-80GB", 2, 900.0)])
    doc["spec"]["nodes"][1]["gpus"] = [
        {"model": "H100-BIG", "base": "H100-SXM5-80GB", "memory_gib": 160, "count": 2}
    ]
    return parse_fleet(doc)


def deployment(policy: str = "ilp", **kw: object) -> Deployment:
    dep = Deployment(same_speed_more_memory(), gqa_model(), policy=policy, options=OPTIONS)
    return replace(dep, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- helpers


def test_engine_redundancy_is_the_smallest_divisible_budget() -> None:
    assert engine_redundancy(8, 4) == 0
    assert engine_redundancy(8, 3) == 1
    assert engine_redundancy(128, 24, at_least=32) == 40
    assert engine_redundancy(8, 16) == 8  # one slot per GPU
    assert engine_redundancy(0, 5) == 0
    with pytest.raises(InputError, match="To fix"):
        engine_redundancy(8, 2, at_least=100)


# --------------------------------------------------------------------- batch sizing


def test_start_is_what_fits_the_smallest_gpu_at_an_equal_split() -> None:
    dep = deployment()
    start, gpu = equal_split_start(dep)
    assert gpu.startswith("small/")
    table = build_cost_table(dep.fleet, dep.model, dep.workload(start), dep.settings)
    slots = (dep.model.num_experts + dep.redundancy_for(4)) // 4
    i = table.gpu_ids.index(gpu)
    c = table.gpus[i]

    def need(t: int) -> float:
        return (
            c.fixed_bytes
            + slots * table.num_moe_layers * table.expert_bytes
            + t * table.context_len * table.kv_bytes_per_token
            + t * table.act_bytes_per_token
        )

    assert need(start) <= c.usable_bytes < need(start + 1)


def test_largest_batch_fits_memory_and_the_planner_goes_past_the_equal_split() -> None:
    advice = advise_batch(deployment(policy="greedy"))
    assert advice.limit == "memory"
    assert advice.largest_tokens_per_gpu is not None and advice.best is not None
    assert advice.best.fits_memory
    # the big GPUs take more tokens than an engine's equal split would allow
    assert advice.largest_tokens_per_gpu > advice.start_tokens_per_gpu
    assert advice.best.max_gpu_tokens > advice.largest_tokens_per_gpu
    # within the search tolerance, one more step does not fit
    worse = [p for p in advice.points if p.tokens_per_gpu > advice.largest_tokens_per_gpu]
    assert worse and not worse[0].fits_memory
    assert worse[0].tokens_per_gpu <= advice.largest_tokens_per_gpu * 1.02 + 1


def test_target_caps_the_batch_and_the_next_batch_misses_it() -> None:
    target_ms = 1.0
    advice = advise_batch(deployment(policy="greedy"), target_ms)
    assert advice.limit == "target" and advice.target_name == "TPOT"
    assert advice.best is not None and advice.best.step_time_us is not None
    assert advice.best.step_time_us <= target_ms * 1e3
    nxt = solve_batch(deployment(policy="greedy"), advice.best.tokens_per_gpu + 1, target_ms)
    assert not nxt.meets_target and "TPOT target" in nxt.reason
    # the curve: ascending batches, step time and throughput grow with the batch
    ts = [p.tokens_per_gpu for p in advice.points]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)
    fitting = [p for p in advice.points if p.step_time_us is not None]
    steps = [p.step_time_us or 0.0 for p in fitting]
    assert steps == sorted(steps)
    good = [p.tokens_per_s for p in fitting if p.ok]
    assert good == sorted(good)


def test_prefill_target_is_ttft() -> None:
    dep = deployment(policy="greedy", phase="prefill", context_len=4096)
    advice = advise_batch(dep, 20.0)
    assert advice.target_name == "TTFT"
    assert advice.best is not None and (advice.best.step_time_us or 0) <= 20e3


def test_unreachable_target_says_how_to_fix_it() -> None:
    advice = advise_batch(deployment(policy="greedy"), 0.001)
    assert advice.largest_tokens_per_gpu is None and advice.limit == "none"
    assert advice.points[0].tokens_per_gpu == 1
    assert "To fix" in advice.infeasible[0] and "TPOT" in advice.infeasible[0]


def test_batch_that_never_fits_says_how_to_fix_it() -> None:
    dep = Deployment(fleet([("l", "L4", 1, None)]), gqa_model(), context_len=4_000_000)
    advice = advise_batch(dep)
    assert advice.largest_tokens_per_gpu is None
    assert "do not fit" in advice.infeasible[0] and "To fix" in advice.infeasible[0]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"target_ms": 0.0}, "target"),
        ({"target_ms": float("nan")}, "target"),
        ({"growth": 1.0}, "growth"),
        ({"tolerance": 0.0}, "tolerance"),
    ],
)
def test_bad_batch_options(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InputError) as err:
        advise_batch(deployment(policy="greedy"), **kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


# --------------------------------------------------------------------- long context

CONTEXTS = (16_384, 32_768, 65_536, 98_304, 131_072)


def test_ilp_moves_attention_to_gpus_with_memory_to_spare() -> None:
    advice = advise_context(deployment(), 64, contexts=CONTEXTS, policies=("uniform", "ilp"))
    uniform, ilp = advice.policies
    short, long_ = ilp.at(16_384), ilp.at(98_304)
    assert short is not None and long_ is not None and long_.ok
    small_s, big_s = short.shares
    small_l, big_l = long_.shares
    # same speed: equal shares while memory is loose ...
    assert small_s.attention_share_each == pytest.approx(big_s.attention_share_each, abs=0.01)
    # ... and the big-memory GPUs take the excess once KV binds
    assert big_l.attention_share_each > big_s.attention_share_each + 0.03
    assert small_l.attention_share_each < small_s.attention_share_each - 0.03
    assert small_l.kv_gib_each == pytest.approx(small_l.free_gib_each, rel=0.01)  # full
    # the uniform plan cannot hold that context: its small GPUs run out first
    u = uniform.at(98_304)
    assert u is not None and not u.ok and "small/" in u.reason
    assert uniform.binding_gpu.startswith("small/")
    assert ilp.longest_context is not None and uniform.longest_context is not None
    assert ilp.longest_context > 1.3 * uniform.longest_context


def test_longest_context_matches_the_kv_capacity_of_the_binding_gpu() -> None:
    # uniform keeps its shares at every context, so the bisection must land within one
    # granularity step below the plan's analytic KV limit
    advice = advise_context(deployment(), 64, contexts=CONTEXTS, policies=("uniform",))
    (rep,) = advice.policies
    first = rep.points[0]
    assert first.max_context_at_shares is not None and rep.longest_context is not None
    assert first.max_context_at_shares - 1024 < rep.longest_context <= first.max_context_at_shares
    out = try_solve(deployment(policy="uniform").request(64, context_len=rep.longest_context))
    assert out.ok and out.result is not None
    cap, gpu, _ = plan_context_capacity(out.result.plan)
    assert cap is not None and cap >= rep.longest_context and gpu == rep.binding_gpu


def test_context_report_on_a_deepseek_shaped_model_uses_few_bytes_per_token() -> None:
    # MLA keeps a compressed latent: the same fleet holds far longer contexts
    dep = Deployment(same_speed_more_memory(), tiny_model(), options=OPTIONS)
    advice = advise_context(dep, 8, contexts=(131_072,), policies=("greedy",), refine=False)
    assert advice.policies[0].points[0].ok


def test_bad_context_options() -> None:
    with pytest.raises(InputError):
        advise_context(deployment(), 8, contexts=())
    with pytest.raises(InputError):
        advise_context(deployment(), 8, policies=("magic",))
    with pytest.raises(InputError):
        advise_context(deployment(), 0)
