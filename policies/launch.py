"""Launch recipes: the command line and environment that start a plan's engine, node by node.

A plan is only worth what its engine executes, so the engine must be started with the
expert-parallel shape, all-to-all backend, replica rule and placement file the plan was
predicted under. :func:`launch_recipe` turns an engine plan into one :class:`NodeLaunch`
per node, in the plan's rank order (``plan.gpus``; a node's ranks must be contiguous), with
the flags of the engine versions mixfleet models (:data:`policies.engines.PINNED_VERSIONS`,
read from each engine's own argument definitions):

* SGLang 0.5.23 - ``python3 -m sglang.launch_server --tp-size N --attn-dp-size N/t
  --ep-size N --moe-a2a-backend B --ep-num-redundant-experts R --init-expert-location FILE
  [--ep-dispatch-algorithm D] --nnodes K --node-rank i [--dist-init-addr ADDR]``
  (``--attn-dp-size`` replaces the deprecated ``--dp-size N --enable-dp-attention``;
  ``--enable-eplb`` is never passed: its rebalancing would overwrite the placement).
* vLLM 0.33.0 - ``vllm serve --tensor-parallel-size t --data-parallel-size N/t
  --enable-expert-parallel --all2all-backend B``, per node ``--data-parallel-size-local``,
  ``--data-parallel-start-rank``, ``--data-parallel-address``/``--data-parallel-rpc-port``
  (``--headless`` past node 0); ``--enable-eplb --eplb-config`` whenever vLLM needs its
  ``EplbState`` (:func:`~policies.exports.vllm_needs_eplb`: redundant slots, or any placement
  but vLLM's default layout - also with R = 0), whose ``step_interval``
  (:data:`~policies.exports.VLLM_NO_REBALANCE_STEP_INTERVAL`) keeps EPLB's own rebalancing
  from firing.
  vLLM has no flag that loads a placement (docs/engines.md); the recipe's notes say so.
* TensorRT-LLM - ``trtllm-serve --tp_size N --ep_size N --extra_llm_api_options FILE`` with
  ``enable_attention_dp: true`` and ``moe_config.load_balancer`` = the exported file in that
  options YAML (:attr:`LaunchRecipe.files`), the plan's backend forced by
  ``TRTLLM_FORCE_ALLTOALL_METHOD`` (``DeepEP`` or ``NotEnabled``: all-gather and
  reduce-scatter); several nodes run as one MPI job (``trtllm-llmapi-launch`` on every rank).

**Roles** (:data:`policies.fleetplan.ROLES`). An ``aggregated`` server runs both phases. A ``prefill`` or
``decode`` server of a prefill/decode pool (:class:`KvTransfer`: the KV path between the
pools and the engine's transfer backend, :data:`TRANSFER_BACKENDS`) adds:

* SGLang - ``--disaggregation-mode prefill|decode --disaggregation-transfer-backend B``
  (``mooncake`` over RDMA, ``nixl`` over RDMA or NVLink), ``--disaggregation-bootstrap-port
  P`` on prefill (its bootstrap server; the router sends ``bootstrap_host``/``port``/``room``
  on both requests);
* vLLM - ``--kv-transfer-config {"kv_connector": C, "kv_role": R}`` with ``kv_producer`` on
  prefill and ``kv_consumer`` on decode (vLLM 0.33.0's ``NixlConnector`` deprecates
  ``kv_both``), and for NIXL ``VLLM_NIXL_SIDE_CHANNEL_HOST`` = the node's own address;
* TensorRT-LLM - ``cache_transceiver_config: {backend: B}`` in the server's options YAML
  (``disable_overlap_scheduler: true`` on context servers), ``--host``/``--port`` so the
  disaggregated server reaches it, and per pool the YAML ``trtllm-serve disaggregated -c``
  reads (:func:`trtllm_disagg_config`: ``context_servers`` / ``generation_servers`` with
  ``urls``).

A pool without an RDMA or NVLink path, or a backend that does not run over the pool's path,
is refused (:func:`transfer_backend`). :func:`planned_instances` reads a deployment's engine
instances from a ``FleetPlan`` document (``mixfleetctl schedule show -o json``) and
:func:`deployment_launch` builds every instance's recipe from its placement plan.

``CUDA_VISIBLE_DEVICES`` lists each node's GPU indices (from the plan's ``node/gpuN`` ids, NVML
order, hence ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) in rank order. Values not known when the
recipe is built are shell references the caller's environment fills: ``${MIXFLEET_MODEL_PATH}``,
``${MIXFLEET_DIST_INIT_ADDR}`` (``HOST:PORT`` of node 0) and, for prefill/decode servers,
``${MIXFLEET_NODE_ADDR}`` (the address other nodes reach this node at).

Pure: builds values and text, does no I/O.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policies.defaults import PLACEMENT_FILES as PLACEMENT_FILES  # one default: policies.defaults
from policies.defaults import TRTLLM_OPTIONS_FILE as TRTLLM_OPTIONS_FILE
from policies.engines import PINNED_VERSIONS
from policies.errors import InputError
from policies.execution import SGLANG_PLACEMENT_FAMILIES
from policies.exports import VLLM_NO_REBALANCE_STEP_INTERVAL, vllm_eplb_config, vllm_needs_eplb
from policies.exports import vllm_default_rows as vllm_default_rows  # one owner: exports
from policies.models import ModelSpec
from policies.plan import Plan, validate_plan

if TYPE_CHECKING:
    from policies.fleet import Fleet
    from policies.request import PlacementRequest
    from policies.spec import DeploymentSpec

MODEL_PATH_REF = "${MIXFLEET_MODEL_PATH}"
"""The model path when none is given: the weights directory or Hugging Face id, from the
environment."""
DIST_INIT_REF = "${MIXFLEET_DIST_INIT_ADDR}"
"""Node 0's ``HOST:PORT`` when none is given (multi-node only), from the environment."""
NODE_ADDR_REF = "${MIXFLEET_NODE_ADDR}"
"""The address other nodes reach this node at (prefill/decode servers), from the environment."""

SGLANG_BOOTSTRAP_PORT = 8998
"""SGLang's default ``--disaggregation-bootstrap-port`` (0.5.23): where a prefill server's
bootstrap server listens, TCP port."""
TRTLLM_SERVER_PORT = 8000
"""``trtllm-serve``'s default ``--port``: where a context or generation server listens, and
the port of its URL in the disaggregated server's YAML, TCP port."""

TRANSFER_BACKENDS: Mapping[str, Mapping[str, frozenset[str]]] = {
    "sglang": {
        "mooncake": frozenset({"rdma"}),
        "nixl": frozenset({"rdma", "nvlink"}),
    },
    "vllm": {
        "NixlConnector": frozenset({"rdma", "nvlink"}),
        "MooncakeConnector": frozenset({"rdma"}),
    },
    "trtllm": {
        "UCX": frozenset({"rdma", "nvlink"}),
        "NIXL": frozenset({"rdma", "nvlink"}),
        "MOONCAKE": frozenset({"rdma"}),
    },
}
"""Per engine, the KV transfer backends a recipe names (SGLang
``--disaggregation-transfer-backend``, vLLM's ``kv_connector``, TensorRT-LLM's
``cache_transceiver_config.backend``) and the paths (``rdma``, ``nvlink``) each runs over;
the first that runs over a pool's path is the default. Mooncake moves KV with RDMA
(``mooncake_tcp`` and Mooncake's NVLink transport are left out: the planner's pools are
priced on RDMA or NVLink bandwidth)."""


_GPU_ID = re.compile(r"^(?P<node>.+)/gpu(?P<index>\d+)$")


@dataclass(frozen=True)
class NodeLaunch:
    """What one node runs.

    Attributes:
        node: node name.
        node_rank: the node's position in rank order (0 = first node).
        rank_range: ``(first, end)`` global ranks on this node, end exclusive.
        argv: the command line (tokens may contain the ``${...}`` references above).
        env: environment variables to set.
    """

    node: str
    node_rank: int
    rank_range: tuple[int, int]
    argv: tuple[str, ...]
    env: Mapping[str, str]


@dataclass(frozen=True)
class KvTransfer:
    """How the prefill and decode instances of a pool move KV.

    Attributes:
        path: the KV path in the fleet planner's words (``RDMA ib0``, ``RDMA ib0-ib1``,
            ``NVLink nvl72-0``; :func:`policies.fleetplan.kv_path`), or just ``rdma`` or
            ``nvlink``; its first word is the kind. Empty: no path (refused).
        backend: the engine's transfer backend (:data:`TRANSFER_BACKENDS`); "" = the
            engine's first that runs over the path.
        bootstrap_port: SGLang: the TCP port of the prefill server's bootstrap server.
    """

    path: str
    backend: str = ""
    bootstrap_port: int = SGLANG_BOOTSTRAP_PORT


@dataclass(frozen=True)
class LaunchRecipe:
    """How to start the engine of a plan.

    Attributes:
        plan_id: the plan.
        engine: ``sglang 0.5.23`` (engine and version whose flags these are).
        nodes: per node, rank order.
        files: documents the commands read besides the placement file, by path (the
            TensorRT-LLM options YAML).
        notes: what the caller must know (what the engine cannot load, DP routing).
        role: ``aggregated``, ``prefill`` or ``decode`` (:data:`policies.fleetplan.ROLES`).
        transfer_backend: prefill/decode: the engine's KV transfer backend ("" aggregated).
        bootstrap_port: SGLang prefill: its bootstrap server's TCP port (None otherwise).
        placement_path: the placement file the commands read, as the engine sees it.
    """

    plan_id: str
    engine: str
    nodes: tuple[NodeLaunch, ...]
    files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    role: str = "aggregated"
    transfer_backend: str = ""
    bootstrap_port: int | None = None
    placement_path: str = ""


@dataclass(frozen=True)
class _Shape:
    """The parallel shape of a plan: ``n`` ranks, attention TP ``tp``, nodes in rank order
    with their ranks and GPU indices."""

    n: int
    tp: int
    nodes: tuple[tuple[str, int, int, tuple[int, ...]], ...]  # node, first, end, indices


def launch_recipe(
    plan: Plan,
    model: ModelSpec,
    *,
    engine: str | None = None,
    placement_path: str | None = None,
    model_path: str = MODEL_PATH_REF,
    dist_init_addr: str = DIST_INIT_REF,
    options_path: str = TRTLLM_OPTIONS_FILE,
    role: str = "aggregated",
    kv: KvTransfer | None = None,
) -> LaunchRecipe:
    """The per-node launch of ``plan`` on the engine it was solved for, as a server of
    ``role``.

    Args:
        plan: a feasible plan solved for ``sglang``, ``vllm`` or ``trtllm``.
        model: the plan's model (its family decides what SGLang can load).
        engine: the engine the caller means to run; must be the plan's (None: the plan's).
        placement_path: path of the exported placement file as the engine will see it
            (default :data:`PLACEMENT_FILES`).
        model_path: weights directory or Hugging Face id.
        dist_init_addr: ``HOST:PORT`` of node 0 (used with several nodes).
        options_path: TensorRT-LLM only: where the options YAML will be.
        role: ``aggregated`` (both phases), ``prefill`` or ``decode``.
        kv: prefill/decode: the pool's KV path and transfer backend (required for them).

    Raises:
        InputError: an infeasible plan; a native plan or one for another engine; a node
            whose ranks are not contiguous; a shape or model the engine cannot run; an
            unknown role; a prefill/decode server without a KV path or with a backend that
            does not run over it.
    """
    name = _check_plan(plan, model, engine)
    shape = _shape(plan)
    path = placement_path or PLACEMENT_FILES[name]
    backend = _check_role(name, role, kv)
    pd = None if role == "aggregated" else (role, backend, kv or KvTransfer(""))
    if name == "sglang":
        nodes, notes = _sglang(plan, shape, path, model_path, dist_init_addr, pd)
        files: dict[str, Mapping[str, Any]] = {}
    elif name == "vllm":
        nodes, notes = _vllm(plan, shape, path, model_path, dist_init_addr, pd)
        files = {}
    else:
        nodes, notes, files = _trtllm(plan, shape, path, model_path, options_path, pd)
    version = plan.engine.version or PINNED_VERSIONS[name]
    if version != PINNED_VERSIONS[name]:
        notes = (
            f"the flags are {name} {PINNED_VERSIONS[name]}'s; the plan names {version}",
            *notes,
        )
    return LaunchRecipe(
        plan.id,
        f"{name} {PINNED_VERSIONS[name]}",
        tuple(nodes),
        files,
        (*notes, _dp_note(plan, name)),
        role,
        backend,
        kv.bootstrap_port if (kv is not None and name == "sglang" and role == "prefill") else None,
        path,
    )


def path_kind(path: str) -> str:
    """``rdma`` or ``nvlink`` from a KV path in the planner's words (its first word), or ""
    when there is none."""
    word = path.strip().split(" ", 1)[0].lower() if path.strip() else ""
    return word if word in ("rdma", "nvlink") else ""


def transfer_backend(engine: str, kv: KvTransfer) -> str:
    """The engine's KV transfer backend for a pool: ``kv.backend`` checked against the path,
    or the engine's first that runs over it.

    Raises:
        InputError: no RDMA or NVLink path; an unknown backend; one that does not run over
            the path (SGLang's mooncake without RDMA, say).
    """
    known = TRANSFER_BACKENDS[engine]
    kind = path_kind(kv.path)
    label = f"{engine} {PINNED_VERSIONS[engine]}"
    if not kind:
        raise InputError(
            f"{label} moves a prefill/decode pool's KV over RDMA or NVLink; the pool's path is "
            f"{kv.path or 'none'!r}. To fix: give both pools' nodes a NIC on a common RDMA "
            "fabric (or one NVLink domain) and re-plan, or run the deployment aggregated "
            "(disaggregation: off)",
            field="kvPath",
        )
    if kv.backend and kv.backend not in known:
        raise InputError(
            f"{label} has no KV transfer backend {kv.backend!r} the recipe knows; known: "
            f"{', '.join(known)}",
            field="transfer-backend",
        )
    if kv.backend:
        if kind not in known[kv.backend]:
            over = " or ".join(
                sorted(k.upper() if k == "rdma" else "NVLink" for k in known[kv.backend])
            )
            raise InputError(
                f"{label}'s {kv.backend} backend moves KV over {over}; the pool's path is "
                f"{kv.path!r}. To fix: use "
                + " or ".join(b for b, kinds in known.items() if kind in kinds)
                + " (--transfer-backend), or re-plan on nodes with an RDMA path",
                field="transfer-backend",
            )
        return kv.backend
    return next(b for b, kinds in known.items() if kind in kinds)


def _check_role(engine: str, role: str, kv: KvTransfer | None) -> str:
    """The transfer backend of a prefill/decode server ("" for an aggregated one)."""
    from policies.fleetplan.types import ROLES  # one owner: the fleet planner's roles

    if role not in ROLES:
        raise InputError(f"role {role!r} is not one of {', '.join(ROLES)}", field="role")
    if role == "aggregated":
        return ""
    if kv is None:
        raise InputError(
            f"a {role} server needs its pool's KV path and transfer backend", field="kvPath"
        )
    if not 0 < kv.bootstrap_port < 65536:
        raise InputError(
            f"bootstrap port {kv.bootstrap_port} is not a TCP port (1-65535)",
            field="bootstrap-port",
        )
    return transfer_backend(engine, kv)


def _check_plan(plan: Plan, model: ModelSpec, engine: str | None) -> str:
    """The plan's engine, after the refusals that do not depend on the shape."""
    problems = list(plan.violations) or validate_plan(plan)
    if problems:
        raise InputError(
            f"plan {plan.id} is infeasible ({len(problems)} problems, first: {problems[0]}); "
            "no engine can run it as predicted. To fix: re-solve until mixfleetctl plan show "
            "reports it feasible",
            field="plan",
        )
    planned = plan.engine.name
    if engine is not None and engine != planned:
        raise InputError(
            f"plan {plan.id} was solved for {planned}, not {engine}: its shares are predicted "
            f"under {planned}'s replica choice and DP balancing. To fix: re-solve with "
            f"--engine {engine}",
            field="engine",
        )
    if planned not in PLACEMENT_FILES:
        what = (
            "native (idealised: no engine executes these shares)"
            if planned == "native"
            else f"for engine {planned!r}, which has no launch recipe"
        )
        raise InputError(
            f"plan {plan.id} is {what}. To fix: re-solve with --engine sglang, vllm or trtllm",
            field="engine",
        )
    if plan.model != model.name:
        raise InputError(
            f"plan {plan.id} is for model {plan.model}, the model given is {model.name}",
            field="model",
        )
    moe = bool(plan.moe_layers)
    if moe and plan.slots_per_gpu is None:
        raise InputError(
            f"plan {plan.id} is in {plan.form} form; engines need equal expert slots per "
            "GPU. To fix: re-solve with --form engine",
            field="form",
        )
    if planned == "sglang" and moe and model.family not in SGLANG_PLACEMENT_FAMILIES:
        raise InputError(
            f"SGLang {PINNED_VERSIONS['sglang']} cannot load an expert placement for "
            f"{model.name} ({model.family}): its model class has no expert-location support "
            "(--init-expert-location fails at the first MoE forward). To fix: re-solve with "
            "--engine vllm or trtllm",
            field="engine",
        )
    return planned


def _shape(plan: Plan) -> _Shape:
    """Ranks per node (contiguous), GPU indices and the one attention TP size."""
    nodes: list[tuple[str, int, int, tuple[int, ...]]] = []
    for rank, g in enumerate(plan.gpus):
        m = _GPU_ID.match(g.gpu)
        if m is None or m.group("node") != g.node:
            raise InputError(
                f"GPU id {g.gpu!r} is not <node>/gpu<index> of node {g.node!r}; the device "
                "index cannot be read from it",
                field="gpus",
            )
        if nodes and nodes[-1][0] == g.node:
            name, first, _, idx = nodes[-1]
            nodes[-1] = (name, first, rank + 1, (*idx, int(m.group("index"))))
            continue
        if any(n[0] == g.node for n in nodes):
            earlier = next(n for n in nodes if n[0] == g.node)
            raise InputError(
                f"node {g.node}'s ranks are not contiguous ({earlier[1]}-{earlier[2] - 1}, "
                f"then {rank}); engines number ranks node by node. To fix: list each node's "
                "GPUs together in the fleet and re-solve",
                field="gpus",
            )
        nodes.append((g.node, rank, rank + 1, (int(m.group("index")),)))
    sizes = {g.attention_tp for g in plan.gpus}
    if len(sizes) != 1:
        raise InputError(
            f"an engine runs one attention TP size per server, plan {plan.id} has {sorted(sizes)}",
            field="gpus",
        )
    tp = sizes.pop()
    for name, first, end, _ in nodes:
        if first % tp or end % tp:
            raise InputError(
                f"node {name}'s ranks {first}-{end - 1} split an attention TP group of {tp}",
                field="gpus",
            )
    return _Shape(len(plan.gpus), tp, tuple(nodes))


def _env(indices: Sequence[int]) -> dict[str, str]:
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in indices),
    }


def _equal_nodes(engine: str, shape: _Shape) -> int:
    """GPUs per node, refusing unequal nodes (SGLang and TensorRT-LLM assume equal)."""
    counts = {name: end - first for name, first, end, _ in shape.nodes}
    if len(set(counts.values())) > 1:
        raise InputError(
            f"{engine} runs nodes with the same number of GPUs each; the plan has {counts}. "
            "To fix: use equal GPU counts per node (fleet or deployment node selection)",
            field="gpus",
        )
    return next(iter(counts.values()))


_Pd = tuple[str, str, KvTransfer] | None
"""A prefill/decode server's role, transfer backend and pool link; None for aggregated."""


def _sglang(
    plan: Plan, shape: _Shape, path: str, model_path: str, addr: str, pd: _Pd = None
) -> tuple[list[NodeLaunch], tuple[str, ...]]:
    _equal_nodes("SGLang", shape)
    if plan.moe_layers and not path.endswith((".json", ".pt")):
        raise InputError(
            f"SGLang reads --init-expert-location {path!r} as inline JSON unless the name ends "
            "in .json or .pt. To fix: name the exported file *.json",
            field="placement",
        )
    k = len(shape.nodes)
    common = ["python3", "-m", "sglang.launch_server", "--model-path", model_path]
    common += ["--tp-size", str(shape.n), "--attn-dp-size", str(shape.n // shape.tp)]
    if plan.moe_layers:
        e = plan.engine
        common += ["--ep-size", str(shape.n), "--moe-a2a-backend", e.a2a_backend]
        common += ["--ep-num-redundant-experts", str(plan.num_redundant)]
        common += ["--init-expert-location", path]
        if e.dispatch in ("static", "dynamic"):  # explicit: the plan's shares depend on it
            common += ["--ep-dispatch-algorithm", e.dispatch]
    notes: list[str] = []
    if pd is not None:
        role, backend, kv = pd
        common += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", backend]
        if role == "prefill":
            common += ["--disaggregation-bootstrap-port", str(kv.bootstrap_port)]
        notes.append(_sglang_pd_note(plan, shape, role, kv))
    out = []
    for i, (name, first, end, idx) in enumerate(shape.nodes):
        argv = [*common, "--nnodes", str(k), "--node-rank", str(i)]
        if k > 1:
            argv += ["--dist-init-addr", addr]
        out.append(NodeLaunch(name, i, (first, end), tuple(argv), _env(idx)))
    return out, tuple(notes)


def _sglang_pd_note(plan: Plan, shape: _Shape, role: str, kv: KvTransfer) -> str:
    """What the router must send a SGLang prefill or decode server."""
    if role == "prefill":
        text = (
            f"SGLang prefill: the router sends bootstrap_host (this instance's first node), "
            f"bootstrap_port {kv.bootstrap_port} and a bootstrap_room with the request to "
            "both servers of the pair"
        )
    else:
        text = (
            "SGLang decode: each request names its prefill server by bootstrap_host, "
            "bootstrap_port and bootstrap_room, as the router sends them"
        )
    if shape.n // shape.tp > 1 and plan.engine.dp_balance == "router" and role == "prefill":
        text += (
            "; with routed DP ranks the router also sends disagg_prefill_dp_rank (SGLang's "
            "prefill default --load-balance-method follow_bootstrap_room otherwise fails a "
            "transfer whose routed rank is not bootstrap_room mod the DP size)"
        )
    return text


def _vllm(
    plan: Plan, shape: _Shape, path: str, model_path: str, addr: str, pd: _Pd = None
) -> tuple[list[NodeLaunch], tuple[str, ...]]:
    tp, k = shape.tp, len(shape.nodes)
    common = ["vllm", "serve", model_path, "--tensor-parallel-size", str(tp)]
    common += ["--data-parallel-size", str(shape.n // tp)]
    notes: list[str] = []
    if plan.moe_layers:
        common += ["--enable-expert-parallel", "--all2all-backend", plan.engine.a2a_backend]
        if vllm_needs_eplb(plan):
            eplb = vllm_eplb_config(plan.num_redundant)
            common += ["--enable-eplb", "--eplb-config", json.dumps(eplb, separators=(",", ":"))]
            notes.append(
                "--enable-eplb makes vLLM create the EplbState through which a placement is "
                f"installed (also with no redundant slot) and gives it the {plan.num_redundant} "
                f"redundant slots; step_interval {VLLM_NO_REBALANCE_STEP_INTERVAL} keeps its own "
                "rebalancing, which would overwrite the placement, from ever firing"
            )
        notes.append(_vllm_placement_note(plan, path))
    extra: dict[str, str] = {}
    if pd is not None:
        role, backend, _ = pd
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        config = {"kv_connector": backend, "kv_role": kv_role}
        common += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        if backend == "NixlConnector":
            extra["VLLM_NIXL_SIDE_CHANNEL_HOST"] = NODE_ADDR_REF
        notes.append(
            f"vLLM {role}: {backend} with kv_role {kv_role}; the router sends the prompt to "
            "the prefill server with kv_transfer_params {do_remote_decode: true} and "
            "max_tokens 1, then the decode request with the kv_transfer_params it returned"
        )
    host, port = _host_port(addr)
    out = []
    for i, (name, first, end, idx) in enumerate(shape.nodes):
        argv = list(common)
        if k > 1:
            argv += ["--data-parallel-size-local", str((end - first) // tp)]
            argv += ["--data-parallel-start-rank", str(first // tp)]
            argv += ["--data-parallel-address", host, "--data-parallel-rpc-port", port]
            if i > 0:
                argv.append("--headless")
        out.append(NodeLaunch(name, i, (first, end), tuple(argv), {**_env(idx), **extra}))
    return out, tuple(notes)


def _host_port(addr: str) -> tuple[str, str]:
    """``HOST:PORT`` split; the environment reference splits in the shell."""
    if addr == DIST_INIT_REF:
        return "${MIXFLEET_DIST_INIT_ADDR%:*}", "${MIXFLEET_DIST_INIT_ADDR##*:}"
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InputError(f"must be HOST:PORT, got {addr!r}", field="dist-init-addr")
    return host, port


def _vllm_placement_note(plan: Plan, path: str) -> str:
    rows = plan.physical_to_logical()
    default = vllm_default_rows(plan.num_experts, len(rows[0]) if rows else 0)
    if all(row == default for row in rows):
        return (
            "the plan's placement is vLLM's default layout (slot p holds expert p, redundant "
            "slot E+i expert i mod E), which vLLM loads on its own: it runs as planned"
        )
    return (
        f"vLLM loads no expert placement: no flag reads {path}; every MoE layer starts from "
        "its default layout (slot p holds expert p, redundant slot E+i expert i mod E) and "
        "EPLB only moves experts from measured load. To run this plan's placement, a launcher "
        f"must load {path} into EplbState and move the weights "
        "(rearrange_expert_weights_inplace) before serving; until then the plan's prediction "
        "does not hold"
    )


def _trtllm(
    plan: Plan, shape: _Shape, path: str, model_path: str, options_path: str, pd: _Pd = None
) -> tuple[list[NodeLaunch], tuple[str, ...], dict[str, Mapping[str, Any]]]:
    per_node = _equal_nodes("TensorRT-LLM", shape)
    if shape.tp != 1:
        raise InputError(
            f"TensorRT-LLM's attention DP runs attention on one GPU per rank; plan {plan.id} "
            f"has attention TP {shape.tp}. To fix: re-solve with attention TP 1",
            field="gpus",
        )
    options: dict[str, Any] = {"enable_attention_dp": True}
    flags = ["--backend", "pytorch", "--tp_size", str(shape.n)]
    if plan.moe_layers:
        if shape.n < 2:
            raise InputError(
                "TensorRT-LLM's MoE load balancer needs expert parallelism over 2 or more GPUs",
                field="gpus",
            )
        flags += ["--ep_size", str(shape.n)]
        options["moe_expert_parallel_size"] = shape.n
        options["moe_config"] = {"backend": "WIDEEP", "load_balancer": path}
    flags += ["--gpus_per_node", str(per_node), "--extra_llm_api_options", options_path]
    k = len(shape.nodes)
    head = ["trtllm-llmapi-launch", "trtllm-serve"] if k > 1 else ["trtllm-serve"]
    notes: tuple[str, ...] = ()
    if k > 1:
        hosts = ",".join(f"{name}:{per_node}" for name, *_ in shape.nodes)
        notes = (
            f"TensorRT-LLM runs the {shape.n} ranks as one MPI job, node by node in this "
            f"order, e.g. mpirun -H {hosts} -np {shape.n} (or srun --ntasks-per-node "
            f"{per_node}), each rank with its node's CUDA_VISIBLE_DEVICES",
        )
    if pd is not None:
        role, backend, _ = pd
        flags += ["--host", "0.0.0.0", "--port", str(TRTLLM_SERVER_PORT)]
        options["cache_transceiver_config"] = {"backend": backend}
        if role == "prefill":  # TensorRT-LLM's context servers run without the overlap scheduler
            options["disable_overlap_scheduler"] = True
        side = "context" if role == "prefill" else "generation"
        notes = (
            *notes,
            f"TensorRT-LLM {side} server: listens on port {TRTLLM_SERVER_PORT} of its first "
            f"node; trtllm-serve disaggregated -c <pool YAML> lists it under {side}_servers",
        )
    extra = {}
    if plan.moe_layers:  # the plan's one backend, not TensorRT-LLM's own pick
        extra["TRTLLM_FORCE_ALLTOALL_METHOD"] = _trtllm_method(plan.engine.a2a_backend)
    out = [
        NodeLaunch(name, i, (first, end), (*head, model_path, *flags), {**_env(idx), **extra})
        for i, (name, first, end, idx) in enumerate(shape.nodes)
    ]
    return out, notes, {options_path: options}


#: TensorRT-LLM's ``AlltoallMethodType`` of each backend mixfleet models.
_TRTLLM_METHODS = {"deepep": "DeepEP", "allgather_reducescatter": "NotEnabled"}


def _trtllm_method(backend: str) -> str:
    if backend not in _TRTLLM_METHODS:
        raise InputError(
            f"TensorRT-LLM has no all-to-all method for backend {backend!r} that the recipe "
            f"knows; known: {', '.join(_TRTLLM_METHODS)}",
            field="engine",
        )
    return _TRTLLM_METHODS[backend]


#: Where each engine's HTTP server reads a request's DP rank (the router writes it there;
#: controlplane/router/requests.py cites the engines' source). trtllm-serve has none.
_RANK_FIELD = {
    "sglang": "SGLang reads the body field routed_dp_rank",
    "vllm": "vLLM reads the header X-data-parallel-rank",
}


def _dp_note(plan: Plan, engine: str) -> str:
    """The recipe's note on DP attention shares, for the ``engine`` it starts."""
    if plan.engine.dp_balance == "engine":
        return "DP attention: the engine's own balancer gives every rank an equal share, as planned"
    field = _RANK_FIELD.get(engine)
    if field is None:
        return (
            f"DP attention: {engine} takes no per-request DP rank over HTTP, so its own "
            "balancer gives every rank an equal share, not the plan's dp_weight"
        )
    return (
        "DP attention: the plan's shares need the mixfleet router to pin each request's DP "
        f"rank to the dp_weight of the sidecar ({field}); the engine's own balancer would "
        "give equal shares instead"
    )


# ------------------------------------------------------------------------ fleet plans


@dataclass(frozen=True)
class PlannedInstance:
    """One engine instance of a deployment in a fleet plan.

    Attributes:
        name: ``<deployment>-<role>-<i>`` (``i`` counts the deployment's instances of that
            role from 0, in the document's order).
        pool: the pool it belongs to.
        role: ``aggregated``, ``prefill`` or ``decode``.
        nodes: its nodes, rank order.
        gpus: GPUs of the instance.
        attention_tp: its attention tensor-parallel size (1 = data-parallel attention).
        kv_path: prefill/decode: the pool's KV path in the planner's words ("" aggregated).
    """

    name: str
    pool: str
    role: str
    nodes: tuple[str, ...]
    gpus: int
    attention_tp: int
    kv_path: str = ""


_KIND_WORDS = {list: "a list", str: "a string", int: "an integer", Mapping: "a mapping"}


def _doc_field(doc: Any, key: str, kind: type, where: str) -> Any:
    """``doc[key]`` of type ``kind``, else an error naming ``where.key``."""
    if not isinstance(doc, Mapping) or key not in doc:
        raise InputError("missing", field=f"{where}.{key}")
    value = doc[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputError(
            f"must be {_KIND_WORDS.get(kind, kind.__name__)}, not {type(value).__name__}",
            field=f"{where}.{key}",
        )
    return value


def planned_instances(doc: Any, deployment: str) -> tuple[PlannedInstance, ...]:
    """The engine instances of ``deployment`` in a ``FleetPlan`` document
    (:func:`policies.fleetplan.report.plan_doc`), pool by pool.

    Raises:
        InputError: not a FleetPlan document; no such deployment (the ones there are
            named); a deployment nothing serves; a malformed pool or instance (the field is
            named).
    """
    from policies.fleetplan.types import ROLES

    if not isinstance(doc, Mapping) or doc.get("kind") != "FleetPlan":
        raise InputError(
            "not a FleetPlan document (kind: FleetPlan). To fix: write one with mixfleetctl "
            "schedule show --fleet FLEET -f DEPLOYMENTS -o json",
            field="kind",
        )
    deployments = _doc_field(doc, "deployments", list, "FleetPlan")
    names = [d.get("name") for d in deployments if isinstance(d, Mapping)]
    if deployment not in names:
        raise InputError(
            f"the fleet plan has no deployment {deployment!r}; it has "
            f"{', '.join(str(n) for n in names) or 'none'}",
            field="deployment",
        )
    d = deployments[names.index(deployment)]
    pools = _doc_field(d, "pools", list, f"deployments[{deployment}]")
    out: list[PlannedInstance] = []
    counts = dict.fromkeys(ROLES, 0)
    for pi, pool in enumerate(pools):
        where = f"deployments[{deployment}].pools[{pi}]"
        pool_name = _doc_field(pool, "name", str, where)
        groups = _doc_field(pool, "instances", list, where)
        roles = [g.get("role") if isinstance(g, Mapping) else None for g in groups]
        pd = roles == ["prefill", "decode"]
        if roles != ["aggregated"] and not pd:
            raise InputError(
                f"instance roles {roles}: a pool is one aggregated group, or a prefill then "
                "a decode group",
                field=f"{where}.instances",
            )
        kv_path = ""
        if pd:
            kv_path = str(_doc_field(pool, "kvPath", Mapping, where).get("path") or "")
        for gi, g in enumerate(groups):
            at = f"{where}.instances[{gi}]"
            role = str(roles[gi])
            gpus = _doc_field(g, "gpus", int, at)
            tp = _doc_field(g, "attentionTp", int, at)
            node_lists = _doc_field(g, "nodes", list, at)
            if len(node_lists) != _doc_field(g, "count", int, at):
                raise InputError(
                    f"{len(node_lists)} node lists for count {g['count']}", field=f"{at}.nodes"
                )
            for nodes in node_lists:
                if (
                    not isinstance(nodes, list)
                    or not nodes
                    or not all(isinstance(n, str) for n in nodes)
                ):
                    raise InputError(
                        "must be a list of node-name lists, one per instance",
                        field=f"{at}.nodes",
                    )
                name = f"{deployment}-{role}-{counts[role]}"
                counts[role] += 1
                out.append(PlannedInstance(name, pool_name, role, tuple(nodes), gpus, tp, kv_path))
    if not out:
        raise InputError(
            f"the fleet plan serves {deployment} with no instance (see its shortfalls)",
            field="deployment",
        )
    return tuple(out)


def instance_request(
    spec: DeploymentSpec, fleet: Fleet, instance: PlannedInstance
) -> PlacementRequest:
    """The placement request of one instance: the deployment's own
    (:func:`policies.spec.build_request`: model, workload, policy, engine) on the instance's
    nodes.

    Raises:
        InputError: a node the fleet does not have; an invalid spec.
    """
    from policies.deployment import sub_fleet
    from policies.spec import build_request

    return build_request(spec, sub_fleet(fleet, instance.nodes, f"{fleet.name}/{instance.name}"))


def instance_path(path: str, instance: str) -> str:
    """``path`` with ``-<instance>`` before its suffix: each instance's own file
    (``/etc/mixfleet/expert-location.json`` -> ``.../expert-location-dsv3-prefill-0.json``)."""
    head, sep, tail = path.rpartition("/")
    stem, dot, ext = tail.rpartition(".")
    name = f"{stem}-{instance}.{ext}" if dot and stem else f"{tail}-{instance}"
    return f"{head}{sep}{name}"


def trtllm_disagg_config(
    context_urls: Sequence[str],
    generation_urls: Sequence[str],
    *,
    hostname: str = "0.0.0.0",
    port: int = TRTLLM_SERVER_PORT,
) -> dict[str, Any]:
    """The YAML ``trtllm-serve disaggregated -c FILE`` reads for one prefill/decode pool
    (``tensorrt_llm/llmapi/disagg_utils.py`` ``extract_disagg_cfg``): where it listens and
    the ``HOST:PORT`` of its context (prefill) and generation (decode) servers."""
    if not context_urls or not generation_urls:
        raise InputError(
            "a TensorRT-LLM disaggregated server needs a context and a generation server",
            field="instances",
        )
    for url in (*context_urls, *generation_urls):
        host, sep, p = url.partition(":")
        if not host or not sep or not p.isdigit() or ":" in p:
            raise InputError(f"server URL {url!r} is not HOST:PORT", field="urls")
    return {
        "hostname": hostname,
        "port": port,
        "backend": "pytorch",
        "context_servers": {"num_instances": len(context_urls), "urls": list(context_urls)},
        "generation_servers": {
            "num_instances": len(generation_urls),
            "urls": list(generation_urls),
        },
    }


@dataclass(frozen=True)
class InstanceLaunch:
    """One engine instance's launch.

    Attributes:
        instance: where the fleet plan puts it.
        recipe: its per-node launch.
    """

    instance: PlannedInstance
    recipe: LaunchRecipe


@dataclass(frozen=True)
class DeploymentLaunch:
    """Every engine instance of one deployment in a fleet plan.

    Attributes:
        deployment: its name.
        engine: ``sglang 0.5.23``.
        instances: per instance, pool by pool.
        files: documents besides the instances' own (TensorRT-LLM: per prefill/decode pool
            the disaggregated server's YAML, ``disagg-<deployment>-<i>.yaml`` beside the
            options files), by path.
    """

    deployment: str
    engine: str
    instances: tuple[InstanceLaunch, ...]
    files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def deployment_launch(
    deployment: str,
    instances: Sequence[PlannedInstance],
    plans: Sequence[Plan],
    model: ModelSpec,
    *,
    engine: str | None = None,
    transfer_backend: str = "",
    bootstrap_port: int = SGLANG_BOOTSTRAP_PORT,
    placement_path: str | None = None,
    options_path: str = TRTLLM_OPTIONS_FILE,
    model_path: str = MODEL_PATH_REF,
) -> DeploymentLaunch:
    """Each instance's recipe (:func:`launch_recipe` of its placement plan, as its role),
    with its own placement and options files (:func:`instance_path`) and, for TensorRT-LLM,
    each prefill/decode pool's disaggregated server YAML.

    Args:
        deployment: the deployment's name.
        instances: its instances (:func:`planned_instances`).
        plans: per instance, the placement plan solved on its nodes (same order).
        model: the model.
        engine: the engine to start (None: the plans').
        transfer_backend: the KV transfer backend ("" = the engine's default for the path).
        bootstrap_port: SGLang prefill servers' bootstrap port.
        placement_path: the placement file name the instance files derive from.
        options_path: TensorRT-LLM: the options file name the instance files derive from.
        model_path: weights directory or Hugging Face id.

    Raises:
        InputError: a plan on other nodes or GPUs than its instance; any refusal of
            :func:`launch_recipe` (named by instance).
    """
    if len(plans) != len(instances):
        raise InputError(f"{len(instances)} instances but {len(plans)} plans", field="plans")
    out: list[InstanceLaunch] = []
    for inst, plan in zip(instances, plans, strict=True):
        nodes = tuple(dict.fromkeys(g.node for g in plan.gpus))
        if set(nodes) != set(inst.nodes) or len(plan.gpus) != inst.gpus:
            raise InputError(
                f"instance {inst.name} runs on {', '.join(inst.nodes)} ({inst.gpus} GPUs); "
                f"its plan {plan.id} is on {', '.join(nodes)} ({len(plan.gpus)} GPUs)",
                field="plans",
            )
        name = engine or plan.engine.name
        path = placement_path or PLACEMENT_FILES.get(name, "placement.json")
        kv = None
        if inst.role != "aggregated":
            kv = KvTransfer(inst.kv_path, transfer_backend, bootstrap_port)
        try:
            recipe = launch_recipe(
                plan,
                model,
                engine=engine,
                placement_path=instance_path(path, inst.name),
                model_path=model_path,
                options_path=instance_path(options_path, inst.name),
                role=inst.role,
                kv=kv,
            )
        except InputError as exc:
            raise InputError(f"instance {inst.name}: {exc}") from exc
        out.append(InstanceLaunch(inst, recipe))
    files: dict[str, Mapping[str, Any]] = {}
    if out and out[0].recipe.engine.startswith("trtllm"):
        for pool in dict.fromkeys(i.instance.pool for i in out):
            members = [i for i in out if i.instance.pool == pool]
            ctx = [
                f"{i.instance.nodes[0]}:{TRTLLM_SERVER_PORT}"
                for i in members
                if i.instance.role == "prefill"
            ]
            gen = [
                f"{i.instance.nodes[0]}:{TRTLLM_SERVER_PORT}"
                for i in members
                if i.instance.role == "decode"
            ]
            if ctx and gen:
                head, sep, _ = options_path.rpartition("/")
                key = f"{head}{sep}disagg-{deployment}-{len(files)}.yaml"
                files[key] = trtllm_disagg_config(ctx, gen)
    return DeploymentLaunch(deployment, out[0].recipe.engine if out else "", tuple(out), files)


def deployment_launch_to_doc(launch: DeploymentLaunch) -> dict[str, Any]:
    """The deployment's launch as plain JSON values: per instance its pool, role, nodes and
    recipe (:func:`recipe_to_doc`), and the pool-level files."""
    return {
        "deployment": launch.deployment,
        "engine": launch.engine,
        "instances": [
            {
                "name": i.instance.name,
                "pool": i.instance.pool,
                "role": i.instance.role,
                "nodes": list(i.instance.nodes),
                "recipe": recipe_to_doc(i.recipe),
            }
            for i in launch.instances
        ],
        "files": {k: dict(v) for k, v in launch.files.items()},
    }


# ------------------------------------------------------------------------ rendering

_REF_TOKEN = re.compile(
    r'^(?:[^"`\\$]|\$\{[A-Z_][A-Z0-9_]*(?:(?:%|%%|#|##|:-|:\?)[^}"`\\$]*)?\})*$'
)


def shell_word(token: str) -> str:
    """``token`` quoted for ``sh``: single quotes, or double quotes when it holds one of the
    ``${...}`` references (so the shell expands it and nothing else)."""
    if "${" in token and _REF_TOKEN.match(token):
        return f'"{token}"'
    return shlex.quote(token)


def node_command(launch: NodeLaunch) -> str:
    """One node's environment and command as one ``sh`` command, a flag per line."""
    words = [f"{k}={shell_word(v)}" for k, v in launch.env.items()]
    words += [shell_word(t) for t in launch.argv]
    lines: list[str] = []
    for w in words:
        if lines and not w.startswith("--"):
            lines[-1] += " " + w
        else:
            lines.append(w)
    return " \\\n    ".join(lines)


def launch_script(recipe: LaunchRecipe, *, node_var: str = "MIXFLEET_NODE") -> str:
    """An ``sh`` script that runs this node's launch, the node named by ``$node_var``."""
    names = ", ".join(n.node for n in recipe.nodes)
    out = [
        "#!/bin/sh",
        f"# plan {recipe.plan_id} on {recipe.engine}, written by mixfleet: set {node_var} to",
        "# this node's name and run it on every node of the plan.",
        *(f"# note: {n}" for n in recipe.notes),
        "set -eu",
        f'case "${{{node_var}:?set {node_var} to the name of this node}}" in',
    ]
    for n in recipe.nodes:
        env = " ".join(f"{k}={shell_word(v)}" for k, v in n.env.items())
        argv = " ".join(shell_word(t) for t in n.argv)
        out += [f"  {shlex.quote(n.node)})", f"    export {env}", f"    exec {argv}", "    ;;"]
    out += [
        "  *)",
        f'    echo "node ${node_var} is not in plan {recipe.plan_id} (nodes: {names})" >&2',
        "    exit 1",
        "    ;;",
        "esac",
    ]
    return "\n".join(out) + "\n"


def failing_script(reason: str) -> str:
    """An ``sh`` script that refuses to start, saying why (a plan no recipe exists for)."""
    return f"#!/bin/sh\necho {shlex.quote('mixfleet: no launch recipe: ' + reason)} >&2\nexit 1\n"


def recipe_to_doc(recipe: LaunchRecipe) -> dict[str, Any]:
    """The recipe as plain JSON values."""
    pd: dict[str, Any] = {}
    if recipe.role != "aggregated":
        kv: dict[str, Any] = {"backend": recipe.transfer_backend}
        if recipe.bootstrap_port is not None:
            kv["bootstrap_port"] = recipe.bootstrap_port
        pd["kv_transfer"] = kv
    return {
        "plan_id": recipe.plan_id,
        "engine": recipe.engine,
        "role": recipe.role,
        **pd,
        "nodes": [
            {
                "node": n.node,
                "node_rank": n.node_rank,
                "ranks": list(n.rank_range),
                "argv": list(n.argv),
                "env": dict(n.env),
            }
            for n in recipe.nodes
        ],
        "files": {k: dict(v) for k, v in recipe.files.items()},
        "notes": list(recipe.notes),
    }
