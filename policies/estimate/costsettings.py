"""Cost-model settings: the knobs and calibrated figures the estimate takes.

Owns :class:`Efficiency` (fractions of datasheet peak), :class:`MeasuredFigures` (one GPU's
calibrated figures), :class:`CostSettings` (everything beyond fleet, model and workload),
merging calibrated figures into settings and reading them from plain mappings. The
estimate itself is :func:`policies.estimate.costmodel.build_cost_table`, which re-exports these names.

Units: microseconds (``_us``), bytes, GB/s (1e9 B/s), TFLOPS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from policies.errors import InputError
from policies.keys import unknown_key_error
from policies.limits import check_figure, measured_range


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peak that kernels reach; defaults from docs/planning.md
    (measured on H200, torch 2.11, CUDA 13). Calibration (``mixfleet-agent calibrate``)
    replaces them per GPU with measured figures.

    Attributes:
        gemm_bf16: large BF16 GEMM, 775 / 989 TFLOPS.
        gemm_fp8: large FP8 GEMM, 1276 / 1979 TFLOPS.
        hbm: streaming device-memory bandwidth, 4.3 / 4.8 TB/s (device copy).
        attn_prefill: FlashAttention-class prefill, 330 / 989 TFLOPS.
        attn_decode: decode KV read, 2.46 / 4.81 TB/s.
        nvlink: NCCL all-to-all over NVLink at large messages, 292 / 450 GB/s.
        pcie: PCIe peer traffic.
        rdma: RDMA all-to-all (DeepEP internode 43-58 of 50 GB/s).
        gemm_launch_us: fixed cost per GEMM kernel, us (small-batch GEMMs fall short of the
            roofline by about this much: 128x7168x2048 ran at 219 TFLOPS).
        alpha_nvlink_us, alpha_rdma_us: fixed latency of one dispatch or combine, us.
        allreduce_latency_us: fixed latency of one all-reduce inside a tensor-parallel
            attention group, us (an estimate for NCCL on NVLink at decode sizes; unmeasured).
    """

    gemm_bf16: float = 0.78
    gemm_fp8: float = 0.645
    hbm: float = 0.90
    attn_prefill: float = 0.334
    attn_decode: float = 0.51
    nvlink: float = 0.65
    pcie: float = 0.80
    rdma: float = 0.85
    gemm_launch_us: float = 8.0
    alpha_nvlink_us: float = 15.0
    alpha_rdma_us: float = 25.0
    allreduce_latency_us: float = 10.0


@dataclass(frozen=True)
class MeasuredFigures:
    """Calibrated figures for one GPU (any may be None: then the catalog figure and the
    default efficiency apply).

    Attributes:
        gemm_bf16_tflops, gemm_fp8_tflops: achieved large-GEMM throughput, TFLOPS.
        hbm_gbytes_per_s: achieved streaming bandwidth, GB/s.
        attn_prefill_tflops: achieved prefill attention throughput, TFLOPS.
        attn_decode_gbytes_per_s: achieved decode attention KV-read bandwidth, GB/s.
        nvlink_per_direction_gbytes_per_s: achieved all-to-all bandwidth per GPU per direction, GB/s.
        gemm_launch_us: fixed per-GEMM cost, us.
        expert_gemm_tflops: achieved rate of the grouped expert GEMM (all of a GPU's
            experts in one kernel, a few hundred rows each) in the experts' dtype, TFLOPS;
            replaces the large-GEMM rate for expert FLOPs.
        expert_read_gbytes_per_s: weight-streaming bandwidth of the grouped expert GEMM at a few rows
            per expert, GB/s; replaces ``hbm_gbytes_per_s`` for reading expert weights.
        attn_overhead_us: fixed time of the attention phase (kernel launches, routing,
            host work) measured on the runtime, us; replaces ``4 * gemm_launch_us``.
        attn_extra_us_per_token: attention-phase time per token beyond the roofline
            (elementwise passes, routing), us; added to the attention core per token.
        expert_overhead_us: fixed time of the expert phase, us; replaces
            ``2 * gemm_launch_us``.
        expert_extra_us_per_pair: time per token-expert pair beyond the roofline (gathers,
            permutations, the weighted sum of the combine), us; added to the expert phase.
        a2a_latency_us: fixed latency of one dispatch or one combine, us; replaces
            ``Efficiency.alpha_nvlink_us`` / ``alpha_rdma_us``.
        attn_decode_extra_us_per_token, expert_decode_extra_us_per_pair: the same per-token
            and per-pair times in decode steps (routing, sampling and KV-cache writes cost
            more per token than in prefill), us; None: the general figures apply.
        attn_prefill_us_per_sequence: prefill attention kernel time per sequence beyond
            its FLOPs at ``attn_prefill_tflops`` (the causal tail of each sequence's
            blocks), us; fitted with that rate over sequence lengths.
        expert_gemm_rows_scale: how fast the grouped expert GEMM's rate grows with the
            rows each expert gets, rows per expert: at ``r`` rows it runs at
            ``expert_gemm_tflops * r / (r + expert_gemm_rows_scale)`` (each expert's tiles
            cost as much as that many rows more; fitted over a prefill sweep); None:
            ``expert_gemm_tflops`` at every size.
    """

    gemm_bf16_tflops: float | None = None
    gemm_fp8_tflops: float | None = None
    hbm_gbytes_per_s: float | None = None
    attn_prefill_tflops: float | None = None
    attn_decode_gbytes_per_s: float | None = None
    nvlink_per_direction_gbytes_per_s: float | None = None
    gemm_launch_us: float | None = None
    expert_gemm_tflops: float | None = None
    expert_read_gbytes_per_s: float | None = None
    attn_overhead_us: float | None = None
    attn_extra_us_per_token: float | None = None
    expert_overhead_us: float | None = None
    expert_extra_us_per_pair: float | None = None
    a2a_latency_us: float | None = None
    expert_gemm_rows_scale: float | None = None
    attn_decode_extra_us_per_token: float | None = None
    expert_decode_extra_us_per_pair: float | None = None
    attn_prefill_us_per_sequence: float | None = None


@dataclass(frozen=True)
class CostSettings:
    """Deployment settings the cost model needs beyond fleet, model and workload.

    Attributes:
        memory_headroom: fraction of each GPU's memory kept free (allocator slack, CUDA
            context, fragmentation).
        comm_buffer_gib: DeepEP dispatch/combine buffers per GPU, GiB.
        activation_bytes_per_token: activation workspace per token in flight, bytes.
        efficiency: default efficiency factors.
        measured: per-GPU calibrated figures by GPU id.
        fp8_dispatch: dispatch activations in FP8 (True) or BF16 (False); None: FP8 when
            every GPU has FP8 tensor cores (DeepEP's choice).
    """

    memory_headroom: float = 0.08
    comm_buffer_gib: float = 2.0
    activation_bytes_per_token: float = 64 * 1024
    efficiency: Efficiency = field(default_factory=Efficiency)
    measured: Mapping[str, MeasuredFigures] = field(default_factory=dict)
    fp8_dispatch: bool | None = None


def with_measured(settings: CostSettings, measured: Mapping[str, MeasuredFigures]) -> CostSettings:
    """Settings with calibrated figures merged in (later figures win)."""
    merged = dict(settings.measured)
    merged.update(measured)
    return replace(settings, measured=merged)


# Measured-figure keys renamed so the unit cannot be misread (all GB/s): old -> new. Agents
# and stored inventories from before the rename send the old keys; they are read as new.
LEGACY_MEASURED_KEYS = {
    "hbm_gbps": "hbm_gbytes_per_s",
    "attn_decode_gbps": "attn_decode_gbytes_per_s",
    "nvlink_gbps": "nvlink_per_direction_gbytes_per_s",
    "expert_read_gbps": "expert_read_gbytes_per_s",
}


def measured_from_dict(doc: Mapping[str, Any]) -> MeasuredFigures:
    """Build :class:`MeasuredFigures` from a plain mapping (unknown keys rejected; the
    pre-rename keys of :data:`LEGACY_MEASURED_KEYS` are read as their new names).

    Raises:
        InputError: unknown key or non-positive value.
    """
    known = set(MeasuredFigures.__dataclass_fields__)
    values: dict[str, float] = {}
    for raw_key, value in doc.items():
        key = LEGACY_MEASURED_KEYS.get(raw_key, raw_key)
        if key not in known:
            raise unknown_key_error(key, known, "", what="measured figure")
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not value > 0
            or math.isinf(value)
        ):
            raise InputError(f"must be a finite number > 0, got {value!r}", field=key)
        check_figure(value, *measured_range(key), key, zero=False)
        values[key] = float(value)
    return MeasuredFigures(**values)
