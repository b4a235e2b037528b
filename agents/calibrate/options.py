"""What a calibration measures and how hard it tries: :class:`CalibrationOptions` (shapes in
elements and tokens, repetitions), the default sweeps of token counts, and the one-layer
model the runtime profile runs (:func:`profile_model`)."""

from __future__ import annotations

from dataclasses import dataclass

from policies.model.architecture import ModelSpec

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_ROWS_PER_EXPERT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_A2A_TOKENS = (1, 16, 128, 1024, 4096, 16384)
DEFAULT_SWEEP_POINTS = (
    ("decode", 1, 4096),
    ("decode", 4, 16384),
    ("decode", 16, 1024),
    ("decode", 64, 16384),
    ("decode", 256, 1024),
    ("prefill", 2048, 2048),
    ("prefill", 4096, 4096),
    ("prefill", 16384, 2048),
)
"""(phase, tokens, context) of the steps the fixed costs are fitted over: five decode sizes
(sequences x cached tokens) and three prefill sizes (tokens in sequences of ``context``)."""


@dataclass(frozen=True)
class CalibrationOptions:
    """Shapes and effort of a calibration.

    Attributes:
        hidden: model width (elements); DeepSeek-V3: 7168.
        expert_ffn: routed expert intermediate size; DeepSeek-V3: 2048.
        experts_per_gpu: experts in the grouped-GEMM measurement.
        num_q_heads, num_kv_heads, head_dim: attention shape.
        prefill_seq: prefill sequence length, tokens.
        prefill_tokens: tokens per prefill measurement (whole sequences).
        decode_batch: sequences in the decode measurement.
        decode_context: KV length per sequence in decode, tokens.
        token_counts: GEMM token counts m.
        rows_per_expert: grouped-GEMM rows per expert.
        a2a_tokens: tokens per rank in the all-to-all measurements.
        iters: timed repetitions per point (median reported).
        nccl: measure the all-to-all between the GPUs (needs every GPU's process).
        num_experts, top_k, num_shared_experts: MoE shape of the runtime profile.
        profile_decode_tokens, profile_decode_context: sequences per GPU and their KV
            length in the decode point of the runtime profile.
        profile_tokens: tokens per GPU of the large (prefill) point of the runtime profile.
        fp8_dispatch: the runtime profile dispatches in FP8 (else BF16).
        expert_dtype: expert weights of the fast runtime's kernels (``bf16`` | ``fp8``).
        runtime_figures: measure the fast runtime's kernels and fixed costs
            (:mod:`agents.calibrate.runtime_figures`).
        repeats: calibrations per GPU; only figures they agree on within 5% are kept
            (:func:`agents.calibrate.fit.stable_figures`).
        sweep_points: steps of the fast runtime timed inside their CUDA graph, whose
            kernel rates and fixed costs (intercept and slope over the sizes) replace the
            single-shape figures (:func:`agents.calibrate.fit.sweep_figures`); empty: none.
    """

    hidden: int = 7168
    expert_ffn: int = 2048
    experts_per_gpu: int = 128
    num_q_heads: int = 128
    num_kv_heads: int = 8
    head_dim: int = 128
    prefill_seq: int = 2048
    prefill_tokens: int = 4096
    decode_batch: int = 128
    decode_context: int = 4096
    token_counts: tuple[int, ...] = DEFAULT_TOKEN_COUNTS
    rows_per_expert: tuple[int, ...] = DEFAULT_ROWS_PER_EXPERT
    a2a_tokens: tuple[int, ...] = DEFAULT_A2A_TOKENS
    iters: int = 10
    nccl: bool = True
    num_experts: int = 256
    top_k: int = 8
    num_shared_experts: int = 1
    profile_decode_tokens: int = 64
    profile_decode_context: int = 2048
    profile_tokens: int = 8192
    fp8_dispatch: bool = False
    expert_dtype: str = "bf16"
    runtime_figures: bool = True
    repeats: int = 3
    sweep_points: tuple[tuple[str, int, int], ...] = DEFAULT_SWEEP_POINTS


def profile_model(o: CalibrationOptions, *, experts: int, top_k: int) -> ModelSpec:
    """The one-MoE-layer model the runtime profile runs (GQA attention, BF16)."""
    return ModelSpec(
        name="runtime-profile",
        family="deepseek_v3",
        num_layers=1,
        moe_layers=(0,),
        hidden=o.hidden,
        vocab=1024,
        num_q_heads=o.num_q_heads,
        num_kv_heads=o.num_kv_heads,
        head_dim=o.head_dim,
        v_head_dim=o.head_dim,
        attention="gqa",
        q_lora_rank=0,
        kv_lora_rank=0,
        qk_rope_dim=0,
        num_experts=experts,
        num_shared_experts=o.num_shared_experts,
        top_k=top_k,
        expert_ffn=o.expert_ffn,
        dense_ffn=o.expert_ffn,
        n_group=1,
        topk_group=1,
        weight_dtype="bf16",
        expert_dtype="bf16",
    )
