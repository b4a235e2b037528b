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

``CUDA_VISIBLE_DEVICES`` lists each node's GPU indices (from the plan's ``node/gpuN`` ids, NVML
order, hence ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) in rank order. Values not known when the
recipe is built are shell references the caller's environment fills: ``${MIXFLEET_MODEL_PATH}``
and ``${MIXFLEET_DIST_INIT_ADDR}`` (``HOST:PORT`` of node 0).

Pure: builds values and text, does no I/O.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.defaults import PLACEMENT_FILES as PLACEMENT_FILES  # one default: policies.defaults
from policies.defaults import TRTLLM_OPTIONS_FILE as TRTLLM_OPTIONS_FILE
from policies.engines import PINNED_VERSIONS
from policies.errors import InputError
from policies.execution import SGLANG_PLACEMENT_FAMILIES
from policies.exports import VLLM_NO_REBALANCE_STEP_INTERVAL, vllm_eplb_config, vllm_needs_eplb
from policies.exports import vllm_default_rows as vllm_default_rows  # one owner: exports
from policies.models import ModelSpec
from policies.plan import Plan, validate_plan

MODEL_PATH_REF = "${MIXFLEET_MODEL_PATH}"
"""The model path when none is given: the weights directory or Hugging Face id, from the
environment."""
DIST_INIT_REF = "${MIXFLEET_DIST_INIT_ADDR}"
"""Node 0's ``HOST:PORT`` when none is given (multi-node only), from the environment."""


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
class LaunchRecipe:
    """How to start the engine of a plan.

    Attributes:
        plan_id: the plan.
        engine: ``sglang 0.5.23`` (engine and version whose flags these are).
        nodes: per node, rank order.
        files: documents the commands read besides the placement file, by path (the
            TensorRT-LLM options YAML).
        notes: what the caller must know (what the engine cannot load, DP routing).
    """

    plan_id: str
    engine: str
    nodes: tuple[NodeLaunch, ...]
    files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


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
) -> LaunchRecipe:
    """The per-node launch of ``plan`` on the engine it was solved for.

    Args:
        plan: a feasible plan solved for ``sglang``, ``vllm`` or ``trtllm``.
        model: the plan's model (its family decides what SGLang can load).
        engine: the engine the caller means to run; must be the plan's (None: the plan's).
        placement_path: path of the exported placement file as the engine will see it
            (default :data:`PLACEMENT_FILES`).
        model_path: weights directory or Hugging Face id.
        dist_init_addr: ``HOST:PORT`` of node 0 (used with several nodes).
        options_path: TensorRT-LLM only: where the options YAML will be.

    Raises:
        InputError: an infeasible plan; a native plan or one for another engine; a node
            whose ranks are not contiguous; a shape or model the engine cannot run.
    """
    name = _check_plan(plan, model, engine)
    shape = _shape(plan)
    path = placement_path or PLACEMENT_FILES[name]
    if name == "sglang":
        nodes, notes = _sglang(plan, shape, path, model_path, dist_init_addr)
        files: dict[str, Mapping[str, Any]] = {}
    elif name == "vllm":
        nodes, notes = _vllm(plan, shape, path, model_path, dist_init_addr)
        files = {}
    else:
        nodes, notes, files = _trtllm(plan, shape, path, model_path, options_path)
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
    )


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


def _sglang(
    plan: Plan, shape: _Shape, path: str, model_path: str, addr: str
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
    out = []
    for i, (name, first, end, idx) in enumerate(shape.nodes):
        argv = [*common, "--nnodes", str(k), "--node-rank", str(i)]
        if k > 1:
            argv += ["--dist-init-addr", addr]
        out.append(NodeLaunch(name, i, (first, end), tuple(argv), _env(idx)))
    return out, ()


def _vllm(
    plan: Plan, shape: _Shape, path: str, model_path: str, addr: str
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
        out.append(NodeLaunch(name, i, (first, end), tuple(argv), _env(idx)))
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
    plan: Plan, shape: _Shape, path: str, model_path: str, options_path: str
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
    return {
        "plan_id": recipe.plan_id,
        "engine": recipe.engine,
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
