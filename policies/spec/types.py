"""The deployment spec's types: what a user asks mixfleet to serve.

:mod:`policies.spec.build` re-exports them, validates them (:func:`policies.spec.build.check_spec`) and
turns them into a solve (:func:`policies.spec.build.to_request`); the document, protobuf and CRD
forms are checked against them by ``tests/policies/test_spec.py``.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies import defaults as d
from policies.estimate.engines import EngineSpec
from policies.serving.traffic import Slo, Traffic

DISAGGREGATION = ("auto", "off", "on")
"""Values of ``DeploymentSpec.disaggregation``."""


@dataclass(frozen=True)
class WorkloadSpec:
    """The workload to plan for.

    Attributes:
        phase: ``prefill`` or ``decode``.
        tokens_per_gpu: tokens per step per GPU on average (default by phase:
            :data:`policies.defaults.DEFAULT_TOKENS_PER_GPU`).
        tokens_per_gpu_set: whether the deployment states ``tokens_per_gpu`` (the document,
            the CRD or the wire gave it, or it differs from the phase's default); False when
            the phase's default filled it in. A stated batch is an explicit override;
            otherwise, for a deployment with traffic and an SLO, the fleet planner chooses
            the batch the SLO allows.
        context_len: KV cache length per sequence, tokens.
        kv_cache_dtype: ``bf16`` or ``fp8``.
        load: ``uniform``, ``synthetic:zipf:S[:seed=N]`` or ``measured`` (load windows the
            engines report; uniform until the first window arrives).
        load_matrix: explicit ``[layers][experts]`` load; overrides ``load`` when set.
    """

    phase: str = d.DEFAULT_PHASE
    tokens_per_gpu: int = d.DEFAULT_TOKENS_PER_GPU[d.DEFAULT_PHASE]
    tokens_per_gpu_set: bool = False
    context_len: int = d.DEFAULT_CONTEXT_LEN
    kv_cache_dtype: str = d.DEFAULT_KV_CACHE_DTYPE
    load: str = "uniform"
    load_matrix: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        # A batch other than the phase's default was stated, whoever built the spec: every
        # codec then carries it (a spec built in code need not set the flag by hand).
        if not self.tokens_per_gpu_set and self.tokens_per_gpu != d.default_tokens_per_gpu(
            self.phase
        ):
            object.__setattr__(self, "tokens_per_gpu_set", True)


@dataclass(frozen=True)
class RebalanceSpec:
    """When the controller re-plans because the measured expert load drifted.

    Attributes:
        enabled: re-plan on sustained imbalance.
        imbalance_threshold: (max - mean) / mean expert-phase time of the committed plan
            under the measured load above which a window counts as imbalanced.
        sustain_s: the imbalance must hold over this many seconds of windows.
        min_interval_s: at least this long between two rebalances, s.
        migration_weight_us: ILP cost of moving one expert replica, us per move; 0 = the
            solver's default.
    """

    enabled: bool = False
    imbalance_threshold: float = 0.15
    sustain_s: float = 60.0
    min_interval_s: float = 300.0
    migration_weight_us: float = 0.0


@dataclass(frozen=True)
class Budget:
    """The most a deployment may take of the fleet (either limit or both; 0 = none).

    Attributes:
        usd_per_hour: most its instances may cost, USD per hour (at its GPU prices).
        gpus: most GPUs it may take.
    """

    usd_per_hour: float = 0.0
    gpus: int = 0


@dataclass(frozen=True)
class DeploymentSpec:
    """A model deployment: the desired state the reconcile loop drives towards.

    Attributes:
        name: deployment name (DNS label).
        model: model preset name; "" when ``model_config`` is given.
        model_config: a Hugging Face ``config.json`` (used when ``model`` is "").
        workload: the workload to plan for.
        policy: placement policy (``ilp`` | ``greedy`` | ``eplb`` | ``uniform``).
        form: ``engine`` or ``native``.
        redundant_experts: extra expert slots per MoE layer; None = the smallest count the
            form allows for the GPUs in the plan (engine form: ``E + r`` divisible by GPUs).
            When the GPU count changes (a node is lost) the next valid count >= this is used.
        node_selector: labels a node must carry (all of them) to be used.
        solver_time_limit_s: solver wall-clock limit, s.
        prepare_timeout_s: rollout prepare deadline, s.
        rebalance: load-driven re-planning.
        allow_cross_vendor: let one expert-parallel all-to-all group span GPU vendors
            (NVIDIA and AMD); off, a MoE deployment over both is refused
            (:mod:`policies.hardware.vendors`).
        gpu_hour_prices: catalog GPU model -> USD per GPU-hour, replacing the built-in
            assumed prices (:mod:`policies.advice.cost`) in the status's cost per million tokens.
        engine: the engine that will run the plan (:mod:`policies.estimate.engines`): the plan is
            scored and solved under its replica choice and DP balancing.
        priority: the fleet scheduler places higher first; a higher one may preempt a
            lower one (:mod:`policies.scheduling`).
        min_gpus: fewest GPUs the deployment may run on; 0 = what its model needs.
        max_gpus: most GPUs the scheduler may give it; 0 = no limit.
        objective: what its share of the fleet is chosen for: ``throughput`` (tokens per
            second), ``cost`` (tokens per dollar) or ``slo`` (tokens per second within
            ``slo_step_time_ms``).
        slo_step_time_ms: step-time target of the ``slo`` objective (decode: time per
            output token), ms; 0 = none.
        memory_fraction: share of each GPU's memory it takes; 1 (default) = its GPUs are
            exclusively its own; below 1 it may share nodes with others that also declare
            a fraction (accounted: the fractions on a node sum to at most 1).
        namespace: quota namespace (the scheduler's per-namespace GPU quotas).
        traffic: the demand it must serve (arrival rate, prompt and output lengths), or
            None (then it is planned for its batch, ``workload.tokens_per_gpu``).
        slo: its latency targets (TTFT and TPOT at a percentile), or None.
        disaggregation: prefill/decode on separate instances: ``auto`` (the planner
            decides), ``off`` (aggregated instances only) or ``on`` (prefill/decode pools
            only; needs ``traffic``).
        budget: the most it may cost or take; zeros = no limit.
    """

    name: str
    model: str = ""
    model_config: Mapping[str, Any] | None = None
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    policy: str = d.DEFAULT_POLICY
    form: str = d.DEFAULT_FORM
    redundant_experts: int | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    solver_time_limit_s: float = d.DEFAULT_SOLVER_TIME_LIMIT_S
    prepare_timeout_s: float = d.DEFAULT_PREPARE_TIMEOUT_S
    rebalance: RebalanceSpec = field(default_factory=RebalanceSpec)
    allow_cross_vendor: bool = False
    gpu_hour_prices: Mapping[str, float] = field(default_factory=dict)
    engine: EngineSpec = field(default_factory=EngineSpec)
    priority: int = 0
    min_gpus: int = 0
    max_gpus: int = 0
    objective: str = "throughput"
    slo_step_time_ms: float = 0.0
    memory_fraction: float = 1.0
    namespace: str = "default"
    traffic: Traffic | None = None
    slo: Slo | None = None
    disaggregation: str = "auto"
    budget: Budget = field(default_factory=Budget)
