"""Tiers: what a tier split is asked for and what it answers.

Owns the inputs of :func:`policies.advice.tier_planner.plan_tiers` - :class:`InteractiveTier`
(the latency SLO and traffic), :class:`BatchTier` (the throughput tier) and
:class:`TierRequest` (both tiers over one deployment, with the search preference) - and its
answer: :class:`UnitCapacity` (what one replica of a unit type serves within the SLO),
:class:`Replica`, :class:`Addition`, :class:`InteractiveReport`, :class:`BatchReport` and
:class:`TierPlan`. The rules and the search live in :mod:`policies.advice.tier_planner`.

Units: ms for targets, requests/s, tokens/s, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.advice.advise import BatchPoint
from policies.advice.cost import PriceTable
from policies.defaults import PREFERENCES as PREFERENCES  # one default: policies.defaults
from policies.deployment import Deployment
from policies.errors import InputError
from policies.request import PlacementResult


@dataclass(frozen=True)
class InteractiveTier:
    """The latency tier's service-level objective and traffic.

    Attributes:
        tpot_ms: time-per-output-token target (decode step time), ms; None = none.
        ttft_ms: time-to-first-token target (prefill step time of a batch of prompts), ms;
            None = none. At least one of the two targets is required.
        requests_per_s: arrival rate, requests/s.
        prompt_tokens: prompt length per request, tokens.
        output_tokens: generated tokens per request.
        max_utilisation: most of a replica's time the tier may keep busy (0..1].
    """

    tpot_ms: float | None = None
    ttft_ms: float | None = None
    requests_per_s: float = 1.0
    prompt_tokens: int = 2048
    output_tokens: int = 256
    max_utilisation: float = 0.8

    def check(self) -> None:
        """Raises: InputError on a missing target or a non-positive figure."""
        if self.tpot_ms is None and self.ttft_ms is None:
            raise InputError(
                "an interactive tier needs a latency target. To fix: give --tpot-ms and/or "
                "--ttft-ms",
                field="interactive",
            )
        for name in ("tpot_ms", "ttft_ms"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise InputError(f"must be > 0 ms, got {v!r}", field=f"interactive.{name}")
        if not (self.requests_per_s >= 0 and math.isfinite(self.requests_per_s)):
            raise InputError("must be >= 0 requests/s", field="interactive.requests_per_s")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise InputError(
                "prompt and output lengths must be >= 1 token", field="interactive.tokens"
            )
        if not 0 < self.max_utilisation <= 1:
            raise InputError("must be in (0, 1]", field="interactive.max_utilisation")


@dataclass(frozen=True)
class BatchTier:
    """The throughput tier.

    Attributes:
        phase: ``decode`` or ``prefill``.
        tokens_per_gpu: batch per GPU per step.
        context_len: context per sequence, tokens.
        min_tokens_per_s: throughput the tier should reach (reported, not enforced); None.
    """

    phase: str = "decode"
    tokens_per_gpu: int = 128
    context_len: int = 4096
    min_tokens_per_s: float | None = None


@dataclass(frozen=True)
class TierRequest:
    """Everything :func:`plan_tiers` needs.

    Attributes:
        deployment: fleet, model, KV dtype, load, form, slot budget, solver options and
            cost settings shared by both tiers; its ``policy`` solves the final plans (its
            phase and context are replaced per tier).
        interactive: the latency tier.
        batch: the throughput tier.
        preference: ``fastest`` or ``max-batch`` (see the module docstring).
        screen_policy: fast policy for batch sweeps and screening.
        allow_cross_vendor: let the batch tier's all-to-all span vendors.
        additions: catalog models to try when the SLO is unmet; None = every catalog GPU
            with FlashAttention-class kernels.
        addition_node_gpus: GPUs per hypothetical added node.
        prices: prices to attach to additions (cheapest first); None = GPU count order.
        finalists: ``max-batch``: assignments solved with the final policy.
        max_assignments: ``max-batch``: most assignments screened.
    """

    deployment: Deployment
    interactive: InteractiveTier
    batch: BatchTier = BatchTier()
    preference: str = "fastest"
    screen_policy: str = "greedy"
    allow_cross_vendor: bool = False
    additions: tuple[str, ...] | None = None
    addition_node_gpus: int = 8
    prices: PriceTable | None = None
    finalists: int = 2
    max_assignments: int = 64


@dataclass(frozen=True)
class UnitCapacity:
    """What one interactive replica of a unit type serves within the SLO.

    Attributes:
        nodes: nodes of the representative unit.
        description: its GPUs in words.
        gpu_model: its (first) GPU model.
        gpus: GPUs in the unit.
        decode: largest decode batch meeting the TPOT target (None when none).
        prefill: largest prefill batch meeting the TTFT target (None when none).
        requests_per_s: capacity at ``max_utilisation``; 0 when the unit cannot serve.
        reason: why it cannot serve; empty when it can.
    """

    nodes: tuple[str, ...]
    description: str
    gpu_model: str
    gpus: int
    decode: BatchPoint | None
    prefill: BatchPoint | None
    requests_per_s: float
    reason: str = ""

    @property
    def per_gpu(self) -> float:
        """Capacity per GPU, requests/s."""
        return self.requests_per_s / self.gpus if self.gpus else 0.0


@dataclass(frozen=True)
class Replica:
    """One interactive replica as deployed.

    Attributes:
        nodes: its nodes (one NVLink domain).
        gpu_model: its GPU model.
        result: its decode plan at ``decode_tokens_per_gpu`` (final policy).
        tpot_ms: predicted decode step time, ms.
        ttft_ms: predicted prefill step time at ``prefill_tokens_per_gpu``, ms.
        decode_tokens_per_gpu, prefill_tokens_per_gpu: batches per GPU.
        requests_per_s: capacity, requests/s.
    """

    nodes: tuple[str, ...]
    gpu_model: str
    result: PlacementResult
    tpot_ms: float
    ttft_ms: float
    decode_tokens_per_gpu: int
    prefill_tokens_per_gpu: int
    requests_per_s: float


@dataclass(frozen=True)
class Addition:
    """More nodes of one catalog GPU that would let the interactive tier meet its SLO.

    Attributes:
        gpu_model: catalog model.
        nodes: nodes to add.
        gpus_per_node: GPUs per added node.
        requests_per_s_per_node: what one such node serves within the SLO.
        usd_per_hour: price of the added nodes; None without a price table.
    """

    gpu_model: str
    nodes: int
    gpus_per_node: int
    requests_per_s_per_node: float
    usd_per_hour: float | None = None

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class InteractiveReport:
    """The interactive tier.

    Attributes:
        nodes: its nodes.
        replicas: one per unit.
        capacity_requests_per_s: what the replicas serve within the SLO together.
        demand_requests_per_s: what was asked.
        utilisation: busy fraction at the demand (``max_utilisation`` at full capacity).
        slo_met: capacity covers the demand.
        tpot_ms, ttft_ms: worst predicted step times over the replicas, ms (None: no
            replica).
        additions: ways to meet the SLO when it is not met, best first.
        reasons: why units were not eligible or the SLO is not met.
    """

    nodes: tuple[str, ...]
    replicas: tuple[Replica, ...]
    capacity_requests_per_s: float
    demand_requests_per_s: float
    utilisation: float
    slo_met: bool
    tpot_ms: float | None
    ttft_ms: float | None
    additions: tuple[Addition, ...] = ()
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class BatchReport:
    """The batch tier.

    Attributes:
        nodes: its nodes.
        results: its plans (one per vendor when a MoE model may not span vendors).
        tokens_per_s: predicted throughput of all its plans together.
        step_time_ms: worst step time of its plans (TPOT in decode, TTFT in prefill), ms.
        meets_target: throughput reaches ``BatchTier.min_tokens_per_s`` (None: no target).
        reason: why there is no batch plan; empty when there is.
    """

    nodes: tuple[str, ...]
    results: tuple[PlacementResult, ...]
    tokens_per_s: float
    step_time_ms: float | None
    meets_target: bool | None
    reason: str = ""


@dataclass(frozen=True)
class TierPlan:
    """The tier split.

    Attributes:
        interactive: the latency tier.
        batch: the throughput tier.
        unit_types: capacity of every unit type of the fleet (fastest first).
        preference: how the split was chosen.
        assignments_screened: interactive assignments whose batch tier was solved.
        notes: remarks.
    """

    interactive: InteractiveReport
    batch: BatchReport
    unit_types: tuple[UnitCapacity, ...]
    preference: str
    assignments_screened: int
    notes: tuple[str, ...] = ()
