"""``mixfleetctl plan launch``: the command line and environment that start a plan's engine.

Per node, in the plan's rank order: the environment (``CUDA_VISIBLE_DEVICES`` in rank order)
and the engine's command (:func:`policies.launch.launch_recipe`), as ``sh`` lines to paste or
as a JSON/YAML document (``-o``). The plan must be feasible and solved for the engine
(``plan solve --engine sglang|vllm|trtllm``); the export file the commands read is named by
``--placement-file`` (write it with ``plan export``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from controlplane.cli import files
from controlplane.cli.output import Groups, add_leaf, add_output_arg, emit, emit_document, notes
from policies.defaults import PLACEMENT_FILES, TRTLLM_OPTIONS_FILE
from policies.engines import ENGINES

if TYPE_CHECKING:
    from policies.launch import LaunchRecipe
    from policies.models import ModelSpec


def launch_text(recipe: LaunchRecipe) -> str:
    """The recipe as commented ``sh`` lines: one block per node, then the files it reads."""
    from policies.launch import node_command

    k = len(recipe.nodes)
    ranks = recipe.nodes[-1].rank_range[1] if recipe.nodes else 0
    lines = [f"# plan {recipe.plan_id} on {recipe.engine}: {ranks} ranks on {k} nodes"]
    lines += [f"# note: {n}" for n in recipe.notes]
    for n in recipe.nodes:
        first, end = n.rank_range
        lines += ["", f"# node {n.node} (node rank {n.node_rank}): ranks {first}-{end - 1}"]
        lines.append(node_command(n))
    for path, doc in recipe.files.items():
        lines += ["", f"# file {path} (--write-options writes it):"]
        lines += [f"#   {line}" for line in files.dump_document(doc, "yaml").splitlines()]
    return "\n".join(lines)


def _preset(name: str) -> ModelSpec:
    from policies.models import preset

    return preset(name)


def cmd_plan_launch(args: argparse.Namespace) -> int:
    """``plan launch --plan PLAN``: each node's environment and engine command."""
    from policies.launch import DIST_INIT_REF, MODEL_PATH_REF, launch_recipe, recipe_to_doc

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


def register(plan: Groups) -> None:
    """Add ``plan launch`` to the ``plan`` group."""
    p = add_leaf(
        plan,
        "launch",
        cmd_plan_launch,
        "print the per-node command lines that start a plan's engine",
    )
    p.add_argument("--plan", required=True, metavar="FILE", help="plan solved for an engine")
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
    p.add_argument("--write-options", action="store_true", help="also write that YAML")
    p.add_argument("--model-config", metavar="PATH", help="the plan's model if not a preset")
    add_output_arg(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no hints on stderr")
