"""Target engines: what SGLang, vLLM and TensorRT-LLM really do with a plan (docs/engines.md).

A plan is worth what the engine executes. This module owns the engine as an input
(:class:`EngineSpec`), the runtime one expert-parallel group really gets
(:func:`resolve_runtime`: one all-to-all backend, one replica-choice rule, one DP balancer),
and the DP shares each rank's attention gets (:func:`rank_shares`). The share of every
expert's tokens each replica really serves under the engine's rule is
:mod:`policies.estimate.replica_choice`'s (the rules below).

Replica choice, per engine (each from the engine's own source):

* ``static`` - SGLang with an all-to-all backend (default ``--ep-dispatch-algorithm``):
  every rank sends all its tokens of expert e to one replica: one on its own GPU, else the
  first (lowest physical id) on its node when that narrows the candidates, else one drawn by
  a seeded spread (``random.Random(42)``, ``_fair_choices``) over all replicas.
  :func:`policies.estimate.replica_choice.sglang_static_map` replays ``compute_logical_to_rank_dispatch_physical_map`` of
  ``python/sglang/srt/eplb/expert_location.py`` (0.5.23), including the per-rank collapse of
  ``_compute_logical_to_all_physical_map``; the conformance suite checks it against that code.
* ``dynamic`` - SGLang ``--ep-dispatch-algorithm dynamic``: the nearest replica as above,
  else uniformly random over all replicas (modelled by its expectation).
* ``even`` - vLLM (``token_idx * 2654435769 % replica_count``), TensorRT-LLM (round-robin
  in ``moeComputeRouteKernel``) and SGLang with ``--moe-a2a-backend none``: an expert's
  tokens split evenly over its replicas.
* ``planned`` - ``native`` only: the shares the plan says (idealised; no engine runs it).

DP attention shares: ``engine`` balancing (SGLang ``--load-balance-method``, vLLM's
least-loaded engine, TensorRT-LLM's ``DefaultADPRouter``) gives every rank an equal share
over time; ``router`` (the mixfleet router pins each request's rank) gives the planned weights.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from policies.errors import InputError
from policies.keys import check_keys

EngineName = Literal["native", "sglang", "vllm", "trtllm"]
"""Target engines; ``native`` is mixfleet's idealised form (planned shares, any split)."""

ENGINES: tuple[EngineName, ...] = get_args(EngineName)

Dispatch = Literal["static", "dynamic", "even", "planned"]
"""How an engine picks among an expert's replicas (module docstring)."""

DpBalance = Literal["engine", "router"]
"""Who sets each DP attention rank's token share: the engine's balancer or the mixfleet router."""

DP_BALANCES: tuple[DpBalance, ...] = get_args(DpBalance)

DP_BALANCE_OPTIONS: tuple[str, ...] = ("auto", *DP_BALANCES)
"""What a deployment may ask for: ``auto`` is ``router`` where the engine's HTTP API takes a
per-request DP rank (SGLang ``routed_dp_rank``, vLLM ``X-data-parallel-rank``) and
``engine`` for TensorRT-LLM, whose trtllm-serve request schema has no rank field (its
``openai_protocol.py`` forbids extra fields; only the Python LLM API takes
``SchedulingParams(attention_dp_rank=...)``)."""

NO_HTTP_RANK_FIELD: frozenset[str] = frozenset({"trtllm"})
"""Engines whose HTTP server cannot be told a request's DP rank: the router cannot impose
planned DP weights on them (docs/router.md)."""

PINNED_VERSIONS: Mapping[str, str] = {"sglang": "0.5.23", "vllm": "0.33.0", "trtllm": "1.2.1"}
"""The engine versions whose behaviour this module models (checked by ``make conformance``)."""

_HOPPER_PLUS = frozenset({"hopper", "blackwell"})
_NVIDIA = frozenset({"volta", "ampere", "ada", "hopper", "blackwell"})
_ANY = _NVIDIA | {"cdna3"}

# Per engine, all-to-all backend -> GPU architectures it runs on, first choice first for
# ``auto``. DeepEP's internode and low-latency kernels need SM90 (its SM80 build keeps only
# intranode normal kernels), MORI is AMD's; ``none`` (SGLang) and the all-gather paths of
# vLLM and TensorRT-LLM (which falls back to all-gather + reduce-scatter when no all-to-all
# method is enabled) run anywhere.
_BACKENDS: Mapping[str, tuple[tuple[str, frozenset[str]], ...]] = {
    "sglang": (("deepep", _HOPPER_PLUS), ("mori", frozenset({"cdna3"})), ("none", _ANY)),
    "vllm": (
        ("deepep_low_latency", _HOPPER_PLUS),
        ("deepep_high_throughput", _HOPPER_PLUS),
        ("allgather_reducescatter", _ANY),
        ("naive", _ANY),
    ),
    "trtllm": (("deepep", _HOPPER_PLUS), ("allgather_reducescatter", _NVIDIA)),
    "native": (("deepep", _HOPPER_PLUS), ("nccl", _ANY)),
}

A2A_BACKENDS: Mapping[str, tuple[str, ...]] = {
    e: tuple(b for b, _ in table) for e, table in _BACKENDS.items()
}
"""Per engine, the all-to-all backends mixfleet models (option ``a2aBackend``, or ``auto``)."""

DISPATCH_OPTIONS: tuple[str, ...] = ("auto", "static", "dynamic")
"""Values of option ``dispatch``; ``static`` and ``dynamic`` are SGLang's."""


_GATHER_BACKENDS = frozenset({"none", "allgather_reducescatter", "naive"})
"""Backends without all-to-all: tokens are all-gathered and results reduce-scattered."""

_FORWARDING_BACKENDS: Mapping[str, tuple[str, ...]] = {"vllm": ("deepep_high_throughput",)}
"""Per engine, backends that run DeepEP's normal (forwarding) kernels in every phase."""

_FORWARDING_IN_PREFILL: Mapping[str, tuple[str, ...]] = {
    "sglang": ("deepep",),
    "native": ("deepep",),
}
"""Per engine, backends that run DeepEP's normal kernels for prefill and its low-latency
kernels for decode (SGLang's ``--deepep-mode auto``: normal when the batch extends; the
native runtime's ``deepep_mode`` hint). TensorRT-LLM picks its all-to-all method by its own
rules (MNNVL, DeepEP low-latency) and is modelled per pair."""


@dataclass(frozen=True)
class EngineOptions:
    """The engine settings that change how a plan executes.

    Attributes:
        a2a_backend: all-to-all backend of the EP group (SGLang ``--moe-a2a-backend``, vLLM
            ``--all2all-backend``); ``auto`` picks the first that every GPU supports.
        dispatch: replica choice (SGLang ``--ep-dispatch-algorithm``): ``auto`` | ``static``
            | ``dynamic``; vLLM and TensorRT-LLM accept only ``auto`` (their rule is fixed).
        dp_balance: ``router`` (the mixfleet router applies the planned DP weights),
            ``engine`` (the engine's own balancer: equal shares) or ``auto`` (``router``
            where the engine's HTTP API takes a rank, else ``engine``; see
            :data:`DP_BALANCE_OPTIONS`).
    """

    a2a_backend: str = "auto"
    dispatch: str = "auto"
    dp_balance: str = "auto"


@dataclass(frozen=True)
class EngineSpec:
    """The engine a plan is for.

    Attributes:
        name: one of :data:`ENGINES`.
        version: engine version (empty = the pinned one, :data:`PINNED_VERSIONS`).
        options: behaviour-changing settings.
    """

    name: EngineName = "native"
    version: str = ""
    options: EngineOptions = field(default_factory=EngineOptions)

    @property
    def resolved_version(self) -> str:
        """The version, or the pinned one when none was given ("" for ``native``)."""
        return self.version or PINNED_VERSIONS.get(self.name, "")

    @property
    def dp_balance(self) -> DpBalance:
        """Who sets the DP ranks' shares, ``auto`` resolved (:data:`DP_BALANCE_OPTIONS`)."""
        if self.options.dp_balance == "engine":
            return "engine"
        if self.options.dp_balance == "router":
            return "router"
        return "engine" if self.name in NO_HTTP_RANK_FIELD else "router"

    @property
    def equal_dp(self) -> bool:
        """True when the engine's own balancer (equal shares) sets the DP ranks' shares."""
        return self.name != "native" and self.dp_balance == "engine"

    @property
    def label(self) -> str:
        """``sglang 0.5.23`` / ``native (idealised: no engine executes these shares)``."""
        if self.name == "native":
            return "native (idealised: no engine executes these shares)"
        return f"{self.name} {self.resolved_version}"


_ENGINE_KEYS = ("name", "version", "options")
_OPTION_KEYS = ("a2aBackend", "dispatch", "dpBalance")


def _unknown(doc: Mapping[str, Any], allowed: Sequence[str], path: str) -> None:
    check_keys(doc, allowed, path)


def _str(doc: Mapping[str, Any], key: str, default: str, path: str) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str) or (key != "version" and not value):
        raise InputError(f"must be a non-empty string, got {value!r}", field=f"{path}.{key}")
    return value


def parse_engine(doc: Any, path: str = "engine") -> EngineSpec:
    """An :class:`EngineSpec` from ``{name, version, options: {a2aBackend, dispatch,
    dpBalance}}`` (or a bare engine name), every key checked.

    Raises:
        InputError: wrong type, unknown key or value (the message lists the choices).
    """
    if isinstance(doc, str):
        doc = {"name": doc}
    if not isinstance(doc, Mapping):
        raise InputError(f"must be a mapping or an engine name, got {doc!r}", field=path)
    _unknown(doc, _ENGINE_KEYS, path)
    name = _str(doc, "name", "native", path)
    if name not in ENGINES:
        raise InputError(
            f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}", field=f"{path}.name"
        )
    version = _str(doc, "version", "", path)
    raw = doc.get("options", {})
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise InputError(f"must be a mapping, got {raw!r}", field=f"{path}.options")
    _unknown(raw, _OPTION_KEYS, f"{path}.options")
    opath = f"{path}.options"
    options = EngineOptions(
        a2a_backend=_str(raw, "a2aBackend", "auto", opath),
        dispatch=_str(raw, "dispatch", "auto", opath),
        dp_balance=_str(raw, "dpBalance", "auto", opath),
    )
    spec = EngineSpec(name, version, options)
    check_engine(spec, path)
    return spec


def engine_to_doc(spec: EngineSpec) -> dict[str, Any]:
    """The document form :func:`parse_engine` reads (every field written)."""
    return {
        "name": spec.name,
        "version": spec.version,
        "options": {
            "a2aBackend": spec.options.a2a_backend,
            "dispatch": spec.options.dispatch,
            "dpBalance": spec.options.dp_balance,
        },
    }


def check_engine(spec: EngineSpec, path: str = "engine") -> None:
    """Check the option values an engine accepts (GPU support is :func:`resolve_runtime`'s).

    Raises:
        InputError: an option the engine does not have.
    """
    o = spec.options
    if spec.name not in ENGINES:
        raise InputError(
            f"unknown engine {spec.name!r}; choose one of {', '.join(ENGINES)}",
            field=f"{path}.name",
        )
    if o.dp_balance not in DP_BALANCE_OPTIONS:
        raise InputError(
            f"unknown dpBalance {o.dp_balance!r}; choose auto, router (the mixfleet router "
            "applies the planned DP weights) or engine (the engine's own balancer: equal "
            "shares)",
            field=f"{path}.options.dpBalance",
        )
    if o.dp_balance == "router" and spec.name in NO_HTTP_RANK_FIELD:
        raise InputError(
            f"{spec.name}'s HTTP server takes no per-request DP rank (trtllm-serve's request "
            "schema has no rank field), so no router can apply planned DP weights; choose "
            "dpBalance engine or auto (the plan is then solved for equal shares)",
            field=f"{path}.options.dpBalance",
        )
    backends = [b for b, _ in _BACKENDS[spec.name]]
    if o.a2a_backend != "auto" and o.a2a_backend not in backends:
        raise InputError(
            f"{spec.name} has no all-to-all backend {o.a2a_backend!r} that mixfleet models; "
            f"choose auto or one of {', '.join(backends)}",
            field=f"{path}.options.a2aBackend",
        )
    allowed = ("auto", "static", "dynamic") if spec.name == "sglang" else ("auto",)
    if o.dispatch not in allowed:
        fixed = {
            "vllm": "vLLM always hashes tokens evenly over replicas",
            "trtllm": "TensorRT-LLM always round-robins over replicas",
            "native": "native form uses the planned shares",
        }.get(spec.name, "SGLang's fake and lp algorithms are not modelled")
        raise InputError(
            f"dispatch {o.dispatch!r} is not available for {spec.name} ({fixed}); choose "
            f"{' or '.join(allowed)}",
            field=f"{path}.options.dispatch",
        )


@dataclass(frozen=True)
class Runtime:
    """What one expert-parallel group really runs.

    Attributes:
        engine: the target engine.
        a2a_backend: the one all-to-all backend of the whole group.
        dispatch: replica choice rule (:data:`Dispatch`).
        dp_balance: who sets the DP ranks' shares.
        gpus_per_node: ranks per node as the engine counts them (SGLang: ``ep_size //
            nnodes``; its same-node rule assumes equal GPUs per node).
        why: one line saying how the backend was chosen.
    """

    engine: EngineSpec
    a2a_backend: str
    dispatch: Dispatch
    dp_balance: DpBalance
    gpus_per_node: int
    why: str

    @property
    def equal_dp(self) -> bool:
        """True when the engine's balancer (not the planned weights) sets the DP shares."""
        return self.engine.equal_dp

    def exchange_in(self, decode: bool) -> str:
        """How the backend moves tokens to experts in one phase (``decode``: decode steps,
        else prefill forwards):

        * ``allgather``: every GPU gets every token (:data:`_GATHER_BACKENDS`);
        * ``forwarded``: DeepEP's normal kernels - a token goes once to each GPU that holds
          one of its experts, and across nodes once to each node, over RDMA to the GPU of
          the sender's local rank, which forwards it over NVLink (SGLang's ``deepep`` in
          prefill, its ``--deepep-mode auto`` default; vLLM's ``deepep_high_throughput``;
          the native runtime's prefill hint);
        * ``alltoall``: every token-expert pair sent on its own (DeepEP's low-latency
          kernels, MORI, NCCL, TensorRT-LLM's all-to-all methods).
        """
        if self.a2a_backend in _GATHER_BACKENDS:
            return "allgather"
        if self.a2a_backend in _FORWARDING_BACKENDS.get(self.engine.name, ()):
            return "forwarded"
        if not decode and self.a2a_backend in _FORWARDING_IN_PREFILL.get(self.engine.name, ()):
            return "forwarded"
        return "alltoall"


def resolve_runtime(
    engine: EngineSpec, architectures: Sequence[str], nodes: Sequence[str]
) -> Runtime:
    """The runtime of one EP group: its GPUs' architectures and node names in rank order.

    Raises:
        InputError: no backend of the engine runs on every GPU of the group (the message
            names the GPUs that lack it); an explicit backend some GPU lacks; SGLang with
            unequal GPUs per node or a node's ranks not contiguous.
    """
    check_engine(engine)
    archs = set(architectures)
    names = list(dict.fromkeys(nodes))
    order = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
    if len(order) != len(names):
        raise InputError(
            "the ranks of a node are not contiguous in the plan's GPU order; engines number "
            "ranks node by node. To fix: list each node's GPUs together in the fleet",
            field="fleet",
        )
    per_node = {n: nodes.count(n) for n in names}
    if engine.name == "sglang" and len(set(per_node.values())) > 1:
        raise InputError(
            f"SGLang runs {len(names)} nodes with the same number of GPUs each, this group "
            f"has {per_node}. To fix: use equal GPU counts per node (fleet or deployment "
            "GPU selection)",
            field="fleet",
        )
    table = _BACKENDS[engine.name]
    wanted = engine.options.a2a_backend
    if wanted != "auto":
        supported = dict(table)[wanted]
        lacking = sorted(archs - supported)
        if lacking:
            raise InputError(
                f"{engine.name} all-to-all backend {wanted} does not run on {lacking} GPUs of "
                f"this EP group (it needs {sorted(supported)}); one backend serves the whole "
                "group. To fix: choose a2aBackend auto, or place the deployment on GPUs that "
                "support it",
                field="engine.options.a2aBackend",
            )
        backend, why = wanted, f"{wanted} (as configured)"
    else:
        usable = [b for b, sup in table if archs <= sup]
        if not usable:
            raise InputError(
                f"no {engine.name} all-to-all backend runs on every GPU of this EP group "
                f"(architectures {sorted(archs)}). To fix: split the fleet by vendor",
                field="engine.options.a2aBackend",
            )
        backend = usable[0]
        skipped = [b for b, _ in table[: [b for b, _ in table].index(backend)]]
        why = f"{backend} (every GPU supports it" + (
            f"; {', '.join(skipped)} not: {sorted(archs)})" if skipped else ")"
        )
    return Runtime(
        engine=engine,
        a2a_backend=backend,
        dispatch=_dispatch(engine, backend),
        dp_balance=engine.dp_balance,
        gpus_per_node=len(nodes) // max(1, len(names)),
        why=why,
    )


def _dispatch(engine: EngineSpec, backend: str) -> Dispatch:
    if engine.name == "native":
        return "planned"
    if engine.name != "sglang" or backend == "none":
        return "even"
    return "dynamic" if engine.options.dispatch == "dynamic" else "static"


def rank_shares(runtime: Runtime, planned: Sequence[float]) -> list[float]:
    """Each DP rank's share of the step's tokens as the runtime's balancer produces it."""
    if runtime.equal_dp:
        return [1.0 / len(planned)] * len(planned)
    return list(planned)


def full_rows(
    moe_rows: Sequence[Sequence[int]],
    moe_layers: Sequence[int],
    num_layers: int,
    num_logical: int,
) -> list[list[int]]:
    """The map over every decoder layer that SGLang loads: MoE rows at their layer index,
    SGLang's trivial row ``p % E`` for dense layers."""
    width = len(moe_rows[0]) if moe_rows else num_logical
    trivial = [p % num_logical for p in range(width)]
    by_layer = dict(zip(moe_layers, moe_rows, strict=True))
    return [list(by_layer.get(layer, trivial)) for layer in range(num_layers)]
