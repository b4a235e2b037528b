"""``mixfleetctl plan launch``: the command line and environment that start a plan's engine.

Per node, in the plan's rank order: the environment (``CUDA_VISIBLE_DEVICES`` in rank order)
and the engine's command (:func:`policies.launch.launch_recipe`), as ``sh`` lines to paste or
as a JSON/YAML document (``-o``). The plan must be feasible and solved for the engine
(``plan solve --engine sglang|vllm|trtllm``); the export file the commands read is named by
``--placement-file`` (write it with ``plan export``).

``--role prefill|decode`` starts the plan as one side of a prefill/decode pool over
``--kv-path`` (``rdma`` or ``nvlink``, or the planner's words) with ``--transfer-backend``.
``--fleet-plan FILE --deployment NAME`` (a ``FleetPlan`` document of ``schedule show -o
json``, with the ``--fleet`` and ``-f`` deployments it was planned from) prints every
instance of the deployment: its role, and per node the environment and command, each
instance's placement solved on its own nodes with the deployment's spec; TensorRT-LLM
prefill/decode pools also get the disaggregated server's YAML.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from apis.cliargs import positive_int
from controlplane.cli import files
from controlplane.cli.output import Groups, add_leaf, add_output_arg, emit, emit_document, notes
from policies.defaults import PLACEMENT_FILES, TRTLLM_OPTIONS_FILE
from policies.estimate.engines import ENGINES

if TYPE_CHECKING:
    from policies.launch import DeploymentLaunch, LaunchRecipe
    from policies.model.architecture import ModelSpec


def launch_text(recipe: LaunchRecipe) -> str:
    """The recipe as commented ``sh`` lines: one block per node, then the files it reads."""
    from policies.launch import node_command

    k = len(recipe.nodes)
    ranks = recipe.nodes[-1].rank_range[1] if recipe.nodes else 0
    role = "" if recipe.role == "aggregated" else f", {recipe.role} server"
    if recipe.transfer_backend:
        role += f" (KV over {recipe.transfer_backend})"
    lines = [f"# plan {recipe.plan_id} on {recipe.engine}{role}: {ranks} ranks on {k} nodes"]
    lines += [f"# note: {n}" for n in recipe.notes]
    for n in recipe.nodes:
        first, end = n.rank_range
        lines += ["", f"# node {n.node} (node rank {n.node_rank}): ranks {first}-{end - 1}"]
        lines.append(node_command(n))
    for path, doc in recipe.files.items():
        lines += ["", f"# file {path} (--write-options writes it):"]
        lines += [f"#   {line}" for line in files.dump_document(doc, "yaml").splitlines()]
    return "\n".join(lines)


def deployment_text(launch: DeploymentLaunch) -> str:
    """Every instance's block (:func:`launch_text`) under a header naming its pool and role,
    then the pool-level files."""
    lines = [
        f"# deployment {launch.deployment} on {launch.engine}: {len(launch.instances)} instances"
    ]
    for i in launch.instances:
        inst = i.instance
        lines += [
            "",
            f"# === instance {inst.name}: {inst.role} in pool {inst.pool}, nodes "
            + ", ".join(inst.nodes),
            launch_text(i.recipe),
        ]
    for path, doc in launch.files.items():
        lines += ["", f"# file {path} (trtllm-serve disaggregated -c {path}; --write-options):"]
        lines += [f"#   {line}" for line in files.dump_document(doc, "yaml").splitlines()]
    return "\n".join(lines)


def _preset(name: str) -> ModelSpec:
    from policies.model.architecture import preset

    return preset(name)


def cmd_plan_launch(args: argparse.Namespace) -> int:
    """``plan launch --plan PLAN`` or ``--fleet-plan FILE --deployment NAME``: each node's
    environment and engine command."""
    from policies.errors import InputError
    from policies.launch import (
        DIST_INIT_REF,
        MODEL_PATH_REF,
        KvTransfer,
        launch_recipe,
        recipe_to_doc,
    )

    if (args.plan is None) == (args.fleet_plan is None):
        raise InputError("give --plan FILE or --fleet-plan FILE (one of them)")
    if args.fleet_plan is not None:
        return _fleet_plan_launch(args)
    for flag in ("deployment", "fleet", "file"):
        if getattr(args, flag):
            name = "-f" if flag == "file" else f"--{flag}"
            raise InputError("goes with --fleet-plan, not --plan", field=name)
    kv = None
    if args.role != "aggregated":
        if not args.kv_path:
            raise InputError(
                f"a {args.role} server needs its pool's KV path (rdma or nvlink)",
                field="--kv-path",
            )
        kv = KvTransfer(args.kv_path, args.transfer_backend or "", _port(args))
    elif args.kv_path or args.transfer_backend:
        raise InputError(
            "--kv-path and --transfer-backend are for a prefill or decode server",
            field="--role",
        )
    plan = files.read_plan(args.plan)
    model = files.read_model_config(args.model_config) if args.model_config else _preset(plan.model)
    recipe = launch_recipe(
        plan,
        model,
        engine=args.engine,
        placement_path=args.placement_file,
        model_path=args.model_path or MODEL_PATH_REF,
        dist_init_addr=args.dist_init_addr or DIST_INIT_REF,
        options_path=args.options_file,
        role=args.role,
        kv=kv,
    )
    if not args.model_path:
        notes(args)("--model-path not given: the commands read $MIXFLEET_MODEL_PATH")
    if len(recipe.nodes) > 1 and not args.dist_init_addr:
        notes(args)("--dist-init-addr not given: the commands read $MIXFLEET_DIST_INIT_ADDR")
    if args.write_options:
        for path, doc in recipe.files.items():
            written = files.write_document(path, doc, "engine options")
            notes(args)(f"wrote {written}")
    if args.output == "table":
        emit(launch_text(recipe))
    else:
        names = [f"node/{n.node}" for n in recipe.nodes]
        emit_document(recipe_to_doc(recipe), args.output, names)
    return 0


def _port(args: argparse.Namespace) -> int:
    """``--bootstrap-port``, or SGLang's default."""
    from policies.launch import SGLANG_BOOTSTRAP_PORT

    return int(args.bootstrap_port) if args.bootstrap_port is not None else SGLANG_BOOTSTRAP_PORT


def _fleet_plan_launch(args: argparse.Namespace) -> int:
    """``plan launch --fleet-plan FILE --deployment NAME --fleet FLEET -f DEPLOYMENTS``."""
    from controlplane.cli.deploy import _read_docs
    from policies.errors import InputError
    from policies.launch import (
        MODEL_PATH_REF,
        deployment_launch,
        deployment_launch_to_doc,
        instance_request,
        planned_instances,
    )
    from policies.solve import solve
    from policies.spec.build import parse_deployment, resolve_model

    for flag in ("deployment", "fleet", "file"):
        if not getattr(args, flag):
            name = "-f" if flag == "file" else f"--{flag}"
            raise InputError("needed with --fleet-plan", field=name)
    if args.role != "aggregated" or args.kv_path or args.dist_init_addr:
        raise InputError(
            "--role, --kv-path and --dist-init-addr go with --plan: a fleet plan names each "
            "instance's role and KV path, and each instance reads $MIXFLEET_DIST_INIT_ADDR",
            field="--role",
        )
    doc = files.read_document(args.fleet_plan, "plan")
    instances = planned_instances(doc, args.deployment)
    fleet = files.read_fleet(args.fleet)
    specs = [parse_deployment(d) for path in args.file for d in _read_docs(path)]
    spec = next((s for s in specs if s.name == args.deployment), None)
    if spec is None:
        raise InputError(
            f"-f gives no deployment {args.deployment!r} (the fleet plan's spec is needed for "
            "its model and engine)",
            field="-f",
        )
    say = notes(args)
    plans = []
    for inst in instances:
        say(f"solving the placement of {inst.name} on {', '.join(inst.nodes)}")
        try:
            plans.append(solve(instance_request(spec, fleet, inst)).plan)
        except InputError as exc:
            raise InputError(f"instance {inst.name}: {exc}") from exc
    launch = deployment_launch(
        args.deployment,
        instances,
        plans,
        resolve_model(spec),
        engine=args.engine,
        transfer_backend=args.transfer_backend or "",
        bootstrap_port=_port(args),
        placement_path=args.placement_file,
        options_path=args.options_file,
        model_path=args.model_path or MODEL_PATH_REF,
    )
    if not args.model_path:
        say("--model-path not given: the commands read $MIXFLEET_MODEL_PATH")
    if args.write_options:
        from policies.exports.engine import export_plan

        model = resolve_model(spec)
        written = dict(launch.files)
        for i, plan in zip(launch.instances, plans, strict=True):
            written.update(i.recipe.files)
            if plan.moe_layers:
                written[i.recipe.placement_path] = export_plan(plan, plan.engine.name, model)
        for path, body in written.items():
            say(f"wrote {files.write_document(path, body, 'engine file')}")
    if args.output == "table":
        emit(deployment_text(launch))
    else:
        names = [f"instance/{i.instance.name}" for i in launch.instances]
        emit_document(deployment_launch_to_doc(launch), args.output, names)
    return 0


def register(plan: Groups) -> None:
    """Add ``plan launch`` to the ``plan`` group."""
    p = add_leaf(
        plan,
        "launch",
        cmd_plan_launch,
        "print the per-node command lines that start a plan's engine",
    )
    _add_source_args(p)
    _add_pd_args(p)
    _add_engine_args(p)
    p.add_argument("--model-config", metavar="PATH", help="the plan's model if not a preset")
    add_output_arg(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no hints on stderr")


def _add_source_args(p: argparse.ArgumentParser) -> None:
    """What to launch: ``--plan``, or ``--fleet-plan`` with its deployment, fleet and specs."""
    p.add_argument("--plan", metavar="FILE", help="plan solved for an engine")
    p.add_argument(
        "--fleet-plan",
        metavar="FILE",
        help="a FleetPlan document (schedule show -o json): launch every instance of "
        "--deployment, with --fleet and -f",
    )
    p.add_argument("--deployment", metavar="NAME", help="with --fleet-plan: the deployment")
    p.add_argument("--fleet", metavar="FILE", help="with --fleet-plan: the Fleet it was planned on")
    p.add_argument(
        "-f",
        "--file",
        action="append",
        metavar="FILE",
        help="with --fleet-plan: the ModelDeployment documents it was planned from (repeatable)",
    )


def _add_pd_args(p: argparse.ArgumentParser) -> None:
    """A prefill/decode server's role, KV path, transfer backend and bootstrap port."""
    p.add_argument(
        "--role",
        default="aggregated",
        metavar="ROLE",
        help="with --plan: aggregated, or prefill or decode in a prefill/decode pool "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--kv-path",
        metavar="PATH",
        help="with --role prefill|decode: how KV moves between the pools (rdma or nvlink)",
    )
    p.add_argument(
        "--transfer-backend",
        metavar="NAME",
        help="KV transfer backend: SGLang mooncake|nixl, vLLM NixlConnector|MooncakeConnector, "
        "TensorRT-LLM UCX|NIXL|MOONCAKE (default: the engine's first that runs over the path)",
    )
    p.add_argument(
        "--bootstrap-port",
        type=positive_int,
        metavar="PORT",
        help="SGLang prefill servers' bootstrap port (default: SGLang's, 8998)",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine, the paths its commands read, and whether to write its files."""
    p.add_argument(
        "--engine",
        choices=[e for e in ENGINES if e != "native"],
        help="the engine to start; refused unless the plan was solved for it (default: the plan's)",
    )
    p.add_argument(
        "--model-path",
        metavar="PATH",
        help="weights directory or Hugging Face id (default: $MIXFLEET_MODEL_PATH at launch)",
    )
    p.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        help="node 0's address for several nodes (default: $MIXFLEET_DIST_INIT_ADDR at launch)",
    )
    p.add_argument(
        "--placement-file",
        metavar="PATH",
        help="the exported placement file as the engine sees it (default: "
        + ", ".join(f"{e} {f}" for e, f in PLACEMENT_FILES.items())
        + ")",
    )
    p.add_argument(
        "--options-file",
        default=TRTLLM_OPTIONS_FILE,
        metavar="PATH",
        help="TensorRT-LLM options YAML the command reads (default: %(default)s)",
    )
    p.add_argument(
        "--write-options",
        action="store_true",
        help="also write that YAML (with --fleet-plan: every file the instances read, their "
        "placement exports included)",
    )
