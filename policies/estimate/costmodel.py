"""Cost model: per-GPU time and memory coefficients of a (fleet, model, workload).

Owns the estimate: :class:`GpuCost` and :class:`CostTable` (the coefficients),
:func:`build_cost_table` and :data:`COST_MODEL_VERSION`. The knobs and calibrated figures
(:class:`Efficiency`, :class:`MeasuredFigures`, :class:`CostSettings`, reading measured
figures from plain mappings) live in :mod:`policies.estimate.costsettings` and are re-exported here.
Scoring a placement with the table lives in :mod:`policies.estimate.evaluation`.

Estimate first, then build, then solve: :func:`build_cost_table` turns (fleet, model,
workload, efficiency) into a :class:`CostTable` of per-GPU coefficients; solvers build their
optimisation problems only from that table, and :func:`policies.estimate.evaluation.evaluate` scores
any placement with the same table, so every policy is judged by one model.

Phases of a layer (each ends at a barrier, so each costs its slowest GPU)::

    attention phase  A_g = max(gemm_us_per_token * x_g, weight_read_us) + core_us_per_token * x_g
                           + overhead_us                                     (x_g = tokens on g)
    dispatch+combine C_g = alpha_us + max over channels ch of max(send_ch, recv_ch) / bw_ch
    expert FFNs      E_g = max(flop_us_per_token * n_g, replica_read_us * r_g + act_us_per_token * n_g)
                           + overhead_us             (n_g = token-expert pairs on g, r_g = replicas)

    replica_read_us  = expert bytes / read bandwidth * (1 - exp(-p)), p = the step's pairs per
                       expert: grouped GEMMs skip experts without rows, so at a few tokens
                       only the experts that get some are read;
    flop_us_per_token = 6 H F / rate(r), rate(r) = expert_gemm_tflops * r / (r + s),
                       r = p / (1 - exp(-p)) rows per expert that gets any, s =
                       expert_gemm_rows_scale (calibrated; a grouped GEMM pays per expert
                       about as much as s rows more of work).

    layer time = max_g A_g (+ max_g C_g + max_g E_g on MoE layers);  step time = sum over layers.

The attention phase covers attention projections (a roofline over GEMM FLOPs and weight
reads), the attention core (compute-bound in prefill, KV-read-bound in decode) and the
dense FFN or shared expert of the layer, for the GPU's share of the batch (data-parallel
attention, each GPU a rank, or a tensor-parallel group: see below). Expert FFNs are a
grouped-GEMM roofline with per-architecture dtype support: FP8 weights on a GPU without FP8
tensor cores (Ampere) compute at the BF16 rate while their memory traffic stays at FP8 size. Dispatch/combine is alpha-beta over the
channel each pair of GPUs talks over (NVLink inside a domain, PCIe inside a node without
NVLink, RDMA across nodes), with tokens originating on each GPU in proportion to its
attention share.

Tensor-parallel attention (:mod:`policies.estimate.tensor_parallel` builds such tables): a DP group
of k identical GPUs of one node serves its share with heads split k ways, each GPU counting
as serving 1/k of it; per GPU the shared weights and their read time are divided by k, the
KV cache is multiplied by ``k / kv_shards``, and two all-reduces per layer join the attention
phase (their time per token in ``attn_core_us_per_token``, latency in ``attn_overhead_us``).

Units: microseconds (``_us``), bytes, GB/s (1e9 B/s = 1e3 B/us), TFLOPS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from policies.errors import InputError
from policies.estimate.costsettings import (
    LEGACY_MEASURED_KEYS,
    CostSettings,
    Efficiency,
    MeasuredFigures,
    measured_from_dict,
    with_measured,
)
from policies.estimate.reference import pcie_collective_gbytes_per_s
from policies.estimate.workload import Workload
from policies.hardware.catalog import GpuSpec
from policies.hardware.fleet import Fleet
from policies.hardware.topology import Channel, Topology, build_topology
from policies.model.architecture import DTYPE_BYTES, ModelSpec

__all__ = [
    "COST_MODEL_VERSION",
    "GIB",
    "LEGACY_MEASURED_KEYS",
    "CostSettings",
    "CostTable",
    "Efficiency",
    "GpuCost",
    "MeasuredFigures",
    "active_fraction",
    "attention_core_us",
    "build_cost_table",
    "expert_gemm_rate_tflops",
    "measured_from_dict",
    "with_measured",
]

COST_MODEL_VERSION = "costmodel-2"
"""Version of the cost model's formulas: bump on any change of a cost formula (here, in
:mod:`policies.estimate.costsettings`' defaults or in the scoring of :mod:`policies.estimate.evaluation`), so
nothing computed from an older model (a step curve cached on disk) is reused."""

GIB = float(2**30)


@dataclass(frozen=True)
class GpuCost:
    """Per-GPU coefficients of the cost model (one GPU, one layer unless noted).

    Attributes:
        attn_gemm_us_per_token: projection + dense/shared FFN GEMM time per token, by layer
            kind (``"dense"``, ``"moe"``).
        attn_weight_read_us: time to stream the attention phase's weights once, by kind.
        attn_core_us_per_token: attention-core time per token (KV read or score FLOPs),
            plus a tensor-parallel group's all-reduce time per token.
        attn_overhead_us: fixed kernel costs of the attention phase (and all-reduce latency).
        expert_flop_us_per_pair: expert FFN compute per token-expert pair.
        expert_read_us_per_replica: time to stream one replica's weights.
        expert_act_us_per_pair: activation traffic per token-expert pair.
        expert_overhead_us: fixed kernel costs of the expert phase.
        comm_bw_bytes_per_us: bandwidth per channel per direction, bytes/us (index Channel).
        comm_alpha_us: fixed latency of dispatch plus combine.
        usable_bytes: memory usable for model state (capacity minus headroom).
        fixed_bytes: weights every GPU holds (attention, dense FFNs, shared experts,
            embeddings; 1/k of them in a tensor-parallel group of k) plus communication buffers.
    """

    attn_gemm_us_per_token: Mapping[str, float]
    attn_weight_read_us: Mapping[str, float]
    attn_core_us_per_token: float
    attn_overhead_us: float
    expert_flop_us_per_pair: float
    expert_read_us_per_replica: float
    expert_act_us_per_pair: float
    expert_overhead_us: float
    comm_bw_bytes_per_us: tuple[float, ...]
    comm_alpha_us: float
    usable_bytes: float
    fixed_bytes: float


@dataclass(frozen=True)
class CostTable:
    """Everything a solver needs, computed once from the inputs.

    Attributes:
        gpus: per-GPU coefficients, fleet order.
        gpu_ids: GPU ids, fleet order.
        models: GPU catalog model per GPU (for reports and colouring).
        topology: the fleet graph and channel matrix.
        total_tokens: tokens in one step, all GPUs together.
        top_k: routed experts per token.
        num_experts: routed experts per MoE layer.
        num_dense_layers, num_moe_layers: layer counts.
        load: ``[moe_layer][expert]`` load fractions (each row sums to 1).
        bytes_per_copy: dispatch + combine bytes per token-expert pair crossing GPUs.
        expert_bytes: bytes of one expert replica.
        kv_bytes_per_token: KV-cache bytes per token of context, all layers.
        act_bytes_per_token: activation workspace per token.
        decode: phase flag.
        context_len: KV length per sequence.
        channel_masks: per channel an n x n 0/1 matrix, 1 where GPUs i, j talk over it
            (0 x 0 for a channel no pair uses).
        comm_bw: n x channels bandwidth, bytes/us (the GpuCost figures as an array).
        comm_alpha: per GPU dispatch+combine latency, us.
        segment: per GPU the index of its fabric segment (its first fabric, sorted).
        segment_links: ``(segment a, segment b, bytes/us per direction, alpha us)`` for each
            link joining two segments; cross-segment traffic shares it.
        attention_tp: per GPU the size k of its tensor-parallel attention group (empty: 1).
        kv_shards: per GPU the ways its group splits the KV cache (empty: 1).
        exchange: how the EP group's backend moves tokens to experts in this phase:
            ``alltoall``, ``forwarded`` or ``allgather``
            (:meth:`policies.estimate.engines.Runtime.exchange_in`; scoring and solving).
        gather_bw: per GPU the bandwidth of the all-gather exchange's collectives, bytes/us
            (:func:`gather_bandwidth`; 0 for a GPU with no peer).
    """

    gpus: tuple[GpuCost, ...]
    gpu_ids: tuple[str, ...]
    models: tuple[str, ...]
    topology: Topology
    total_tokens: float
    top_k: int
    num_experts: int
    num_dense_layers: int
    num_moe_layers: int
    load: tuple[tuple[float, ...], ...]
    bytes_per_copy: float
    expert_bytes: float
    kv_bytes_per_token: float
    act_bytes_per_token: float
    decode: bool
    context_len: int
    channel_masks: tuple[npt.NDArray[np.float64], ...] = ()
    comm_bw: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, 0)))
    comm_alpha: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    segment: tuple[int, ...] = ()
    segment_links: tuple[tuple[int, int, float, float], ...] = ()
    attention_tp: tuple[int, ...] = ()
    kv_shards: tuple[int, ...] = ()
    exchange: str = "alltoall"
    gather_bw: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def pairs(self, layer: int, expert: int) -> float:
        """Token-expert pairs routed to ``expert`` in MoE layer ``layer`` per step."""
        return self.load[layer][expert] * self.total_tokens * self.top_k

    def kv_tokens(self, tokens_on_gpu: float) -> float:
        """Context tokens whose KV a GPU keeps when it serves ``tokens_on_gpu`` per step."""
        if self.decode:
            return tokens_on_gpu * self.context_len
        return max(tokens_on_gpu, float(self.context_len)) if tokens_on_gpu > 0 else 0.0

    def kv_split(self, i: int) -> tuple[int, int]:
        """GPU ``i``'s ``(attention TP size k, KV shards)``: its group keeps the KV of k
        times its tokens, split that many ways."""
        return (
            self.attention_tp[i] if self.attention_tp else 1,
            self.kv_shards[i] if self.kv_shards else 1,
        )

    def kv_cache_bytes(self, i: int, tokens_on_gpu: float) -> float:
        """KV-cache bytes GPU ``i`` keeps when it serves ``tokens_on_gpu`` per step."""
        k, shards = self.kv_split(i)
        return self.kv_tokens(tokens_on_gpu * k) * self.kv_bytes_per_token / shards

    def attention_us(self, i: int, tokens: float, kind: str) -> float:
        """Attention-phase time of GPU ``i`` serving ``tokens`` tokens in a layer of ``kind``."""
        c = self.gpus[i]
        if tokens <= 0:
            return 0.0
        return (
            max(c.attn_gemm_us_per_token[kind] * tokens, c.attn_weight_read_us[kind])
            + c.attn_core_us_per_token * tokens
            + c.attn_overhead_us
        )

    def expert_us(self, i: int, pairs: float, replicas: int) -> float:
        """Expert-phase time of GPU ``i`` with ``pairs`` token-expert pairs on ``replicas``."""
        c = self.gpus[i]
        if replicas == 0:
            return 0.0
        return (
            max(
                c.expert_flop_us_per_pair * pairs,
                c.expert_read_us_per_replica * replicas + c.expert_act_us_per_pair * pairs,
            )
            + c.expert_overhead_us
        )


def _peak_tflops(spec: GpuSpec, dtype: str, eff: Efficiency, m: MeasuredFigures | None) -> float:
    """Achievable GEMM rate for weights of ``dtype`` on ``spec`` (dequantising when needed)."""
    if dtype == "fp8" and spec.has_fp8:
        if m and m.gemm_fp8_tflops:
            return m.gemm_fp8_tflops
        return spec.fp8_tflops * eff.gemm_fp8
    if dtype == "mxfp4" and spec.fp4_tflops > 0:
        return spec.fp4_tflops * eff.gemm_fp8
    if m and m.gemm_bf16_tflops:
        return m.gemm_bf16_tflops
    return spec.bf16_tflops * eff.gemm_bf16


@dataclass(frozen=True)
class _ModelTerms:
    """Per-(model, workload) constants shared by every GPU's cost (bytes, parameters)."""

    weight_bytes: float
    kv_bytes: float
    fixed_weights: float
    ffn_params: Mapping[str, float]
    act_pair_bytes: float


def _model_terms(model: ModelSpec, workload: Workload) -> _ModelTerms:
    wb = model.weight_bytes
    embed_bytes = model.embedding_params * 2.0  # embeddings and LM head stay in BF16
    fixed_weights = (
        model.num_layers * model.attn_params_per_layer * wb
        + model.num_dense_layers * model.dense_ffn_params * wb
        + model.num_moe_layers * model.shared_expert_params * wb
        + embed_bytes
    )
    if not model.is_moe:
        fixed_weights += 0.0
    # Per-token activation traffic of one token-expert pair: FP8/BF16 input, BF16 gate/up
    # output read+write, BF16 output.
    act_pair_bytes = model.hidden * 2.0 + 2 * model.expert_ffn * 2.0 * 2 + model.hidden * 2.0
    return _ModelTerms(
        weight_bytes=wb,
        kv_bytes=DTYPE_BYTES[workload.kv_cache_dtype],
        fixed_weights=fixed_weights,
        ffn_params={"dense": model.dense_ffn_params, "moe": model.shared_expert_params},
        act_pair_bytes=act_pair_bytes,
    )


def attention_core_us(
    spec: GpuSpec,
    m: MeasuredFigures | None,
    model: ModelSpec,
    workload: Workload,
    eff: Efficiency,
    kv_bytes: float,
) -> float:
    """Attention core time per token, us: KV read or FLOPs in decode, FLOPs in prefill
    (KV read time is proportional to ``kv_bytes``, which :mod:`policies.estimate.tensor_parallel`
    scales by a group's KV replication)."""
    ctx = workload.context_len
    if workload.decode:
        bw = (
            (m.attn_decode_gbytes_per_s * 1e3)
            if m and m.attn_decode_gbytes_per_s
            else (spec.hbm_bandwidth_gbytes_per_s * eff.attn_decode * 1e3)
        )
        kv_read = model.kv_read_elements_per_token_per_layer(ctx) * kv_bytes / bw
        core_flop = model.attn_core_flops_per_token(ctx, decode=True) / (
            spec.bf16_tflops * eff.gemm_bf16 * 1e6
        )
        return max(kv_read, core_flop)
    rate = (
        m.attn_prefill_tflops
        if m and m.attn_prefill_tflops
        else spec.bf16_tflops * eff.attn_prefill
    ) * 1e6
    per_seq = m.attn_prefill_us_per_sequence if m and m.attn_prefill_us_per_sequence else 0.0
    return model.attn_core_flops_per_token(ctx / 2.0, decode=False) / rate + per_seq / max(ctx, 1)


def _comm_terms(
    i: int, m: MeasuredFigures | None, topo: Topology, eff: Efficiency, model_name: str = ""
) -> tuple[tuple[float, ...], float]:
    """GPU ``i``'s bandwidth per channel (bytes/us, indexed by :class:`Channel`) and its
    all-to-all latency (dispatch + combine), us. PCIe peer traffic of a GPU model with
    measured NCCL collectives over PCIe (:func:`policies.estimate.reference.pcie_collective_gbytes_per_s`,
    ``model_name`` its catalog model) runs at that measured rate, not at the link's peak."""
    nvl_bw = (
        m.nvlink_per_direction_gbytes_per_s
        if m and m.nvlink_per_direction_gbytes_per_s
        else topo.nvlink_gbytes_per_s[i] * eff.nvlink
    ) * 1e3
    pcie_bw = topo.pcie_gbytes_per_s[i] * eff.pcie * 1e3
    measured_pcie = pcie_collective_gbytes_per_s(model_name) if model_name else None
    if (
        measured_pcie is not None
    ):  # NCCL over this GPU's PCIe, measured (policies.estimate.reference)
        pcie_bw = measured_pcie * 1e3
    bw_by_channel = (
        math.inf,  # LOCAL
        nvl_bw if nvl_bw > 0 else pcie_bw,  # NVLINK
        pcie_bw,  # PCIE
        topo.rdma_gbytes_per_s[i] * eff.rdma * 1e3,  # RDMA
        topo.rdma_gbytes_per_s[i] * eff.rdma * 1e3,  # RDMA_CROSS: the NIC; the link is shared
        1e-9,  # UNREACHABLE: effectively forbidden
    )
    remote = bool((topo.channel[i] >= Channel.RDMA).any())
    alpha = 2 * (eff.alpha_rdma_us if remote else eff.alpha_nvlink_us)
    if m and m.a2a_latency_us:
        alpha = 2 * m.a2a_latency_us
    return bw_by_channel, alpha


def active_fraction(pairs_per_expert: float) -> float:
    """Expected fraction of an expert's replicas that receive at least one pair when the
    expert gets ``pairs_per_expert`` pairs per step, spread at random (Poisson): grouped
    GEMMs read no weights for an expert without rows, so at a few tokens per step only
    the experts that get tokens are read (``1 - exp(-pairs)``)."""
    return 1.0 - math.exp(-pairs_per_expert) if pairs_per_expert > 0 else 1.0


def expert_gemm_rate_tflops(peak_tflops: float, rows: float, rows_scale: float | None) -> float:
    """The grouped expert GEMM's rate at ``rows`` rows per expert, TFLOPS:
    ``peak * rows / (rows + rows_scale)`` - each expert's tiles cost as much as
    ``rows_scale`` rows more of work (no ``rows_scale``: the peak)."""
    if not rows_scale or rows <= 0:
        return peak_tflops
    return peak_tflops * rows / (rows + rows_scale)


def _gpu_cost(
    i: int,
    spec: GpuSpec,
    m: MeasuredFigures | None,
    model: ModelSpec,
    workload: Workload,
    s: CostSettings,
    topo: Topology,
    terms: _ModelTerms,
    pairs_per_expert: float = 0.0,
) -> GpuCost:
    """The cost coefficients of GPU ``i`` (see :class:`GpuCost` for units);
    ``pairs_per_expert``: the step's token-expert pairs per routed expert (0: unknown),
    which sets the grouped GEMM's rate and the share of replicas whose weights are read."""
    eff = s.efficiency
    hbm = (
        m.hbm_gbytes_per_s
        if m and m.hbm_gbytes_per_s
        else spec.hbm_bandwidth_gbytes_per_s * eff.hbm
    ) * 1e3  # B/us
    dense_rate = _peak_tflops(spec, model.weight_dtype, eff, m) * 1e6  # FLOP/us
    expert_rate = _peak_tflops(spec, model.expert_dtype, eff, m) * 1e6
    if m and m.expert_gemm_tflops:
        # Rows per expert that gets any: at a few tokens an active expert has about one.
        rows = pairs_per_expert / active_fraction(pairs_per_expert) if pairs_per_expert else 0.0
        expert_rate = (
            expert_gemm_rate_tflops(m.expert_gemm_tflops, rows, m.expert_gemm_rows_scale) * 1e6
        )
    expert_read_bw = m.expert_read_gbytes_per_s * 1e3 if m and m.expert_read_gbytes_per_s else hbm
    launch = m.gemm_launch_us if m and m.gemm_launch_us is not None else eff.gemm_launch_us
    gemm_tok: dict[str, float] = {}
    read: dict[str, float] = {}
    for kind, ffn in terms.ffn_params.items():
        params = model.attn_params_per_layer + ffn
        gemm_tok[kind] = 2.0 * params / dense_rate
        read[kind] = params * terms.weight_bytes / hbm
    if model.is_moe:
        gemm_tok["dense"] = (
            2.0 * (model.attn_params_per_layer + model.dense_ffn_params) / dense_rate
        )
    core = attention_core_us(spec, m, model, workload, eff, terms.kv_bytes)
    bw_by_channel, alpha = _comm_terms(i, m, topo, eff, spec.model)
    if m and workload.decode and m.attn_decode_extra_us_per_token:
        core += m.attn_decode_extra_us_per_token
    elif m and m.attn_extra_us_per_token:
        core += m.attn_extra_us_per_token
    # Per-pair work beyond the roofline adds to both branches of the expert phase's max,
    # which is the same as adding it outside the max (keeps the solvers' linear form).
    extra_pair = m.expert_extra_us_per_pair if m and m.expert_extra_us_per_pair else 0.0
    if m and workload.decode and m.expert_decode_extra_us_per_pair:
        extra_pair = m.expert_decode_extra_us_per_pair
    return GpuCost(
        attn_gemm_us_per_token=gemm_tok,
        attn_weight_read_us=read,
        attn_core_us_per_token=core,
        attn_overhead_us=(m.attn_overhead_us if m and m.attn_overhead_us else 4 * launch),
        expert_flop_us_per_pair=2.0 * model.expert_params / expert_rate + extra_pair,
        expert_read_us_per_replica=model.expert_bytes
        / expert_read_bw
        * active_fraction(pairs_per_expert),
        expert_act_us_per_pair=terms.act_pair_bytes / hbm + extra_pair,
        expert_overhead_us=(m.expert_overhead_us if m and m.expert_overhead_us else 2 * launch),
        comm_bw_bytes_per_us=bw_by_channel,
        comm_alpha_us=alpha,
        usable_bytes=spec.memory_gib * GIB * (1.0 - s.memory_headroom),
        fixed_bytes=terms.fixed_weights + s.comm_buffer_gib * GIB,
    )


def _segments(
    fleet: Fleet, eff: Efficiency
) -> tuple[tuple[int, ...], tuple[tuple[int, int, float, float], ...]]:
    """Each GPU's fabric segment index (-1 without NICs) and the links between segments
    as ``(a, b, bytes/us, dispatch+combine latency us)``."""
    fabrics = sorted({f for node in fleet.nodes for f in node.fabrics})
    seg_index = {f: k for k, f in enumerate(fabrics)}
    seg_of_gpu = tuple(
        seg_index[fleet.node(g.node).fabrics[0]] if fleet.node(g.node).fabrics else -1
        for g in fleet.gpus
    )
    links = tuple(
        (
            seg_index[x.a],
            seg_index[x.b],
            x.per_direction_gbits_per_s / 8.0 * eff.rdma * 1e3,
            2 * (eff.alpha_rdma_us + x.latency_us),
        )
        for x in fleet.fabric_links
    )
    return seg_of_gpu, links


def build_cost_table(
    fleet: Fleet, model: ModelSpec, workload: Workload, settings: CostSettings | None = None
) -> CostTable:
    """Compute the per-GPU cost coefficients for a (fleet, model, workload).

    Raises:
        InputError: the workload's load does not match the model.
    """
    s = settings or CostSettings()
    eff = s.efficiency
    if model.is_moe and len(workload.expert_load) != model.num_moe_layers:
        raise InputError(
            f"load has {len(workload.expert_load)} rows for {model.num_moe_layers} MoE layers",
            field="load",
        )
    topo = build_topology(fleet)
    gpus = fleet.gpus
    n = len(gpus)
    total_tokens = float(workload.tokens_per_gpu * n)
    terms = _model_terms(model, workload)
    all_fp8 = all(g.spec.has_fp8 for g in gpus) if s.fp8_dispatch is None else s.fp8_dispatch
    # DeepEP dispatches FP8 (with one FP32 scale per 128 values) when every GPU has FP8
    # tensor cores; combine is BF16.
    dispatch = model.hidden * (1 + 4 / 128) if all_fp8 else model.hidden * 2.0
    bytes_per_copy = dispatch + model.hidden * 2.0
    pairs_per_expert = total_tokens * model.top_k / model.num_experts if model.is_moe else 0.0
    costs = [
        _gpu_cost(
            i, g.spec, s.measured.get(g.id), model, workload, s, topo, terms, pairs_per_expert
        )
        for i, g in enumerate(gpus)
    ]
    seg_of_gpu, segment_links = _segments(fleet, eff)
    load = tuple(
        tuple(workload.load_fractions(layer)) for layer in range(len(workload.expert_load))
    )
    return CostTable(
        gpus=tuple(costs),
        gpu_ids=tuple(g.id for g in gpus),
        models=tuple(g.spec.model for g in gpus),
        topology=topo,
        total_tokens=total_tokens,
        top_k=model.top_k,
        num_experts=model.num_experts,
        num_dense_layers=model.num_dense_layers,
        num_moe_layers=model.num_moe_layers,
        load=load,
        bytes_per_copy=bytes_per_copy,
        expert_bytes=model.expert_bytes,
        kv_bytes_per_token=model.kv_cache_elements_per_token(workload.context_len) * terms.kv_bytes,
        act_bytes_per_token=s.activation_bytes_per_token,
        decode=workload.decode,
        context_len=workload.context_len,
        channel_masks=tuple(
            (topo.channel == ch).astype(float) if (topo.channel == ch).any() else np.zeros((0, 0))
            for ch in range(len(Channel))
        ),
        comm_bw=np.array([c.comm_bw_bytes_per_us for c in costs], dtype=float),
        comm_alpha=np.array([c.comm_alpha_us for c in costs], dtype=float),
        gather_bw=gather_bandwidth(
            topo, np.array([c.comm_bw_bytes_per_us for c in costs]), segment_links
        ),
        segment=seg_of_gpu,
        segment_links=segment_links,
    )


def gather_bandwidth(
    topo: Topology,
    comm_bw: npt.NDArray[np.float64],
    segment_links: Sequence[tuple[int, int, float, float]] = (),
) -> npt.NDArray[np.float64]:
    """Per GPU the bandwidth its all-gather and reduce-scatter run at, bytes/us.

    NCCL runs these collectives as rings: a ring passes through a node's GPUs over NVLink (or
    PCIe) and crosses to the next node once, and NCCL spreads its rings over the node's NICs.
    So the ring's cross-node hops together run at a node's whole NIC bandwidth (the bus
    bandwidth nccl-tests reports across nodes approaches it), not at one GPU's share of the
    NICs, and every GPU's own intra-node link carries the ring's whole volume. A GPU's figure
    is the slower of its intra-node channels to peers and, when the group spans nodes, the
    smallest node's NIC total among the group's nodes (each node counting the NIC shares of
    the group's GPUs on it, ``comm_bw`` at :attr:`Channel.RDMA`); when the group spans fabric
    segments the ring also crosses the links between them, and the slowest link caps it.
    Unmeasured across nodes (docs/planning.md, "Token exchange").

    Args:
        topo: the group's topology.
        comm_bw: n x channels per-GPU bandwidth, bytes/us (:attr:`CostTable.comm_bw`).
        segment_links: :attr:`CostTable.segment_links` (the third field: bytes/us per direction).
    """
    n = len(topo.gpus)
    out = np.zeros(n)
    if n == 0:
        return out
    chan = topo.channel
    remote = (chan == Channel.RDMA) | (chan == Channel.RDMA_CROSS)
    ring_nic = math.inf
    if remote.any():
        per_node: dict[str, float] = {}
        for j, gpu in enumerate(topo.gpus):
            per_node[gpu.node] = per_node.get(gpu.node, 0.0) + float(comm_bw[j, Channel.RDMA])
        ring_nic = min(per_node.values())
        if segment_links and (chan == Channel.RDMA_CROSS).any():
            ring_nic = min(ring_nic, *(bw for _, _, bw, _ in segment_links))
    for i in range(n):
        own = (Channel.NVLINK, Channel.PCIE, Channel.UNREACHABLE)  # unreachable: ~0 B/us
        bws = [float(comm_bw[i, k]) for k in own if (chan[i] == k).any()]
        if remote[i].any():
            bws.append(ring_nic)
        out[i] = min(bws) if bws else 0.0
    return out
