"""Each engine's command line for a plan's shape: SGLang, vLLM and TensorRT-LLM, with the
notes the caller must know (what the engine cannot load, DP routing, prefill/decode roles).

:func:`policies.launch.recipe.launch_recipe` checks the plan and picks the engine; the
functions here only spell its flags. Pure: builds values, does no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from policies.errors import InputError
from policies.exports.engine import (
    VLLM_NO_REBALANCE_STEP_INTERVAL,
    vllm_default_rows,
    vllm_eplb_config,
    vllm_needs_eplb,
)
from policies.launch.types import (
    DIST_INIT_REF,
    NODE_ADDR_REF,
    TRTLLM_SERVER_PORT,
    KvTransfer,
    NodeLaunch,
    PdServer,
    Shape,
)
from policies.plan import Plan


def _env(indices: Sequence[int]) -> dict[str, str]:
    """A node's CUDA device environment: its GPU indices in rank order, NVML numbering."""
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in indices),
    }


def _equal_nodes(engine: str, shape: Shape) -> int:
    """GPUs per node, refusing unequal nodes (SGLang and TensorRT-LLM assume equal)."""
    counts = {name: end - first for name, first, end, _ in shape.nodes}
    if len(set(counts.values())) > 1:
        raise InputError(
            f"{engine} runs nodes with the same number of GPUs each; the plan has {counts}. "
            "To fix: use equal GPU counts per node (fleet or deployment node selection)",
            field="gpus",
        )
    return next(iter(counts.values()))


def sglang_nodes(
    plan: Plan, shape: Shape, path: str, model_path: str, addr: str, pd: PdServer = None
) -> tuple[list[NodeLaunch], tuple[str, ...]]:
    """SGLang's ``launch_server`` per node (placement file ``path``, node 0 at ``addr``), and
    the recipe's notes."""
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


def _sglang_pd_note(plan: Plan, shape: Shape, role: str, kv: KvTransfer) -> str:
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


def vllm_nodes(
    plan: Plan, shape: Shape, path: str, model_path: str, addr: str, pd: PdServer = None
) -> tuple[list[NodeLaunch], tuple[str, ...]]:
    """``vllm serve`` per node (one DP group over all nodes, node 0 at ``addr``), and the
    recipe's notes (``path``: the placement file vLLM cannot load)."""
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


def trtllm_nodes(
    plan: Plan, shape: Shape, path: str, model_path: str, options_path: str, pd: PdServer = None
) -> tuple[list[NodeLaunch], tuple[str, ...], dict[str, Mapping[str, Any]]]:
    """``trtllm-serve`` per node, the recipe's notes, and the options YAML (at
    ``options_path``, naming the load balancer file ``path``) by path."""
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


def dp_note(plan: Plan, engine: str) -> str:
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
