"""A deployment's launch from a fleet plan: its engine instances (pool, role, nodes, KV
path) read from a ``FleetPlan`` document, each instance's recipe and files, and TensorRT-LLM's
disaggregated server YAML per prefill/decode pool.

Pure: builds values, does no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from policies.defaults import PLACEMENT_FILES, TRTLLM_OPTIONS_FILE
from policies.errors import InputError
from policies.launch.recipe import launch_recipe
from policies.launch.render import recipe_to_doc
from policies.launch.types import (
    MODEL_PATH_REF,
    SGLANG_BOOTSTRAP_PORT,
    TRTLLM_SERVER_PORT,
    KvTransfer,
    LaunchRecipe,
)
from policies.limits import MAX_WIRE_INT32
from policies.model.architecture import ModelSpec
from policies.plan import Plan

if TYPE_CHECKING:
    from policies.hardware.fleet import Fleet
    from policies.request import PlacementRequest
    from policies.spec.build import DeploymentSpec


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
        workload: what the planner sized the instance for, per GPU: ``(phase, tokens per
            GPU, context tokens)`` (the group's ``workload``); None in a document without it.
        variant: the planner's variant key (``<make-up>/<role>``; "" when not stated).
        batch_limit: most sequences it runs (prefill: prompt tokens per forward); 0 = not
            stated.
        requests_per_s: traffic the plan sends it (its pool's share split evenly over the
            pool's instances of its role), requests per second.
        capacity_requests_per_s: what one instance of its variant serves within the SLO,
            requests per second.
        ttft_ms: its pool's predicted TTFT at the SLO percentile, ms.
        tpot_ms: its pool's predicted TPOT, ms.
    """

    name: str
    pool: str
    role: str
    nodes: tuple[str, ...]
    gpus: int
    attention_tp: int
    kv_path: str = ""
    workload: tuple[str, int, int] | None = None
    variant: str = ""
    batch_limit: int = 0
    requests_per_s: float = 0.0
    capacity_requests_per_s: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


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
    from policies.fleetplan.instances import instance_name
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
        base = PlannedInstance(
            "",
            pool_name,
            "",
            (),
            0,
            1,
            kv_path,
            requests_per_s=_number(pool, "requestsPerS", where),
            ttft_ms=_number(pool.get("predicted"), "ttftMs", f"{where}.predicted"),
            tpot_ms=_number(pool.get("predicted"), "tpotMs", f"{where}.predicted"),
        )
        for gi, g in enumerate(groups):
            role = str(roles[gi])
            for nodes, inst in _group_instances(g, f"{where}.instances[{gi}]", role, base):
                name = instance_name(deployment, role, counts[role])
                counts[role] += 1
                out.append(replace(inst, name=name, nodes=nodes))
    if not out:
        raise InputError(
            f"the fleet plan serves {deployment} with no instance (see its shortfalls)",
            field="deployment",
        )
    return tuple(out)


def _group_instances(
    g: Any, at: str, role: str, pool: PlannedInstance
) -> list[tuple[tuple[str, ...], PlannedInstance]]:
    """Per instance of the group document ``g`` (at ``at``) its nodes and what it is, from
    ``pool`` (its pool's name, KV path, share and predictions: the share is split evenly
    over the group's instances)."""
    gpus = _doc_field(g, "gpus", int, at)
    tp = _doc_field(g, "attentionTp", int, at)
    node_lists = _doc_field(g, "nodes", list, at)
    if len(node_lists) != _doc_field(g, "count", int, at):
        raise InputError(
            f"{len(node_lists)} node lists for count {g['count']}", field=f"{at}.nodes"
        )
    inst = replace(
        pool,
        role=role,
        gpus=gpus,
        attention_tp=tp,
        workload=_planned_workload(g.get("workload"), f"{at}.workload"),
        variant=str(g.get("variant") or ""),
        batch_limit=int(_number(g, "batchLimit", at)),
        requests_per_s=pool.requests_per_s / max(1, len(node_lists)),
        capacity_requests_per_s=_number(g, "requestsPerSEach", at),
    )
    out = []
    for nodes in node_lists:
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise InputError(
                "must be a list of node-name lists, one per instance", field=f"{at}.nodes"
            )
        out.append((tuple(nodes), inst))
    return out


def _number(doc: Any, key: str, where: str) -> float:
    """An optional non-negative finite number ``doc[key]`` (0 when absent)."""
    if not isinstance(doc, Mapping) or doc.get(key) is None:
        return 0.0
    value = doc[key]
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise InputError(f"must be a number >= 0, not {value!r}", field=f"{where}.{key}")
    return float(value)


def _planned_workload(doc: Any, where: str) -> tuple[str, int, int] | None:
    """A group's ``workload`` block (``{phase, tokensPerGpu, contextLen}``), or None when the
    document has none."""
    if doc is None:
        return None
    phase = _doc_field(doc, "phase", str, where)
    if phase not in ("prefill", "decode"):
        raise InputError(f"must be prefill or decode, not {phase!r}", field=f"{where}.phase")
    tokens = _doc_field(doc, "tokensPerGpu", int, where)
    context = _doc_field(doc, "contextLen", int, where)
    for key, value in (("tokensPerGpu", tokens), ("contextLen", context)):
        if not 1 <= value <= MAX_WIRE_INT32:
            raise InputError(f"must be from 1 to {MAX_WIRE_INT32}", field=f"{where}.{key}")
    return phase, tokens, context


def instance_request(
    spec: DeploymentSpec, fleet: Fleet, instance: PlannedInstance
) -> PlacementRequest:
    """The placement request of one instance: the deployment's own
    (:func:`policies.spec.build.build_request`: model, policy, engine) on the instance's nodes, at
    the workload the fleet planner sized the instance for (its phase, batch and context;
    the deployment's own workload when the document states none).

    Raises:
        InputError: a node the fleet does not have; an invalid spec.
    """
    from policies.deployment import sub_fleet
    from policies.spec.build import build_request

    spec = replace(instance_spec(spec, instance), name=spec.name)
    return build_request(spec, sub_fleet(fleet, instance.nodes, f"{fleet.name}/{instance.name}"))


def instance_spec(spec: DeploymentSpec, instance: PlannedInstance) -> DeploymentSpec:
    """The deployment one engine instance runs as: ``spec`` renamed to the instance, planned
    for the workload the fleet planner sized it for (its phase, batch and context; the
    deployment's own workload when none is stated), without the demand, SLOs, budget and
    GPU bounds (those belong to the deployment the instance serves, which the fleet planner
    plans; the instance is planned as one engine on its nodes)."""
    from policies.spec.types import Budget

    w = spec.workload
    if instance.workload is not None:
        phase, tokens, context = instance.workload
        w = replace(
            w, phase=phase, tokens_per_gpu=tokens, tokens_per_gpu_set=True, context_len=context
        )
    return replace(
        spec,
        name=instance.name,
        workload=w,
        traffic=None,
        slo=None,
        disaggregation="off",
        budget=Budget(),
        min_gpus=0,
        max_gpus=0,
    )


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
    files = _trtllm_pool_files(deployment, out, options_path)
    return DeploymentLaunch(deployment, out[0].recipe.engine if out else "", tuple(out), files)


def _trtllm_pool_files(
    deployment: str, launches: Sequence[InstanceLaunch], options_path: str
) -> dict[str, Mapping[str, Any]]:
    """TensorRT-LLM: per prefill/decode pool, the disaggregated server's YAML
    (:func:`trtllm_disagg_config`), at ``disagg-<deployment>-<i>.yaml`` beside
    ``options_path``; none for another engine or an aggregated pool."""
    files: dict[str, Mapping[str, Any]] = {}
    if not launches or not launches[0].recipe.engine.startswith("trtllm"):
        return files
    for pool in dict.fromkeys(i.instance.pool for i in launches):
        members = [i for i in launches if i.instance.pool == pool]
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
    return files


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
