"""The deployment spec's types: what a user asks mixfleet to serve.

:mod:`policies.spec` re-exports them, validates them (:func:`policies.spec.check_spec`) and
turns them into a solve (:func:`policies.spec.to_request`); the document, protobuf and CRD
forms are checked against them by ``tests/policies/test_spec.py``.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.engines import EngineSpec


@dataclass(frozen=True)
class WorkloadSpec:
    """The workload to plan for.

    Attributes:
        phase: ``prefill`` or ``decode``.
        tokens_per_gpu: tokens per step per GPU on average.
        context_len: KV cache length per sequence, tokens.
        kv_cache_dtype: ``bf16`` or ``fp8``.
        load: ``uniform``, ``synthetic:zipf:S[:seed=N]`` or ``measured`` (load windows the
            engines report; uniform until the first window arrives).
        load_matrix: explicit ``[layers][experts]`` load; overrides ``load`` when set.
    """

    phase: str = "decode"
    tokens_per_gpu: int = 64
    context_len: int = 4096
    kv_cache_dtype: str = "bf16"
    load: str = "uniform"
    load_matrix: tuple[tuple[float, ...], ...] | None = None


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
            (:mod:`policies.vendors`).
        gpu_hour_prices: catalog GPU model -> USD per GPU-hour, replacing the built-in
            assumed prices (:mod:`policies.cost`) in the status's cost per million tokens.
        engine: the engine that will run the plan (:mod:`policies.engines`): the plan is
            scored and solved under its replica choice and DP balancing.
    """

    name: str
    model: str = ""
    model_config: Mapping[str, Any] | None = None
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    policy: str = "ilp"
    form: str = "engine"
    redundant_experts: int | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    solver_time_limit_s: float = 60.0
    prepare_timeout_s: float = 30.0
    rebalance: RebalanceSpec = field(default_factory=RebalanceSpec)
    allow_cross_vendor: bool = False
    gpu_hour_prices: Mapping[str, float] = field(default_factory=dict)
    engine: EngineSpec = field(default_factory=EngineSpec)
