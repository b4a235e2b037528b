"""Rooflines of the fast runtime's phases: the bytes each phase must move and the FLOPs it
must do, and the time they take at a measured bandwidth and peak. Pure (no torch).

Per phase, ``roofline_us = max(bytes / bandwidth, flops / peak)``; the layer's roofline is
the sum over phases (each phase waits for the one before). Counted, one step, world size 1,
``T`` tokens, ``P = T * top_k`` token-expert pairs, ``S`` expert slots (every slot receives
pairs at these loads), ``b`` bytes per element (BF16: 2)::

    attention  weights: (Wq + Wk + Wv + Wo + shared FFN) * b + router (float32)
               KV: decode reads 2 * T * kv_heads * context * head_dim * b
               activations: x, q, k, v, o, a, shared out (each T rows)
               FLOPs: 2 T (attention + shared params) + 2 T H E + attention core
                      (decode 4 T q_heads context d; prefill causal 4 T q_heads (s + 1) / 2 d)
    dispatch   nothing at world size 1 (the experts gather their rows straight from ``a``)
    experts    weights: S * 3 H F * b_expert; activations per pair: row in (H), gate/up out
               and in (2 x 2F), silu out and in (2 x F), out (H), result scattered (2 x H)
               FLOPs: 6 P H F
    combine    P rows of H read, a and the shared output read, out written (T rows of H)

Units: bytes, FLOPs, GB/s (1e9 B/s), TFLOPS, microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseWork:
    """What one phase must move and compute.

    Attributes:
        bytes: bytes read plus written.
        flops: floating-point operations.
        dtype: the dtype whose peak bounds its FLOPs (``bf16`` | ``fp8``).
    """

    bytes: float
    flops: float
    dtype: str = "bf16"

    def roofline_us(self, gbytes_per_s: float, tflops: dict[str, float]) -> float:
        """``max(bytes / bandwidth, flops / peak)``, microseconds."""
        return max(self.bytes / (gbytes_per_s * 1e3), self.flops / (tflops[self.dtype] * 1e6))


def layer_work(
    *,
    hidden: int,
    num_experts: int,
    slots: int,
    top_k: int,
    expert_ffn: int,
    num_shared_experts: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tokens: int,
    decode: bool,
    context: int,
    seq_len: int,
    expert_dtype: str = "bf16",
) -> dict[str, PhaseWork]:
    """The work of each phase (module docstring), keyed by phase name."""
    b = 2.0
    h, f, d, t = hidden, expert_ffn, head_dim, tokens
    qd, kvd = num_q_heads * d, num_kv_heads * d
    attn_params = h * qd * 2 + h * kvd * 2
    shared_params = 3 * h * f * num_shared_experts
    pairs = t * top_k
    kv = 2.0 * t * kvd * context * b if decode else 0.0
    act = t * b * (2 * h + qd * 2 + kvd * 2 + h + (2 * f * num_shared_experts + h))
    if decode:
        core = 4.0 * t * num_q_heads * context * d
    else:
        core = 4.0 * t * num_q_heads * (seq_len + 1) / 2.0 * d
    attention = PhaseWork(
        bytes=(attn_params + shared_params) * b + h * num_experts * 4.0 + kv + act,
        flops=2.0 * t * (attn_params + shared_params) + 2.0 * t * h * num_experts + core,
    )
    eb = 1.0 if expert_dtype == "fp8" else 2.0
    experts = PhaseWork(
        bytes=slots * 3.0 * h * f * eb + pairs * b * (h + 4 * f + 2 * f + 3 * h),
        flops=6.0 * pairs * h * f,
        dtype=expert_dtype,
    )
    combine = PhaseWork(bytes=pairs * h * b + 3.0 * t * h * b, flops=2.0 * pairs * h)
    return {
        "attention": attention,
        "dispatch": PhaseWork(0.0, 0.0),
        "experts": experts,
        "combine": combine,
    }


def rooflines_us(
    work: dict[str, PhaseWork], gbytes_per_s: float, tflops: dict[str, float]
) -> dict[str, float]:
    """Per phase roofline time and their sum (``layer``), microseconds."""
    out = {k: w.roofline_us(gbytes_per_s, tflops) for k, w in work.items()}
    out["layer"] = sum(out.values())
    return out
