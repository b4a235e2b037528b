"""One plan's launch recipe: the checks that refuse what no engine can run as predicted,
the plan's parallel shape, and the KV transfer backend of a prefill/decode server.

Pure: builds values, does no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from policies.defaults import PLACEMENT_FILES, TRTLLM_OPTIONS_FILE
from policies.errors import InputError
from policies.estimate.engines import PINNED_VERSIONS
from policies.estimate.execution import SGLANG_PLACEMENT_FAMILIES
from policies.launch.engines import dp_note, sglang_nodes, trtllm_nodes, vllm_nodes
from policies.launch.types import (
    DIST_INIT_REF,
    MODEL_PATH_REF,
    TRANSFER_BACKENDS,
    KvTransfer,
    LaunchRecipe,
    Shape,
)
from policies.model.architecture import ModelSpec
from policies.plan import Plan, validate_plan

_GPU_ID = re.compile(r"^(?P<node>.+)/gpu(?P<index>\d+)$")


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
        nodes, notes = sglang_nodes(plan, shape, path, model_path, dist_init_addr, pd)
        files: dict[str, Mapping[str, Any]] = {}
    elif name == "vllm":
        nodes, notes = vllm_nodes(plan, shape, path, model_path, dist_init_addr, pd)
        files = {}
    else:
        nodes, notes, files = trtllm_nodes(plan, shape, path, model_path, options_path, pd)
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
        (*notes, dp_note(plan, name)),
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


def _shape(plan: Plan) -> Shape:
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
    return Shape(len(plan.gpus), tp, tuple(nodes))
