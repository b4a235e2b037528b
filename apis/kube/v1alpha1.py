"""The mixfleet.io/v1alpha1 API: the custom resources, declared once.

Every CRD's spec (what a user wants) and status (what the controller saw) is a frozen
dataclass below; :mod:`operators.crdgen` turns them into the CRD manifests in
``charts/mixfleet/crds/`` and the operator reads and writes objects through the same
classes (:func:`apis.kube.schema.from_wire` / :func:`apis.kube.schema.to_wire`).

* ``GPUNode`` (cluster-scoped): one GPU host. Status: the inventory its agent reported
  (the agent's own :class:`policies.hardware.inventory.NodeInventory`, reflected), health and last
  heartbeat. Spec: cordon it out of placement, tag its tier.
* ``PlacementPolicy`` (cluster-scoped): solver settings, slot budget, tiers, rebalancing.
* ``ModelDeployment`` (namespaced): a model to place on GPUNodes, with conditions
  ``Solved``, ``RolledOut``, ``Degraded`` and, under a policy with an interactive tier,
  ``InteractiveSLO``. One that states ``traffic`` and ``slo`` runs as engine instances,
  each a ModelDeployment the operator owns (``status.instance`` says what it is); its own
  status lists them (``status.instances``) with the conditions ``Ready`` and
  ``DemandServed``.
* ``PartitionPlan`` (namespaced, owned by its ModelDeployment): one immutable plan
  version, gzip+base64 compressed; status holds the rollout state of each node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from apis.kube.schema import Json, Meta, Rule, k8s, openapi_schema
from policies import defaults
from policies.estimate.engines import A2A_BACKENDS, DISPATCH_OPTIONS, DP_BALANCE_OPTIONS, ENGINES
from policies.estimate.workload import KV_DTYPES, PHASES
from policies.exports.engine import EXPORT_FORMATS
from policies.hardware.catalog import CATALOG
from policies.hardware.inventory import NodeInventory
from policies.plan import FORMS
from policies.request import POLICIES

GROUP = "mixfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: DNS-1123 label (names of policies, tiers, ModelDeployments).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: DNS-1123 subdomain (node names).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: Kubernetes label key (optional DNS prefix, then a name).
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
#: Kubernetes label value (may be empty).
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
HEX16 = r"^[0-9a-f]{16}$"

ENGINE_FORMATS = (*EXPORT_FORMATS, "none")
#: gpuHourPrices keys are catalog GPU models (prices are looked up by a GPU's catalog name).
CATALOG_KEYS_RULE = Rule(
    rule="self.all(k, k in [" + ", ".join(f"'{m}'" for m in CATALOG) + "])",
    message="gpuHourPrices keys must be catalog GPU models: " + ", ".join(CATALOG),
)
CONDITION_STATUSES = ("True", "False", "Unknown")
HEALTH_STATES = ("Healthy", "Degraded", "Unhealthy", "Unknown")
ROLLOUT_STATES = ("Pending", "Prepared", "Committed", "Failed", "Aborted")
SOLVE_OUTCOMES = ("Succeeded", "Failed")
PLAN_ENCODINGS = ("gzip+base64",)
PLAN_AUTHORS = ("operator", "controller")
PLAN_STATES = ("Proposed", "Preparing", "Committed", "Aborted", "Superseded")

#: Most GPUs one plan may place on; bounds arrays so CEL rules stay within cost limits.
MAX_PLAN_GPUS = 4096
MAX_PLAN_NODES = 1024
#: Largest compressed plan a PartitionPlan holds, characters (objects are capped at 1.5 MB).
MAX_PLAN_DATA_CHARS = 1_048_576


# --------------------------------------------------------------------------- shared


@dataclass(frozen=True)
class Condition:
    """One observation of a resource's state (the shape of ``metav1.Condition``)."""

    type: str = field(
        metadata=k8s(
            "Condition type: Solved, RolledOut, Degraded or InteractiveSLO.",
            pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
            max_length=316,
        )
    )
    status: str = field(metadata=k8s("True, False or Unknown.", enum=CONDITION_STATUSES))
    reason: str = field(
        metadata=k8s(
            "CamelCase reason a program can switch on (Solved, UnknownModel, Infeasible...).",
            pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
            min_length=1,
            max_length=1024,
        )
    )
    message: str = field(
        metadata=k8s("What happened, for a person; says how to fix it.", max_length=32768)
    )
    last_transition_time: str = field(
        metadata=k8s(
            "When the status last changed (RFC 3339, UTC).",
            format="date-time",
        )
    )
    observed_generation: int | None = field(
        default=None,
        metadata=k8s("metadata.generation the condition was computed from.", minimum=0),
    )


# --------------------------------------------------------------------------- GPUNode


@dataclass(frozen=True)
class GPUNodeSpec:
    """What an administrator wants of a GPU node."""

    cordon: bool = field(
        default=False,
        metadata=k8s(
            "Keep the node out of new placements. Plans that use it are re-solved without it."
        ),
    )
    tier: str = field(
        default="",
        metadata=k8s(
            "Tier tag (e.g. hopper, ada) that PlacementPolicy.spec.tiers selects on; empty "
            "for none.",
            pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
            max_length=63,
        ),
    )


@dataclass(frozen=True)
class NodeHealth:
    """Health of a node as the controller judges it from the agent's reports."""

    state: str = field(
        metadata=k8s(
            "Healthy (all GPUs usable), Degraded (some GPUs unhealthy), Unhealthy (none "
            "usable) or Unknown.",
            enum=HEALTH_STATES,
        )
    )
    unhealthy_gpus: tuple[int, ...] = field(
        default=(),
        metadata=k8s("Indices of GPUs whose health signals fail.", max_items=1024),
    )
    message: str = field(default="", metadata=k8s("Why, for a person.", max_length=4096))


#: Validation of the reflected agent inventory (agents/inventory.py has no k8s metadata).
INVENTORY_CONSTRAINTS: dict[str, Meta] = {
    "NodeInventory.node": Meta(pattern=DNS_SUBDOMAIN, max_length=253),
    "GpuInventory.index": Meta(minimum=0),
    "GpuInventory.sms": Meta("Streaming multiprocessors.", minimum=0),
    "GpuInventory.memory_bytes": Meta("Device memory, bytes.", minimum=0),
    "GpuInventory.hbm_bandwidth_gbytes_per_s": Meta(
        "Peak memory bandwidth (bus width x memory clock x 2), GB/s.", minimum=0
    ),
    "GpuInventory.sm_clock_mhz": Meta("Maximum SM clock, MHz.", minimum=0),
    "GpuInventory.power_limit_w": Meta("Power management limit, W.", minimum=0),
    "GpuInventory.pcie_generation": Meta(minimum=0),
    "GpuInventory.pcie_width": Meta(minimum=0),
    "NvLinkInfo.link": Meta(minimum=0),
    "NvLinkInfo.generation": Meta(minimum=0),
    "NicInventory.rate_per_direction_gbits_per_s": Meta(minimum=0),
    "NicInventory.link_layer": Meta(enum=("infiniband", "ethernet")),
}


@dataclass(frozen=True)
class AgentSession:
    """The agent's registration, as the controller's store keeps it."""

    session_id: str = field(
        metadata=k8s(
            "Session id of the agent's current registration.", json_name="sessionID", max_length=253
        )
    )
    registered_time: str = field(
        metadata=k8s("When the agent last registered (RFC 3339).", format="date-time")
    )
    state: str = field(
        default="ready",
        metadata=k8s(
            "What the agent says: ready, draining or degraded.",
            enum=("ready", "draining", "degraded"),
        ),
    )
    message: str = field(default="", metadata=k8s("The agent's free-text status.", max_length=4096))
    applied: dict[str, int] = field(
        default_factory=dict,
        metadata=k8s(
            "Deployment (namespace/name) -> plan version the agent says it applied.",
            max_properties=4096,
        ),
    )


@dataclass(frozen=True)
class GPUNodeStatus:
    """What the controller last heard from the node's agent."""

    inventory: NodeInventory | None = field(
        default=None,
        metadata=k8s(
            "The node's GPUs, NVLinks, RDMA NICs and health as its agent reported them "
            "(units: bytes, GB/s for HBM and NVLink, Gb/s for NICs, MHz, W)."
        ),
    )
    health: NodeHealth | None = field(default=None, metadata=k8s("Node health."))
    last_heartbeat_time: str | None = field(
        default=None,
        metadata=k8s("When the agent last reported (RFC 3339, UTC).", format="date-time"),
    )
    gpu_count: int | None = field(
        default=None, metadata=k8s("Number of GPUs in the inventory.", minimum=0)
    )
    gpu_summary: str | None = field(
        default=None,
        metadata=k8s("GPU models at a glance, e.g. '8x H100-SXM5-80GB'.", max_length=1024),
    )
    agent: AgentSession | None = field(default=None, metadata=k8s("The reporting agent's session."))


# ------------------------------------------------------------------- PlacementPolicy


@dataclass(frozen=True)
class RebalanceSpec:
    """When the controller re-plans a deployment because its measured expert load drifted
    (the same fields as the controller's deployment document)."""

    enabled: bool = field(default=False, metadata=k8s("Re-plan on sustained load imbalance."))
    imbalance_threshold: float = field(
        default=0.15,
        metadata=k8s(
            "(max - mean) / mean expert-phase time of the committed plan under the measured "
            "load above which a load window counts as imbalanced (0.15 = 15%).",
            minimum=0,
        ),
    )
    sustain_s: float = field(
        default=60.0,
        metadata=k8s(
            "The imbalance must hold over this many seconds of load windows, seconds.",
            json_name="sustainS",
            minimum=0,
        ),
    )
    min_interval_s: float = field(
        default=300.0,
        metadata=k8s(
            "Least time between two load-driven re-plans, seconds. Spec and fleet changes "
            "re-plan at once.",
            json_name="minIntervalS",
            minimum=0,
        ),
    )
    migration_weight_us: float = field(
        default=0.0,
        metadata=k8s(
            "Objective cost of moving one expert replica when re-planning, microseconds; "
            "0 = the solver's default.",
            minimum=0,
        ),
    )


@dataclass(frozen=True)
class InteractiveTierSpec:
    """An interactive (latency) tier: its SLO and traffic. Nodes are split between it and a
    batch tier by :func:`policies.advice.tier_planner.plan_tiers`; each interactive replica stays inside
    one NVLink domain."""

    tpot_ms: float | None = field(
        default=None,
        metadata=k8s(
            "Time-per-output-token target (decode step time), milliseconds.",
            json_name="tpotMs",
            minimum=0,
            exclusive_minimum=True,
        ),
    )
    ttft_ms: float | None = field(
        default=None,
        metadata=k8s(
            "Time-to-first-token target (prefill step time of a batch of prompts), milliseconds.",
            json_name="ttftMs",
            minimum=0,
            exclusive_minimum=True,
        ),
    )
    requests_per_s: float = field(
        default=0.0,
        metadata=k8s("Arrival rate the tier must serve, requests per second.", minimum=0),
    )
    prompt_tokens: int = field(
        default=2048, metadata=k8s("Prompt length per request, tokens.", minimum=1)
    )
    output_tokens: int = field(
        default=256, metadata=k8s("Generated tokens per request.", minimum=1)
    )
    max_utilisation: float = field(
        default=0.8,
        metadata=k8s(
            "Most of a replica's time the tier may keep busy (queueing headroom), 0-1.",
            minimum=0,
            exclusive_minimum=True,
            maximum=1,
        ),
    )
    preference: str = field(
        default="fastest",
        metadata=k8s(
            "fastest: the interactive tier takes the fastest nodes first; max-batch: the "
            "split that leaves the batch tier the most throughput.",
            enum=("fastest", "max-batch"),
        ),
    )

    K8S_RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            rule="has(self.tpotMs) || has(self.ttftMs)",
            message="an interactive tier needs tpotMs or ttftMs",
        ),
    )


@dataclass(frozen=True)
class PlacementPolicySpec:
    """How ModelDeployments that reference this policy are placed. A deployment's own
    fields (policy, redundantExperts, solverTimeLimitS, rebalance, allowCrossVendor,
    gpuHourPrices) override these."""

    policy: str = field(
        default=defaults.DEFAULT_POLICY,
        metadata=k8s(
            "Placement algorithm: ilp (optimal within the time limit), greedy, eplb or uniform.",
            enum=POLICIES,
        ),
    )
    milp_solver: str = field(
        default=defaults.DEFAULT_MILP_SOLVER,
        metadata=k8s("MILP solver for policy ilp: highs or cbc.", enum=defaults.MILP_SOLVERS),
    )
    solver_time_limit_s: float = field(
        default=defaults.DEFAULT_SOLVER_TIME_LIMIT_S,
        metadata=k8s(
            "Wall-clock limit of one solve, seconds.",
            json_name="solverTimeLimitS",
            minimum=0,
            exclusive_minimum=True,
            maximum=3600,
        ),
    )
    mip_gap: float = field(
        default=defaults.DEFAULT_MIP_GAP,
        metadata=k8s(
            "Relative MIP gap at which a layer's solve stops (0.005 = 0.5%).",
            minimum=0,
            maximum=0.999,
        ),
    )
    workers: int = field(
        default=defaults.DEFAULT_WORKERS,
        metadata=k8s("Processes solving layers in parallel; 0 = one per CPU.", minimum=0),
    )
    redundant_experts: int | None = field(
        default=None,
        metadata=k8s(
            "Extra expert slots per MoE layer beyond one per expert; unset = the smallest "
            "count the form allows. In engine form it is raised until num_experts + "
            "redundantExperts divides by the GPU count.",
            minimum=0,
            maximum=65536,
        ),
    )
    tiers: tuple[str, ...] = field(
        default=(),
        metadata=k8s(
            "GPUNode tiers (GPUNode.spec.tier) this policy may place on; empty = all.",
            list_type="set",
            max_items=64,
            item_pattern=DNS_LABEL,
            item_max_length=63,
        ),
    )
    rebalance: RebalanceSpec = field(
        default_factory=RebalanceSpec,
        metadata=k8s("Load-driven re-planning (applied by the controller)."),
    )
    interactive: InteractiveTierSpec | None = field(
        default=None,
        metadata=k8s(
            "An interactive tier with a latency SLO served by whole NVLink domains; the "
            "other nodes form the batch tier. Unset: one tier."
        ),
    )
    allow_cross_vendor: bool = field(
        default=False,
        metadata=k8s(
            "Let one deployment's expert-parallel all-to-all span GPU vendors (NVIDIA and "
            "AMD). Off: a MoE model on a mixed-vendor fleet is placed as one deployment per "
            "vendor."
        ),
    )
    gpu_hour_prices: Mapping[str, float] = field(
        default_factory=dict,
        metadata=k8s(
            "Price per GPU-hour by GPU model (catalog name), in USD; models not listed use "
            "mixfleet's assumed defaults. Reports cost per million tokens.",
            json_name="gpuHourPrices",
            max_properties=64,
            rules=(
                Rule(
                    rule="self.all(k, self[k] >= 0.0)",
                    message="prices per GPU-hour must be >= 0",
                ),
                CATALOG_KEYS_RULE,
            ),
        ),
    )


@dataclass(frozen=True)
class PlacementPolicyStatus:
    """Placement policies have no controller-written state yet."""

    observed_generation: int | None = field(
        default=None, metadata=k8s("Last metadata.generation seen.", minimum=0)
    )


# ------------------------------------------------------------------- ModelDeployment


@dataclass(frozen=True)
class WorkloadSpec:
    """What the model serves in one step (the controller's workload document)."""

    phase: str = field(
        default=defaults.DEFAULT_PHASE, metadata=k8s("prefill or decode.", enum=PHASES)
    )
    tokens_per_gpu: int | None = field(
        default=None,
        metadata=k8s(
            "Tokens per step per GPU on average (in decode, sequences per GPU). Unset: the "
            "phase's default, as on the command line ("
            f"{defaults.DEFAULT_TOKENS_PER_GPU['decode']} in decode, "
            f"{defaults.DEFAULT_TOKENS_PER_GPU['prefill']} in prefill).",
            minimum=1,
            maximum=1_048_576,
        ),
    )
    context_len: int = field(
        default=defaults.DEFAULT_CONTEXT_LEN,
        metadata=k8s(
            "Tokens of context each sequence holds (KV-cache length).",
            minimum=1,
            maximum=16_777_216,
        ),
    )
    kv_cache_dtype: str = field(
        default=defaults.DEFAULT_KV_CACHE_DTYPE,
        metadata=k8s("KV-cache dtype: bf16 or fp8.", json_name="kvCacheDtype", enum=KV_DTYPES),
    )
    load: str = field(
        default="uniform",
        metadata=k8s(
            "Expert load to plan for: uniform, synthetic:zipf:S[:seed=N] (skewed), or "
            "measured (the load engines report to the controller; uniform until then).",
            pattern=r"^(uniform|measured|synthetic:zipf:[0-9]+(\.[0-9]+)?(:seed=[0-9]+)?)$",
            max_length=128,
        ),
    )
    load_matrix: tuple[tuple[float, ...], ...] | None = field(
        default=None,
        metadata=k8s(
            "Explicit [layers][experts] load (token counts); overrides load when set.",
            max_items=1024,
        ),
    )


#: Every all-to-all backend some engine has, ``auto`` first (which fits which engine is
#: :data:`ENGINE_BACKEND_RULE`'s).
A2A_BACKEND_CHOICES = ("auto", *dict.fromkeys(b for bs in A2A_BACKENDS.values() for b in bs))
ENGINE_BACKEND_RULE = Rule(
    rule="self.options.a2aBackend == 'auto' || "
    + " || ".join(
        f"(self.name == '{e}' && self.options.a2aBackend in [{', '.join(repr(b) for b in bs)}])"
        for e, bs in A2A_BACKENDS.items()
    ),
    message="options.a2aBackend must be auto or one of the engine's backends: "
    + "; ".join(f"{e}: {', '.join(bs)}" for e, bs in A2A_BACKENDS.items()),
)


@dataclass(frozen=True)
class EngineOptions:
    """The engine settings that change how a plan executes (:mod:`policies.estimate.engines`)."""

    a2a_backend: str = field(
        default="auto",
        metadata=k8s(
            "All-to-all backend of the expert-parallel group (SGLang --moe-a2a-backend, vLLM "
            "--all2all-backend); auto picks the first that every GPU of the group supports.",
            json_name="a2aBackend",
            enum=A2A_BACKEND_CHOICES,
        ),
    )
    dispatch: str = field(
        default="auto",
        metadata=k8s(
            "Replica choice (SGLang --ep-dispatch-algorithm): auto, static or dynamic; vLLM "
            "and TensorRT-LLM accept only auto (their rule is fixed).",
            enum=DISPATCH_OPTIONS,
        ),
    )
    dp_balance: str = field(
        default="auto",
        metadata=k8s(
            "Who sets each DP attention rank's token share: router (the mixfleet router pins "
            "each request's rank to apply the planned weights), engine (the engine's own "
            "balancer: equal shares, and the plan is solved for that) or auto (router, except "
            "engine for trtllm, whose HTTP API takes no per-request rank).",
            json_name="dpBalance",
            enum=DP_BALANCE_OPTIONS,
        ),
    )


@dataclass(frozen=True)
class EngineSpec:
    """The engine that will run the plan; the plan is scored and solved under its replica
    choice and DP balancing."""

    name: str = field(
        default="native",
        metadata=k8s(
            "native (idealised: no engine executes these shares), sglang, vllm or trtllm.",
            enum=ENGINES,
        ),
    )
    version: str = field(
        default="",
        metadata=k8s(
            "Engine version; empty = the version mixfleet's engine model is pinned to.",
            pattern=r"^[0-9A-Za-z][0-9A-Za-z.+_-]*$|^$",
            max_length=64,
        ),
    )
    options: EngineOptions = field(
        default_factory=EngineOptions, metadata=k8s("Behaviour-changing engine settings.")
    )

    K8S_RULES: ClassVar[tuple[Rule, ...]] = (
        ENGINE_BACKEND_RULE,
        Rule(
            "self.options.dispatch == 'auto' || self.name == 'sglang'",
            "options.dispatch static or dynamic is SGLang's; vLLM and TensorRT-LLM fix their "
            "replica choice and native uses the planned shares. To fix: set dispatch: auto",
        ),
    )


@dataclass(frozen=True)
class PolicyRef:
    """A reference to a cluster-scoped PlacementPolicy."""

    name: str = field(metadata=k8s("PlacementPolicy name.", pattern=DNS_LABEL, max_length=63))


@dataclass(frozen=True)
class LengthDistSpec:
    """A token-length distribution: mean and p90 (a lognormal fitted to both), or a
    histogram (policies.serving.traffic)."""

    mean: float | None = field(
        default=None,
        metadata=k8s("Mean length, tokens.", minimum=1, maximum=16_777_216),
    )
    p90: float | None = field(
        default=None,
        metadata=k8s(
            "90th percentile, tokens (>= mean, at most 2.27x mean); unset = the mean.",
            minimum=1,
            maximum=16_777_216,
        ),
    )
    histogram: tuple[tuple[float, ...], ...] | None = field(
        default=None,
        metadata=k8s("[length tokens, weight] pairs; replaces mean and p90.", max_items=4096),
    )

    K8S_RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.mean) != has(self.histogram)",
            "set mean (and p90) or a histogram, one of the two",
        ),
    )
    #: No ``default: {}`` where it is a field: the empty object fails the rule above, and
    #: kube-apiserver refuses a CRD whose defaults fail their own validation rules.
    K8S_DEFAULT_EMPTY: ClassVar[bool] = False


@dataclass(frozen=True)
class TrafficSpec:
    """The demand a deployment must serve (policies.serving.traffic.Traffic)."""

    requests_per_s: float | None = field(
        default=None,
        metadata=k8s(
            "Mean arrival rate, requests per second.",
            json_name="requestsPerS",
            minimum=0,
            exclusive_minimum=True,
        ),
    )
    output_tokens_per_s: float | None = field(
        default=None,
        metadata=k8s(
            "The demand as output tokens per second (instead of requestsPerS).",
            json_name="outputTokensPerS",
            minimum=0,
            exclusive_minimum=True,
        ),
    )
    input_tokens: LengthDistSpec = field(
        default_factory=LengthDistSpec, metadata=k8s("Prompt length distribution.")
    )
    output_tokens: LengthDistSpec = field(
        default_factory=LengthDistSpec, metadata=k8s("Output length distribution.")
    )
    arrival: str = field(
        default="poisson",
        metadata=k8s(
            "poisson (exponential gaps) or bursty (gamma gaps with burstCv).",
            enum=("poisson", "bursty"),
        ),
    )
    burst_cv: float | None = field(
        default=None,
        metadata=k8s(
            "Bursty: coefficient of variation of the gaps between arrivals (> 1); unset = 2.",
            json_name="burstCv",
            minimum=1,
            exclusive_minimum=True,
            maximum=100,
        ),
    )

    K8S_RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.requestsPerS) != has(self.outputTokensPerS)",
            "set requestsPerS or outputTokensPerS, one of the two",
        ),
    )


@dataclass(frozen=True)
class SloSpec:
    """Latency targets at a percentile of requests (policies.serving.traffic.Slo)."""

    ttft_ms: float | None = field(
        default=None,
        metadata=k8s(
            "Time to first token, ms; unset = no target.",
            json_name="ttftMs",
            minimum=0,
            exclusive_minimum=True,
        ),
    )
    tpot_ms: float | None = field(
        default=None,
        metadata=k8s(
            "Time per output token after the first, ms; unset = no target.",
            json_name="tpotMs",
            minimum=0,
            exclusive_minimum=True,
        ),
    )
    percentile: float = field(
        default=90.0,
        metadata=k8s(
            "Percentile of requests the targets hold for, in (0, 100).",
            minimum=0,
            exclusive_minimum=True,
            rules=(Rule("self < 100.0", "percentile must be below 100"),),
        ),
    )


@dataclass(frozen=True)
class BudgetSpec:
    """The most a deployment may cost or take; either limit or both."""

    usd_per_hour: float | None = field(
        default=None,
        metadata=k8s(
            "Most its instances may cost, USD per hour.", json_name="usdPerHour", minimum=0
        ),
    )
    gpus: int | None = field(default=None, metadata=k8s("Most GPUs it may take.", minimum=1))


@dataclass(frozen=True)
class ModelDeploymentSpec:
    """A model to place on the GPU fleet. The same document mixfleetctl deploy apply reads,
    plus policyRef and engineFormat."""

    model: str | None = field(
        default=None,
        metadata=k8s(
            "Model preset, e.g. qwen3-30b-a3b or deepseek-v3 (mixfleetctl model list).",
            pattern=r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$",
            max_length=63,
        ),
    )
    model_config: dict[str, Any] | None = field(
        default=None,
        metadata=k8s(
            "Inline Hugging Face config.json instead of a preset (model_type deepseek_v3, "
            "deepseek_v2, qwen3_moe, mixtral, gpt_oss or llama)."
        ),
    )
    workload: WorkloadSpec = field(
        default_factory=WorkloadSpec, metadata=k8s("Batch shape, phase and expert load.")
    )
    policy_ref: PolicyRef | None = field(
        default=None,
        metadata=k8s(
            "PlacementPolicy supplying solver settings; unset = the operator's default "
            "policy (the chart creates one named 'default'), else built-in defaults."
        ),
    )
    policy: str | None = field(
        default=None,
        metadata=k8s("Placement algorithm; overrides the PlacementPolicy's.", enum=POLICIES),
    )
    form: str = field(
        default=defaults.DEFAULT_FORM,
        metadata=k8s(
            "Plan form: engine (equal slots per GPU, what engines load today) or native "
            "(any slots per GPU, unequal token shares).",
            enum=FORMS,
        ),
    )
    engine: EngineSpec | None = field(
        default=None,
        metadata=k8s(
            "The engine that will run the plan (name, version, options); unset = native "
            "(idealised: planned shares that no engine executes)."
        ),
    )
    engine_format: str = field(
        default="sglang",
        metadata=k8s(
            "Engine file published in the deployment's ConfigMap: sglang "
            "(--init-expert-location JSON), vllm (EPLB state), trtllm (MoE load balancer "
            "config) or none.",
            enum=ENGINE_FORMATS,
        ),
    )
    redundant_experts: int | None = field(
        default=None,
        metadata=k8s(
            "Extra expert slots per MoE layer; overrides the PlacementPolicy's. Engine "
            "form raises it until num_experts + redundantExperts divides by the GPU count.",
            minimum=0,
            maximum=65536,
        ),
    )
    node_selector: dict[str, str] = field(
        default_factory=dict,
        metadata=k8s(
            "Labels a GPUNode must carry, all of them, to be used; empty selects all.",
            max_properties=64,
        ),
    )
    solver_time_limit_s: float | None = field(
        default=None,
        metadata=k8s(
            "Solve wall-clock limit, seconds; overrides the PlacementPolicy's.",
            json_name="solverTimeLimitS",
            minimum=0,
            exclusive_minimum=True,
            maximum=3600,
        ),
    )
    prepare_timeout_s: float | None = field(
        default=None,
        metadata=k8s(
            "Rollout prepare deadline of the controller, seconds (controller default 30).",
            json_name="prepareTimeoutS",
            minimum=0,
            exclusive_minimum=True,
        ),
    )
    rebalance: RebalanceSpec | None = field(
        default=None,
        metadata=k8s("Load-driven re-planning; overrides the PlacementPolicy's."),
    )
    allow_cross_vendor: bool | None = field(
        default=None,
        metadata=k8s(
            "Let this deployment's expert-parallel all-to-all span GPU vendors (NVIDIA and "
            "AMD); overrides the PlacementPolicy's. Unset: the policy's."
        ),
    )
    gpu_hour_prices: dict[str, float] = field(
        default_factory=dict,
        metadata=k8s(
            "Price per GPU-hour by GPU model (catalog name), in USD; entries replace the "
            "PlacementPolicy's and mixfleet's assumed defaults in "
            "status.costPerMillionTokensUSD.",
            json_name="gpuHourPrices",
            max_properties=64,
            rules=(
                Rule(
                    rule="self.all(k, self[k] >= 0.0)",
                    message="prices per GPU-hour must be >= 0",
                ),
                CATALOG_KEYS_RULE,
            ),
        ),
    )
    priority: int = field(
        default=0,
        metadata=k8s(
            "Fleet scheduler priority: higher is placed first and may preempt lower "
            "deployments (gracefully drained).",
            minimum=-1000000,
            maximum=1000000,
        ),
    )
    min_gpus: int = field(
        default=0,
        metadata=k8s("Fewest GPUs the deployment may run on; 0 = what its model needs.", minimum=0),
    )
    max_gpus: int = field(
        default=0,
        metadata=k8s("Most GPUs the scheduler may assign it; 0 = no limit.", minimum=0),
    )
    objective: str = field(
        default="throughput",
        metadata=k8s(
            "What its share of the fleet is chosen for: throughput (tokens/s), cost (tokens "
            "per dollar) or slo (tokens/s within sloStepTimeMs).",
            enum=("throughput", "cost", "slo"),
        ),
    )
    slo_step_time_ms: float = field(
        default=0.0,
        metadata=k8s(
            "Step-time target of objective slo (decode: time per output token), ms; 0 = none.",
            json_name="sloStepTimeMs",
            minimum=0,
        ),
    )
    memory_fraction: float = field(
        default=1.0,
        metadata=k8s(
            "Share of each GPU's memory it takes; 1 = exclusive GPUs, below 1 it may share "
            "nodes with others that declare a fraction (the fractions on a node sum to <= 1).",
            minimum=0,
            exclusive_minimum=True,
            maximum=1,
        ),
    )
    namespace: str = field(
        default="default",
        metadata=k8s(
            "Quota namespace of the fleet scheduler's per-namespace GPU quotas.",
            pattern=DNS_LABEL,
            max_length=63,
        ),
    )
    traffic: TrafficSpec | None = field(
        default=None,
        metadata=k8s(
            "Demand to serve: requestsPerS or outputTokensPerS, inputTokens and outputTokens "
            "({mean, p90} or {histogram}), arrival. Unset: planned for workload.tokensPerGpu."
        ),
    )
    slo: SloSpec | None = field(
        default=None, metadata=k8s("Latency targets (TTFT, TPOT) at a percentile.")
    )
    disaggregation: str = field(
        default="auto",
        metadata=k8s(
            "Prefill and decode on separate instances: auto (the planner decides), off or on "
            '(needs traffic). Quote off and on in YAML ("on"): bare, they read as booleans.',
            enum=("auto", "off", "on"),
        ),
    )
    budget: BudgetSpec | None = field(
        default=None, metadata=k8s("Most it may cost (usdPerHour) or take (gpus).")
    )

    K8S_RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "has(self.model) != has(self.modelConfig)",
            "set exactly one of spec.model (a preset) and spec.modelConfig",
        ),
        Rule(
            "self.form == 'engine' || self.engineFormat == 'none'",
            "engineFormat needs form: engine (engines assume equal expert slots per GPU); "
            "set engineFormat: none for a native plan",
        ),
        Rule(
            "!has(self.engine) || self.engine.name == 'native' || self.engineFormat == 'none' "
            "|| self.engineFormat == self.engine.name",
            "engineFormat must be the engine's own file (or none): the plan is predicted "
            "under spec.engine. To fix: set engineFormat to spec.engine.name",
        ),
    )


@dataclass(frozen=True)
class PlanRef:
    """The PartitionPlan a ModelDeployment currently serves."""

    name: str = field(metadata=k8s("PartitionPlan name.", max_length=253))
    plan_id: str = field(
        metadata=k8s("Content hash of the placement.", json_name="planID", pattern=HEX16)
    )
    version: int = field(metadata=k8s("Plan version (grows per deployment).", minimum=1))


@dataclass(frozen=True)
class SolveRecord:
    """The last solve attempt, so a failed spec is not re-solved in a hot loop."""

    inputs_digest: str = field(
        metadata=k8s(
            "Digest of everything the solve read (spec, policy, eligible nodes).",
            pattern=HEX16,
        )
    )
    outcome: str = field(metadata=k8s("Succeeded or Failed.", enum=SOLVE_OUTCOMES))
    reason: str = field(metadata=k8s("Condition reason of the outcome.", max_length=1024))
    time: str = field(metadata=k8s("When the solve finished (RFC 3339).", format="date-time"))
    duration_s: float = field(
        default=0.0,
        metadata=k8s("Wall time of the solve, seconds.", json_name="durationSeconds", minimum=0),
    )


@dataclass(frozen=True)
class TierReplica:
    """One interactive replica: an independent copy of the model on one NVLink domain."""

    nodes: tuple[str, ...] = field(
        metadata=k8s("GPUNodes of the replica (one NVLink domain).", max_items=MAX_PLAN_NODES)
    )
    gpu_model: str = field(metadata=k8s("GPU catalog model.", max_length=63))
    gpus: int = field(metadata=k8s("GPUs in the replica.", minimum=1))
    decode_tokens_per_gpu: int = field(
        metadata=k8s("Largest decode batch meeting the TPOT target, sequences per GPU.", minimum=1)
    )
    prefill_tokens_per_gpu: int = field(
        metadata=k8s("Largest prefill batch meeting the TTFT target, tokens per GPU.", minimum=1)
    )
    tpot_ms: float = field(
        metadata=k8s("Predicted decode step time, milliseconds.", json_name="tpotMs", minimum=0)
    )
    ttft_ms: float = field(
        metadata=k8s("Predicted prefill step time, milliseconds.", json_name="ttftMs", minimum=0)
    )
    requests_per_s: float = field(
        metadata=k8s(
            "Requests per second the replica serves within the SLO.",
            json_name="requestsPerSecond",
            minimum=0,
        )
    )


@dataclass(frozen=True)
class TierAddition:
    """More nodes of one catalog GPU that would let the interactive tier meet its SLO."""

    gpu_model: str = field(metadata=k8s("GPU catalog model.", max_length=63))
    nodes: int = field(metadata=k8s("Nodes to add.", minimum=1))
    gpus_per_node: int = field(metadata=k8s("GPUs per added node.", minimum=1))
    usd_per_hour: float | None = field(
        default=None,
        metadata=k8s(
            "Price of the added nodes at gpuHourPrices, USD per hour.",
            json_name="usdPerHour",
            minimum=0,
        ),
    )


@dataclass(frozen=True)
class TiersStatus:
    """The split between the interactive tier (its SLO from the PlacementPolicy) and the batch
    tier (the deployment's own plan), as last planned."""

    inputs_digest: str = field(
        metadata=k8s(
            "Digest of everything the split read (tier, spec, policy, eligible nodes, prices).",
            pattern=HEX16,
        )
    )
    outcome: str = field(metadata=k8s("Succeeded or Failed.", enum=SOLVE_OUTCOMES))
    reason: str = field(
        metadata=k8s("InteractiveSLO condition reason of the outcome.", max_length=1024)
    )
    message: str = field(metadata=k8s("What the split found, for a person.", max_length=8192))
    time: str = field(metadata=k8s("When the split was planned (RFC 3339).", format="date-time"))
    slo_met: bool = field(
        default=False,
        metadata=k8s("The interactive replicas serve the requested rate within the SLO."),
    )
    demand_requests_per_s: float = field(
        default=0.0,
        metadata=k8s(
            "Requested rate, requests per second.",
            json_name="demandRequestsPerSecond",
            minimum=0,
        ),
    )
    capacity_requests_per_s: float = field(
        default=0.0,
        metadata=k8s(
            "What the replicas serve within the SLO together, requests per second.",
            json_name="capacityRequestsPerSecond",
            minimum=0,
        ),
    )
    interactive_nodes: tuple[str, ...] = field(
        default=(),
        metadata=k8s(
            "GPUNodes reserved for interactive replicas (left out of the deployment's plan).",
            max_items=MAX_PLAN_NODES,
        ),
    )
    batch_nodes: tuple[str, ...] = field(
        default=(),
        metadata=k8s(
            "GPUNodes of the batch tier: the deployment's own plan.", max_items=MAX_PLAN_NODES
        ),
    )
    replicas: tuple[TierReplica, ...] = field(
        default=(),
        metadata=k8s("Interactive replicas, one per NVLink domain.", max_items=MAX_PLAN_NODES),
    )
    additions: tuple[TierAddition, ...] = field(
        default=(),
        metadata=k8s(
            "When the SLO is not met: nodes of one GPU model that would close the gap, "
            "cheapest first (any one of them).",
            max_items=32,
        ),
    )
    duration_s: float = field(
        default=0.0,
        metadata=k8s("Wall time of the split, seconds.", json_name="durationSeconds", minimum=0),
    )


MAX_INSTANCES = 256
"""Most engine instances one ModelDeployment lists in its status."""


@dataclass(frozen=True)
class InstanceSummary:
    """One engine instance of a ModelDeployment planned from its traffic and SLOs: a child
    ModelDeployment the operator owns (label ``mixfleet.io/instance-of``)."""

    name: str = field(metadata=k8s("The instance's ModelDeployment.", max_length=63))
    role: str = field(metadata=k8s("aggregated, prefill or decode.", enum=defaults.INSTANCE_ROLES))
    pool: str = field(
        metadata=k8s("Its pool (a prefill/decode pool's instances pair up).", max_length=253)
    )
    variant: str = field(
        default="", metadata=k8s("The fleet planner's variant (make-up/role).", max_length=253)
    )
    nodes: tuple[str, ...] = field(
        default=(), metadata=k8s("Its GPUNodes, rank order.", max_items=MAX_PLAN_NODES)
    )
    version: int | None = field(
        default=None, metadata=k8s("Version of the instance's current plan.", minimum=1)
    )
    requests_per_s: float = field(
        default=0.0,
        metadata=k8s(
            "Traffic the plan sends it, requests per second.",
            json_name="requestsPerSecond",
            minimum=0,
        ),
    )
    capacity_requests_per_s: float = field(
        default=0.0,
        metadata=k8s(
            "What it serves within the SLO, requests per second.",
            json_name="capacityRequestsPerSecond",
            minimum=0,
        ),
    )
    ttft_ms: float = field(
        default=0.0,
        metadata=k8s(
            "Its pool's predicted TTFT at the SLO percentile, milliseconds.",
            json_name="ttftMs",
            minimum=0,
        ),
    )
    tpot_ms: float = field(
        default=0.0,
        metadata=k8s("Its pool's predicted TPOT, milliseconds.", json_name="tpotMs", minimum=0),
    )
    ready: bool = field(
        default=False, metadata=k8s("Every node of the instance committed its current plan.")
    )
    retiring: bool = field(
        default=False,
        metadata=k8s(
            "The fleet plan no longer has it; it keeps serving until the instances that "
            "replace it are ready, then drains."
        ),
    )
    draining: bool = field(
        default=False,
        metadata=k8s(
            "The fleet plan no longer has it and routers send it no new request; it is "
            "removed once the drain grace has passed."
        ),
    )


@dataclass(frozen=True)
class InstanceRecordStatus:
    """What an instance's ModelDeployment is, written by the operator into its own status:
    the same record the standalone controller keeps (the controller reads it through its
    Kubernetes store)."""

    of: str = field(metadata=k8s("The ModelDeployment it serves.", max_length=63))
    role: str = field(metadata=k8s("aggregated, prefill or decode.", enum=defaults.INSTANCE_ROLES))
    pool: str = field(metadata=k8s("Its pool.", max_length=253))
    variant: str = field(default="", metadata=k8s("The fleet planner's variant.", max_length=253))
    nodes: tuple[str, ...] = field(
        default=(), metadata=k8s("Its GPUNodes, rank order.", max_items=MAX_PLAN_NODES)
    )
    port: int = field(
        default=0, metadata=k8s("Its engine's HTTP port (TCP).", minimum=0, maximum=65535)
    )
    bootstrap_port: int = field(
        default=0,
        metadata=k8s(
            "A prefill instance's SGLang bootstrap port (TCP; 0 otherwise).",
            minimum=0,
            maximum=65535,
        ),
    )
    requests_per_s: float = field(
        default=0.0,
        metadata=k8s(
            "Traffic the plan sends it, requests per second.",
            json_name="requestsPerS",
            minimum=0,
        ),
    )
    batch_limit: int = field(
        default=0,
        metadata=k8s("Most sequences it runs (prefill: prompt tokens per forward).", minimum=0),
    )
    capacity_requests_per_s: float = field(
        default=0.0,
        metadata=k8s(
            "What it serves within the SLO, requests per second.",
            json_name="capacityRequestsPerS",
            minimum=0,
        ),
    )
    ttft_ms: float = field(
        default=0.0,
        metadata=k8s(
            "Its pool's predicted TTFT at the SLO percentile, milliseconds.",
            json_name="ttftMs",
            minimum=0,
        ),
    )
    tpot_ms: float = field(
        default=0.0,
        metadata=k8s("Its pool's predicted TPOT, milliseconds.", json_name="tpotMs", minimum=0),
    )
    retiring: bool = field(
        default=False,
        metadata=k8s(
            "The fleet plan no longer has it, but it keeps serving (routers still send it "
            "requests) until every new or changed instance of its ModelDeployment is ready, "
            "or until an instance that replaces it needs its GPUNodes on a full fleet; then "
            "it drains."
        ),
    )
    draining: bool = field(
        default=False,
        metadata=k8s(
            "Routers send it no new request; its open requests finish, and it is deleted "
            "once the operator's drain grace has passed since drainingSinceS."
        ),
    )
    draining_since_s: float = field(
        default=0.0,
        metadata=k8s(
            "When it began draining, Unix seconds (0 unless draining); kept in status, so a "
            "restarted operator keeps the grace.",
            json_name="drainingSinceS",
            minimum=0,
        ),
    )
    kv_path: str = field(
        default="",
        metadata=k8s(
            "Prefill/decode: its pool's KV path in the planner's words (RDMA ib0); "
            "empty for an aggregated instance.",
            json_name="kvPath",
            max_length=253,
        ),
    )


@dataclass(frozen=True)
class ModelDeploymentStatus:
    """What the operator observed, rebuilt from the world on every reconcile."""

    observed_generation: int | None = field(
        default=None,
        metadata=k8s("metadata.generation this status describes.", minimum=0),
    )
    conditions: tuple[Condition, ...] = field(
        default=(),
        metadata=k8s(
            "Solved, RolledOut, Degraded, (with an interactive tier) InteractiveSLO and (a "
            "deployment planned from its traffic and SLOs) Ready and DemandServed.",
            list_type="map",
            list_map_keys=("type",),
            max_items=16,
        ),
    )
    current_plan: PlanRef | None = field(
        default=None, metadata=k8s("The plan engines and agents should run.")
    )
    predicted_step_time_us: float | None = field(
        default=None,
        metadata=k8s("Predicted time of one forward step, microseconds.", minimum=0),
    )
    predicted_tokens_per_s: float | None = field(
        default=None,
        metadata=k8s(
            "Predicted throughput, tokens per second.",
            json_name="predictedTokensPerSecond",
            minimum=0,
        ),
    )
    cost_per_hour_usd: float | None = field(
        default=None,
        metadata=k8s(
            "The current plan's GPUs for one hour at gpuHourPrices, USD.",
            json_name="costPerHourUSD",
            minimum=0,
        ),
    )
    cost_per_million_tokens_usd: float | None = field(
        default=None,
        metadata=k8s(
            "Cost of a million tokens at the predicted throughput: costPerHourUSD / "
            "(predictedTokensPerSecond * 3600) * 1e6, USD. Unset when a GPU has no price.",
            json_name="costPerMillionTokensUSD",
            minimum=0,
        ),
    )
    tiers: TiersStatus | None = field(
        default=None,
        metadata=k8s(
            "Interactive / batch split, when the PlacementPolicy defines an interactive tier."
        ),
    )
    gpus: int | None = field(default=None, metadata=k8s("GPUs in the current plan.", minimum=0))
    assigned_gpus: int | None = field(
        default=None,
        metadata=k8s("GPUs the fleet scheduler assigns this deployment (exclusive).", minimum=0),
    )
    nodes: tuple[str, ...] = field(
        default=(),
        metadata=k8s("GPUNodes in the current plan.", max_items=MAX_PLAN_NODES),
    )
    config_map: str | None = field(
        default=None,
        metadata=k8s("ConfigMap holding the engine export of the current plan.", max_length=253),
    )
    last_solve: SolveRecord | None = field(default=None, metadata=k8s("Last solve attempt."))
    committed_version: int | None = field(
        default=None,
        metadata=k8s(
            "Plan version the controller committed (every agent switched to it); written "
            "by the controller.",
            minimum=1,
        ),
    )
    controller: dict[str, Any] | None = field(
        default=None,
        metadata=k8s(
            "The controller's own status document (rollout, rebalancing, and under demand "
            "the measured demand and the traffic chosen after a drift, which the operator "
            "plans a planned deployment for)."
        ),
    )
    instances: tuple[InstanceSummary, ...] = field(
        default=(),
        metadata=k8s(
            "A deployment planned from its traffic and SLOs: its engine instances, each a "
            "ModelDeployment the operator owns.",
            max_items=MAX_INSTANCES,
        ),
    )
    instances_ready: str | None = field(
        default=None,
        metadata=k8s("Ready instances of all, READY/ALL (a planned deployment).", max_length=16),
    )
    planned_requests_per_s: float | None = field(
        default=None,
        metadata=k8s(
            "Requests per second the fleet plan serves within the SLO (a planned deployment).",
            json_name="plannedRequestsPerSecond",
            minimum=0,
        ),
    )
    demand_requests_per_s: float | None = field(
        default=None,
        metadata=k8s(
            "The demand it is planned for, requests per second (a planned deployment): its "
            "stated one, or after a sustained drift the measured one the controller chose "
            "(demandFrom Measured; status.controller.demand).",
            json_name="demandRequestsPerSecond",
            minimum=0,
        ),
    )
    demand_from: str | None = field(
        default=None,
        metadata=k8s(
            "Where demandRequestsPerSecond comes from (a planned deployment): Spec (the "
            "stated traffic) or Measured (the routers' measured traffic, after a sustained "
            "drift: status.controller.demand.planned).",
            enum=("Spec", "Measured"),
        ),
    )
    planned_attainment: float | None = field(
        default=None,
        metadata=k8s(
            "Share of the demand it is planned for that the fleet plan serves within the "
            "SLO, 0-1 (plannedRequestsPerSecond / demandRequestsPerSecond; a planned "
            "deployment).",
            minimum=0,
            maximum=1,
        ),
    )
    instance: InstanceRecordStatus | None = field(
        default=None,
        metadata=k8s("An engine instance: which deployment it serves and as what."),
    )


# --------------------------------------------------------------------- PartitionPlan


@dataclass(frozen=True)
class PlanGpu:
    """One GPU of a plan at a glance (the full plan is in ``data``)."""

    gpu: str = field(metadata=k8s("GPU id, node/gpuN.", max_length=260))
    node: str = field(metadata=k8s("GPUNode name.", max_length=253))
    model: str = field(metadata=k8s("GPU catalog model.", max_length=63))
    attention_share: float = field(
        metadata=k8s(
            "Fraction of the step's tokens whose attention it computes.", minimum=0, maximum=1
        )
    )
    dp_weight: float = field(
        metadata=k8s(
            "Data-parallel router weight (mean 1 over ranks).", json_name="dpWeight", minimum=0
        )
    )


@dataclass(frozen=True)
class PartitionPlanSpec:
    """One plan version of a ModelDeployment; immutable once written."""

    deployment: str = field(
        metadata=k8s("Owning ModelDeployment (same namespace).", pattern=DNS_LABEL, max_length=63)
    )
    plan_id: str = field(
        metadata=k8s("Content hash of the placement.", json_name="planID", pattern=HEX16)
    )
    version: int = field(metadata=k8s("Plan version, grows per deployment.", minimum=1))
    model: str = field(metadata=k8s("Model name.", max_length=253))
    form: str = field(metadata=k8s("engine or native.", enum=FORMS))
    policy: str = field(metadata=k8s("Placement algorithm that made it.", enum=POLICIES))
    inputs_digest: str = field(
        metadata=k8s(
            "Fingerprint of the solve's inputs (spec, policy, nodes); the operator re-solves "
            "when its own plans' fingerprint no longer matches.",
            max_length=256,
        )
    )
    deployment_generation: int = field(
        metadata=k8s("ModelDeployment metadata.generation it was solved for.", minimum=0)
    )
    nodes: tuple[str, ...] = field(
        metadata=k8s(
            "GPUNodes the plan places on.",
            list_type="set",
            max_items=MAX_PLAN_NODES,
            item_max_length=253,
        )
    )
    gpus: tuple[PlanGpu, ...] = field(
        metadata=k8s("Per-GPU summary in rank order.", max_items=MAX_PLAN_GPUS)
    )
    step_time_us: float = field(metadata=k8s("Predicted step time, microseconds.", minimum=0))
    tokens_per_s: float = field(
        metadata=k8s(
            "Predicted throughput, tokens per second.", json_name="tokensPerSecond", minimum=0
        )
    )
    data: str = field(
        metadata=k8s(
            "The full plan (policies.plan.Plan.to_dict JSON), compressed as 'encoding' says.",
            min_length=1,
            max_length=MAX_PLAN_DATA_CHARS,
        )
    )
    data_sha256: str = field(
        metadata=k8s("SHA-256 of the uncompressed plan JSON, hex.", pattern=r"^[0-9a-f]{64}$")
    )
    uncompressed_bytes: int = field(
        metadata=k8s("Size of the uncompressed plan JSON, bytes.", minimum=0)
    )
    encoding: str = field(
        default="gzip+base64",
        metadata=k8s("How data is encoded: gzip, then base64.", enum=PLAN_ENCODINGS),
    )
    made_by: str = field(
        default="operator",
        metadata=k8s(
            "Who solved it: operator (spec or fleet changed) or controller (load rebalance).",
            enum=PLAN_AUTHORS,
        ),
    )
    reason: str = field(default="", metadata=k8s("Why this version was made.", max_length=1024))


@dataclass(frozen=True)
class NodeRollout:
    """Rollout state of one node's part of a plan (two-phase: prepared, then committed)."""

    node: str = field(metadata=k8s("GPUNode name.", max_length=253))
    state: str = field(
        metadata=k8s("Pending, Prepared, Committed, Failed or Aborted.", enum=ROLLOUT_STATES)
    )
    reason: str = field(default="", metadata=k8s("Why (for Failed and Aborted).", max_length=1024))
    message: str = field(default="", metadata=k8s("Details, for a person.", max_length=4096))
    last_transition_time: str | None = field(
        default=None, metadata=k8s("When the state last changed (RFC 3339).", format="date-time")
    )


@dataclass(frozen=True)
class AckRecord:
    """One acknowledgement of an agent for this plan (the controller's ack log)."""

    node: str = field(metadata=k8s("GPUNode name.", max_length=253))
    state: str = field(
        metadata=k8s("Prepared, Committed or Failed.", enum=("Prepared", "Committed", "Failed"))
    )
    at: str = field(metadata=k8s("When it was received (RFC 3339).", format="date-time"))
    reason: str = field(default="", metadata=k8s("Why (for Failed).", max_length=4096))


@dataclass(frozen=True)
class PartitionPlanStatus:
    """Rollout of the plan, written by the controller as agents acknowledge it."""

    state: str | None = field(
        default=None,
        metadata=k8s(
            "Proposed, Preparing, Committed, Aborted or Superseded (two-phase rollout).",
            enum=PLAN_STATES,
        ),
    )
    reason: str = field(
        default="",
        metadata=k8s("Why it is in this state (e.g. why it was aborted).", max_length=4096),
    )
    state_changed_time: str | None = field(
        default=None, metadata=k8s("When the state last changed (RFC 3339).", format="date-time")
    )
    prepare_deadline: str | None = field(
        default=None,
        metadata=k8s("While Preparing: when the rollout times out (RFC 3339).", format="date-time"),
    )
    nodes: tuple[NodeRollout, ...] = field(
        default=(),
        metadata=k8s(
            "Per-node rollout state; each writer owns its nodes' entries.",
            list_type="map",
            list_map_keys=("node",),
            max_items=MAX_PLAN_NODES,
        ),
    )
    acks: tuple[AckRecord, ...] = field(
        default=(),
        metadata=k8s(
            "Every acknowledgement received, oldest first (one per node and state).",
            list_type="map",
            list_map_keys=("node", "state"),
            max_items=4 * MAX_PLAN_NODES,
        ),
    )


# ------------------------------------------------------------------------ CRD manifests


@dataclass(frozen=True)
class PrinterColumn:
    """An ``additionalPrinterColumns`` entry (what ``kubectl get`` shows).

    Attributes:
        name: column header.
        type: string | integer | number | boolean | date.
        json_path: JSONPath into the object (``.status.gpus``).
        description: what the column shows.
        priority: 0 = default view, 1 = ``-o wide`` only.
    """

    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0


@dataclass(frozen=True)
class CrdDef:
    """One custom resource type.

    Attributes:
        kind: CamelCase kind.
        plural, singular: resource names.
        short_names: ``kubectl get`` abbreviations.
        scope: ``Cluster`` or ``Namespaced``.
        spec, status: the dataclasses of spec and status.
        description: what the resource is.
        columns: printer columns.
        spec_rules: CEL rules on the whole spec (immutability).
        spec_required: whether ``spec`` must be present.
        max_name_length: longest ``metadata.name``, characters (names that become label
            values must fit 63).
    """

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    scope: str
    spec: type
    status: type
    description: str
    columns: tuple[PrinterColumn, ...] = ()
    spec_rules: tuple[Rule, ...] = ()
    spec_required: bool = True
    max_name_length: int | None = None

    @property
    def name(self) -> str:
        return f"{self.plural}.{GROUP}"

    @property
    def namespaced(self) -> bool:
        return self.scope == "Namespaced"

    def schema(self) -> Json:
        """The ``openAPIV3Schema`` of the CRD's one version."""
        spec = openapi_schema(self.spec, constraints=INVENTORY_CONSTRAINTS)
        spec["description"] = spec.get("description", self.description)
        if self.spec_rules:
            spec.setdefault("x-kubernetes-validations", []).extend(
                {"rule": r.rule, "message": r.message} for r in self.spec_rules
            )
        status = openapi_schema(self.status, constraints=INVENTORY_CONSTRAINTS)
        metadata: Json = {"type": "object"}
        if self.max_name_length is not None:
            metadata["properties"] = {"name": {"type": "string", "maxLength": self.max_name_length}}
        top: Json = {
            "type": "object",
            "description": self.description,
            "properties": {
                "apiVersion": {
                    "type": "string",
                    "description": "mixfleet.io/v1alpha1",
                },
                "kind": {"type": "string", "description": self.kind},
                "metadata": metadata,
                "spec": spec,
                "status": status,
            },
        }
        if self.spec_required:
            top["required"] = ["spec"]
        return top

    def manifest(self) -> Json:
        """The CustomResourceDefinition object."""
        columns: list[Json] = []
        for c in self.columns:
            col: Json = {"name": c.name, "type": c.type, "jsonPath": c.json_path}
            if c.description:
                col["description"] = c.description
            if c.priority:
                col["priority"] = c.priority
            columns.append(col)
        columns.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {
                "name": self.name,
                "labels": {"app.kubernetes.io/part-of": "mixfleet"},
            },
            "spec": {
                "group": GROUP,
                "scope": self.scope,
                "names": {
                    "kind": self.kind,
                    "listKind": f"{self.kind}List",
                    "plural": self.plural,
                    "singular": self.singular,
                    "shortNames": list(self.short_names),
                    "categories": ["mixfleet"],
                },
                "versions": [
                    {
                        "name": VERSION,
                        "served": True,
                        "storage": True,
                        "subresources": {"status": {}},
                        "additionalPrinterColumns": columns,
                        "schema": {"openAPIV3Schema": self.schema()},
                    }
                ],
            },
        }


def _cond(type_: str, what: str) -> PrinterColumn:
    return PrinterColumn(type_, "string", f'.status.conditions[?(@.type=="{type_}")].status', what)


GPUNODE = CrdDef(
    kind="GPUNode",
    plural="gpunodes",
    singular="gpunode",
    short_names=("gn", "gpun"),
    scope="Cluster",
    spec=GPUNodeSpec,
    status=GPUNodeStatus,
    description="A GPU host as its mixfleet agent reports it; spec cordons it or tags its tier.",
    columns=(
        PrinterColumn("Tier", "string", ".spec.tier", "Tier tag"),
        PrinterColumn("Cordon", "boolean", ".spec.cordon", "Kept out of placement"),
        PrinterColumn("GPUs", "integer", ".status.gpuCount", "GPUs reported"),
        PrinterColumn("Models", "string", ".status.gpuSummary", "GPU models"),
        PrinterColumn("Health", "string", ".status.health.state", "Node health"),
        PrinterColumn("Heartbeat", "date", ".status.lastHeartbeatTime", "Last agent report"),
    ),
    spec_required=False,
)

PLACEMENT_POLICY = CrdDef(
    kind="PlacementPolicy",
    plural="placementpolicies",
    singular="placementpolicy",
    short_names=("pp", "mfpolicy"),
    scope="Cluster",
    spec=PlacementPolicySpec,
    status=PlacementPolicyStatus,
    description="How ModelDeployments are placed: algorithm, solver limits, slot budget, tiers.",
    columns=(
        PrinterColumn("Policy", "string", ".spec.policy", "Placement algorithm"),
        PrinterColumn("TimeLimit", "number", ".spec.solverTimeLimitS", "Solve limit, s"),
        PrinterColumn("Redundant", "integer", ".spec.redundantExperts", "Extra slots per layer"),
    ),
    spec_required=False,
)

MODEL_DEPLOYMENT = CrdDef(
    kind="ModelDeployment",
    plural="modeldeployments",
    singular="modeldeployment",
    short_names=("md", "mdep"),
    scope="Namespaced",
    spec=ModelDeploymentSpec,
    status=ModelDeploymentStatus,
    description="A model placed on GPUNodes; the operator solves it into PartitionPlans.",
    columns=(
        PrinterColumn("Model", "string", ".spec.model", "Model preset"),
        _cond("Solved", "A plan exists for the current spec and fleet"),
        _cond("RolledOut", "Every node committed the current plan"),
        PrinterColumn("Plan", "string", ".status.currentPlan.name", "Current PartitionPlan"),
        PrinterColumn("GPUs", "integer", ".status.gpus", "GPUs in the plan"),
        PrinterColumn("Assigned", "integer", ".status.assignedGpus", "GPUs the scheduler assigns"),
        PrinterColumn("StepUs", "number", ".status.predictedStepTimeUs", "Predicted step, us"),
        PrinterColumn(
            "TokensPerS", "number", ".status.predictedTokensPerSecond", "Predicted tokens/s"
        ),
        _cond("Degraded", "Serving an outdated plan or nodes are lost"),
        PrinterColumn(
            "Instances", "string", ".status.instancesReady", "Ready engine instances of all"
        ),
        PrinterColumn(
            "PlannedRPS",
            "number",
            ".status.plannedRequestsPerSecond",
            "Requests/s the fleet plan serves within the SLO",
        ),
        PrinterColumn(
            "Attainment",
            "number",
            ".status.plannedAttainment",
            "Share of the demand planned within the SLO",
        ),
        PrinterColumn(
            "DemandRPS",
            "number",
            ".status.demandRequestsPerSecond",
            "Demand planned for, req/s",
            1,
        ),
        PrinterColumn(
            "DemandFrom", "string", ".status.demandFrom", "Spec, or Measured after a drift", 1
        ),
        PrinterColumn(
            "MeasuredRPS",
            "number",
            ".status.controller.demand.measured.requestsPerS",
            "Demand the routers measured, req/s",
            1,
        ),
        PrinterColumn(
            "MeasuredAttainment",
            "number",
            ".status.controller.demand.measured.sloAttainment",
            "Share of the streamed requests the routers judged that met the SLO, 0-1",
            1,
        ),
        PrinterColumn("InstanceOf", "string", ".status.instance.of", "Deployment it serves", 1),
        PrinterColumn(
            "USDPerMTok",
            "number",
            ".status.costPerMillionTokensUSD",
            "USD per million tokens",
            1,
        ),
        dataclasses.replace(
            _cond("InteractiveSLO", "The interactive tier meets its SLO"), priority=1
        ),
    ),
    max_name_length=63,
)

PARTITION_PLAN = CrdDef(
    kind="PartitionPlan",
    plural="partitionplans",
    singular="partitionplan",
    short_names=("ppl", "mfplan"),
    scope="Namespaced",
    spec=PartitionPlanSpec,
    status=PartitionPlanStatus,
    description="One immutable plan version of a ModelDeployment and its rollout per node.",
    columns=(
        PrinterColumn("Deployment", "string", ".spec.deployment", "Owning ModelDeployment"),
        PrinterColumn("Version", "integer", ".spec.version", "Plan version"),
        PrinterColumn("PlanID", "string", ".spec.planID", "Placement hash"),
        PrinterColumn("Policy", "string", ".spec.policy", "Algorithm"),
        PrinterColumn("State", "string", ".status.state", "Rollout state"),
        PrinterColumn("StepUs", "number", ".spec.stepTimeUs", "Predicted step, us"),
        PrinterColumn("Bytes", "integer", ".spec.uncompressedBytes", "Plan JSON size", 1),
    ),
    spec_rules=(
        Rule(
            "self == oldSelf",
            "PartitionPlan spec is immutable; the operator writes a new PartitionPlan for "
            "every plan version",
        ),
    ),
)

CRDS: tuple[CrdDef, ...] = (GPUNODE, PLACEMENT_POLICY, MODEL_DEPLOYMENT, PARTITION_PLAN)
