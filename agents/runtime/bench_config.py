"""What :mod:`agents.runtime.bench` measures: :class:`BenchConfig` (shapes in elements and
tokens, effort, the slowdown), the one DeepSeek-V3-shaped MoE layer it runs
(:func:`bench_model`) and its decode and prefill workloads (:func:`workloads`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agents.calibrate import (
    CalibrationOptions,
)
from policies.estimate.workload import Workload, make_workload
from policies.model.architecture import ModelSpec


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
        hidden, num_experts, top_k, expert_ffn, num_shared_experts: MoE shape (DeepSeek-V3).
        num_q_heads, num_kv_heads, head_dim: GQA attention run by the reference runtime.
        decode_tokens, prefill_tokens: tokens per GPU per step (on average).
        decode_context: KV length per decode sequence, tokens.
        prefill_seq: prefill sequence length, tokens.
        redundant_experts: extra expert slots the solvers may use.
        warmup, iters: untimed and timed steps per plan and round.
        rounds: rounds per phase; each round measures every policy's plan once.
        slowdown: ``sm_hog`` | ``gemm_load`` | ``none``.
        hog_sms: SMs of GPU 1 taken away by ``sm_hog``.
        hog_max_s: the SM hog ends by itself after this long, seconds.
        cpu: tiny CPU run (gloo) with made-up figures.
        calib: calibration options.
        inventory: node inventory (JSON form) the fleet is built from.
    """

    hidden: int = 7168
    num_experts: int = 256
    top_k: int = 8
    expert_ffn: int = 2048
    num_shared_experts: int = 1
    num_q_heads: int = 128
    num_kv_heads: int = 8
    head_dim: int = 128
    decode_tokens: int = 128
    prefill_tokens: int = 4096
    decode_context: int = 4096
    prefill_seq: int = 2048
    redundant_experts: int = 32
    warmup: int = 3
    iters: int = 8
    rounds: int = 3
    slowdown: str = "sm_hog"
    hog_sms: int = 88
    hog_max_s: float = 45.0
    cpu: bool = False
    calib: CalibrationOptions = field(default_factory=CalibrationOptions)
    inventory: Mapping[str, Any] = field(default_factory=dict)


def bench_model(c: BenchConfig) -> ModelSpec:
    """One DeepSeek-V3-shaped MoE layer with the GQA attention the runtime executes."""
    return ModelSpec(
        name="deepseek-v3-moe-layer-gqa",
        family="deepseek_v3",
        num_layers=1,
        moe_layers=(0,),
        hidden=c.hidden,
        vocab=129280,
        num_q_heads=c.num_q_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        v_head_dim=c.head_dim,
        attention="gqa",
        q_lora_rank=0,
        kv_lora_rank=0,
        qk_rope_dim=0,
        num_experts=c.num_experts,
        num_shared_experts=c.num_shared_experts,
        top_k=c.top_k,
        expert_ffn=c.expert_ffn,
        dense_ffn=c.expert_ffn,
        n_group=1,
        topk_group=1,
        weight_dtype="bf16",
        expert_dtype="bf16",
    )


def workloads(c: BenchConfig, model: ModelSpec) -> dict[str, Workload]:
    """Decode and prefill workloads, uniform expert load."""
    return {
        "decode": make_workload(
            model, phase="decode", tokens_per_gpu=c.decode_tokens, context_len=c.decode_context
        ),
        "prefill": make_workload(
            model, phase="prefill", tokens_per_gpu=c.prefill_tokens, context_len=c.prefill_seq
        ),
    }
