"""``mixfleetctl plan``: solve, inspect, compare, export and render placement plans.

* ``plan solve``    - one policy; prints the plan, or ``--out`` saves it and prints a summary;
* ``plan show``     - a saved plan, with the validator's findings;
* ``plan compare``  - several policies side by side on the same inputs, or saved plans,
  with USD per million tokens;
* ``plan diff``     - what changed between two saved plans;
* ``plan export``   - an engine's expert-placement file (SGLang, vLLM, TensorRT-LLM);
* ``plan launch``   - the per-node command lines that start the plan's engine;
* ``plan render``   - GPU x layer heatmaps of a plan (PNG);
* ``plan cost``     - ``plan compare`` with USD per hour and per million tokens;
* ``plan min-cost`` - the cheapest subset of whole nodes that reaches a throughput target.

Everything here needs only files, no controller. Exit 3 (infeasible) when a plan violates
constraints or no subset reaches the throughput.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from apis.cliargs import non_negative_int, positive_float, positive_int
from controlplane.cli import files, launch, plancompare
from controlplane.cli.output import (
    Groups,
    add_group,
    add_leaf,
    add_output_arg,
    emit,
    emit_document,
    fmt_opt,
    format_table,
    notes,
    show_progress,
    ticker,
)
from controlplane.cli.plancompare import compare_document, summary_line
from controlplane.cli.plancompare import compare_table as compare_table  # the demo's import
from controlplane.cli.problem import (
    DEFAULT_TOKENS_PER_GPU,
    add_deployment_args,
    add_problem_args,
    compare_policies,
    deployment_from_args,
    parse_policies,
    plan_problems,
    problem_from_args,
    read_load,
    read_prices,
    solve_with_progress,
)
from policies import defaults
from policies.errors import InfeasibleError, InputError

if TYPE_CHECKING:
    from policies.model.architecture import ModelSpec
    from policies.plan import Plan, PlanEngine, PlanSummary

# ------------------------------------------------------------------------- output


def _bound_lines(s: PlanSummary) -> list[str]:
    """What the bound covers, and the bound given the plan's attention shares."""
    out = []
    if s.bound_scope:
        out.append(f"bound: {s.bound_scope}")
    if s.conditional_bound_us is not None:
        out.append(
            f"bound with these attention shares: {s.conditional_bound_us / 1e3:.2f} ms "
            f"(gap {(s.step_time_us - s.conditional_bound_us) / s.step_time_us * 100:.2f}%)"
        )
    return out


def engine_line(e: PlanEngine) -> str:
    """``engine: sglang 0.5.23, a2a backend deepep (why), dispatch static, dp balance router``;
    a native plan says it is idealised."""
    if e.name == "native":
        return "engine: native (idealised: no engine executes these shares)"
    return (
        f"engine: {e.name} {e.version}, a2a backend {e.why or e.a2a_backend}, dispatch "
        f"{e.dispatch}, dp balance {e.dp_balance}"
    )


def plan_table(plan: Plan) -> str:
    """Human-readable plan: headline, summary and one row per GPU."""
    s = plan.summary
    wl = plan.workload
    lines = [
        f"plan {plan.id} v{plan.version}: {s.policy} ({s.form} form), model {plan.model}, "
        f"fleet {plan.fleet} ({len(plan.gpus)} GPUs)",
        f"workload: {wl.get('phase')}, {wl.get('tokens_per_gpu')} tokens/GPU, context "
        f"{wl.get('context_len')}, KV {wl.get('kv_cache_dtype')}, load {wl.get('load_source')}",
        f"experts: {plan.num_experts} x {len(plan.moe_layers)} MoE layers, "
        f"{plan.num_redundant} redundant slots"
        + (f", {plan.slots_per_gpu} slots per GPU" if plan.slots_per_gpu is not None else ""),
        f"step {s.step_time_us / 1e3:.2f} ms  {s.tokens_per_s:,.0f} tokens/s  bound "
        f"{fmt_opt(None if s.lower_bound_us is None else s.lower_bound_us / 1e3, '.2f')} ms  "
        f"gap {fmt_opt(None if s.gap is None else s.gap * 100, '.2f')}%  solve {s.solve_s:.1f} s  "
        f"imbalance {s.imbalance:.3f}  moves {fmt_opt(s.expert_moves, 'd')}  "
        f"feasible {'yes' if s.feasible else 'NO'}",
        f"solver: {s.solver}",
        *_bound_lines(s),
        engine_line(plan.engine),
        "",
    ]
    rows = []
    for g in plan.gpus:
        counts = [len(layer) for layer in g.experts]
        slots = (
            "-"
            if not counts
            else (str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}")
        )
        mem = g.memory_bytes
        h = g.hints
        rows.append(
            [
                g.gpu,
                g.model,
                f"{g.attention_share:.4f}",
                f"{g.dp_weight:.3f}",
                "-" if g.attention_heads is None else str(g.attention_heads),
                slots,
                f"{g.predicted_busy_us / 1e3:.2f}",
                f"{mem.get('total', 0.0) / 2**30:.1f}/{mem.get('usable', 0.0) / 2**30:.1f}",
                f"{h.ep_backend}/{h.deepep_mode}",
                f"{h.attention_backend} x{h.decode_num_splits}",
            ]
        )
    lines.append(
        format_table(
            [
                "GPU",
                "model",
                "attn share",
                "dp weight",
                "heads",
                "slots/layer",
                "busy ms",
                "mem GiB",
                "dispatch",
                "attention",
            ],
            rows,
        )
    )
    for v in plan.violations:
        lines.append(f"VIOLATION: {v}")
    for n in plan.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _print_plan(plan: Plan, output: str) -> None:
    if output == "table":
        emit(plan_table(plan))
    else:
        emit_document(plan.to_dict(), output, [f"plan/{plan.id}"])


# ----------------------------------------------------------------------- handlers


def cmd_plan_solve(args: argparse.Namespace) -> int:
    """``plan solve``: one policy; prints the plan, or with ``--out`` saves it and prints
    a short summary."""
    problem = problem_from_args(args)
    result = solve_with_progress(problem, args.policy, notes(args))
    plan = result.plan
    if args.out:
        path = files.write_document(args.out, plan.to_dict(), "plan")
        notes(args)(f"wrote plan {plan.id} to {path}")
        if args.output == "table":
            emit(f"{summary_line(plan)}\nsaved to {path} (mixfleetctl plan show {path})")
        else:
            doc = {"id": plan.id, "file": str(path), "summary": asdict(plan.summary)}
            emit_document(doc, args.output, [f"plan/{plan.id}"])
    else:
        _print_plan(plan, args.output)
    problems = plan_problems(plan)
    if problems:
        raise InfeasibleError(f"the {plan.summary.policy} plan violates constraints", problems[:12])
    return 0


def cmd_plan_show(args: argparse.Namespace) -> int:
    """``plan show FILE``: a saved plan, with the validator's findings."""
    plan = files.read_plan(args.file)
    _print_plan(plan, args.output)
    if args.output == "table" and not plan.violations:
        from policies.plan import validate_plan

        for p in validate_plan(plan):
            emit(f"INVALID: {p}")
    return 0


def cmd_plan_compare(args: argparse.Namespace) -> int:
    """``plan compare``: the policies side by side on the same inputs, or saved plans."""
    if args.plans:
        return plancompare.compare_saved(args)
    if not args.fleet or not (args.model or args.model_config):
        raise InputError(
            "give --fleet and --model (or --model-config) to solve the policies, or saved "
            "plan files to compare. To fix: e.g. mixfleetctl plan compare a.json b.json",
            field="--fleet",
        )
    policies = parse_policies(args.policies)
    problem = problem_from_args(args)
    prices = read_prices(args.prices)
    rows = compare_policies(problem, policies, notes(args))
    if args.save_plans:
        for r in rows:
            if r.result is not None:
                path = Path(args.save_plans) / f"{r.policy}.json"
                files.write_document(path, r.result.plan.to_dict(), "plan")
                notes(args)(f"wrote {r.policy} plan to {path}")
    if args.output == "table":
        emit(compare_table(rows, prices))
    else:
        names = [f"plan/{r.result.plan.id}" for r in rows if r.result is not None]
        emit_document(compare_document(problem, rows, prices), args.output, names)
    return 0


_EXPORT_USE = {
    "sglang": "SGLang: --init-expert-location {path} --ep-num-redundant-experts {r}",
    "vllm": "vLLM: no flag loads a placement; a launcher moves the weights and installs this "
    "EPLB state (see the manifest's load.launcher_steps)",
    "trtllm": "TensorRT-LLM: moe_config: {{load_balancer: {path}}} in the LLM API options",
}


def _export_model(args: argparse.Namespace, plan: Plan) -> ModelSpec:
    """The plan's model: ``--model-config``, else the preset the plan names.

    Raises:
        InputError: the plan's model is not a preset and no config was given.
    """
    if args.model_config:
        return files.read_model_config(args.model_config)
    try:
        from policies.model.architecture import preset

        return preset(plan.model)
    except InputError as exc:
        raise InputError(
            f"plan {plan.id} is for model {plan.model!r}, which is not a preset; the export "
            "needs the model to check the engine can place it (and its MTP layers). To fix: "
            "pass --model-config PATH (the model's config.json)",
            field="model-config",
        ) from exc


def _manifest_path(args: argparse.Namespace) -> Path | None:
    """``--manifest``, else ``<out stem>.manifest.json`` beside ``--out``, else None."""
    if args.manifest:
        return Path(args.manifest)
    if args.out:
        out = Path(args.out)
        return out.with_name(f"{out.stem}.manifest.json")
    return None


def cmd_plan_export(args: argparse.Namespace) -> int:
    """``plan export FILE --format F``: an engine's placement file, the manifest beside it
    (engine, version, world size, R, rank -> GPU order) and optionally a sidecar."""
    from policies.exports.engine import export_plan, export_sidecar
    from policies.exports.manifest import export_manifest

    plan = files.read_plan(args.file)
    model = _export_model(args, plan)
    doc = export_plan(plan, args.format, model)
    text = files.dump_document(doc, "yaml" if args.format == "trtllm" else "json")
    file = ""
    if args.out:
        path = files.write_text(args.out, text, f"{args.format} export")
        file = str(path)
        notes(args)(f"wrote {args.format} placement of plan {plan.id} to {path}")
        notes(args)(_EXPORT_USE[args.format].format(path=path, r=plan.num_redundant))
        if args.format == "sglang" and path.suffix != ".json":
            notes(args)("note: SGLang reads a file only when its name ends in .json")
        if args.output != "table":
            emit_document({"file": file, "format": args.format}, args.output, [f"file/{file}"])
    elif args.output == "table":  # the engine's own format
        emit(text)
    else:
        emit_document(doc, args.output, [f"export/{args.format}/{plan.id}"])
    manifest = _manifest_path(args)
    if manifest is not None:
        import hashlib

        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        man = export_manifest(plan, args.format, model, file=file, file_sha256=digest)
        written = files.write_document(manifest, man, "manifest")
        notes(args)(f"wrote the manifest (engine, R, rank -> GPU order) to {written}")
    else:
        notes(args)(
            "no manifest written: pass --manifest FILE (or --out); it records the rank -> GPU "
            "order the file assumes"
        )
    if args.sidecar:
        path = files.write_document(args.sidecar, export_sidecar(plan), "sidecar")
        notes(args)(f"wrote DP-attention weights and runtime hints to {path}")
    return 0


def cmd_plan_render(args: argparse.Namespace) -> int:
    """``plan render FILE``: phases, expert placement, memory and traffic (PNG or SVG)."""
    from controlplane.cli.render import render_plan  # matplotlib is slow to import

    plan = files.read_plan(args.file)
    model = files.read_model_config(args.model_config) if args.model_config else None
    fleet = files.read_fleet(args.fleet) if args.fleet else None
    load = None
    if args.load:
        m = model
        if m is None:
            from policies.model.architecture import preset

            m = preset(plan.model)
        load, _ = read_load(args.load, m)
    out = args.out or str(Path(args.file).with_suffix(".png"))
    path = render_plan(plan, out, model=model, load=load, fleet=fleet, layer=args.layer)
    if args.output == "table":
        emit(str(path))
    else:
        emit_document({"file": str(path), "plan": plan.id}, args.output, [f"file/{path}"])
    return 0


def cmd_plan_cost(args: argparse.Namespace) -> int:
    """``plan cost``: policies side by side with cost per hour and per million tokens."""
    from controlplane.cli.reports import cost_document, cost_table

    prices = read_prices(args.prices)
    problem = problem_from_args(args)
    rows = compare_policies(problem, parse_policies(args.policies), notes(args))
    if args.output == "table":
        emit(cost_table(rows, prices))
    else:
        names = [f"plan/{r.result.plan.id}" for r in rows if r.result is not None]
        emit_document(cost_document(rows, prices), args.output, names)
    return 0


def cmd_plan_min_cost(args: argparse.Namespace) -> int:
    """``plan min-cost``: the cheapest subset of whole nodes reaching a throughput."""
    from controlplane.cli.reports import min_cost_document, min_cost_table
    from policies.advice.cost import min_cost

    dep = deployment_from_args(args)
    prices = read_prices(args.prices)
    tokens = args.tokens or DEFAULT_TOKENS_PER_GPU[dep.phase]
    notes(args)(
        f"cheapest subset of {dep.fleet.name} for {args.target_tokens_per_s:,.0f} tokens/s: "
        f"screen greedy, finalists {dep.policy}"
    )
    with ticker(notes(args), "min-cost still searching", enabled=show_progress(args)):
        res = min_cost(
            dep,
            args.target_tokens_per_s,
            prices,
            tokens_per_gpu=tokens,
            final_policy=dep.policy,
            layout=args.layout,
            finalists=args.finalists,
            allow_cross_vendor=args.allow_cross_vendor,
        )
    if args.save_plans:
        for r in res.results:
            path = Path(args.save_plans) / f"{r.plan.fleet}-{r.plan.id}.json"
            files.write_document(path, r.plan.to_dict(), "plan")
            notes(args)(f"wrote plan {r.plan.id} to {path}")
    if args.output == "table":
        emit(min_cost_table(res))
    else:
        emit_document(
            min_cost_document(res), args.output, [f"plan/{r.plan.id}" for r in res.results]
        )
    return 0


# ----------------------------------------------------------------------- register


def register(groups: Groups) -> None:
    """Add the ``plan`` group and its commands."""
    plan = add_group(groups, "plan", "solve, inspect, compare, export and render placement plans")
    p = add_leaf(plan, "solve", cmd_plan_solve, "place attention and experts with one policy")
    add_problem_args(p)
    p.add_argument(
        "--policy",
        choices=defaults.POLICIES,
        default=defaults.DEFAULT_POLICY,
        help="default: %(default)s",
    )
    add_output_arg(p)
    p.add_argument(
        "--out",
        metavar="FILE",
        help="save the plan (.json, or .yaml/.yml) and print a one-line summary instead",
    )

    p = add_leaf(plan, "show", cmd_plan_show, "show a saved plan")
    p.add_argument("file", metavar="FILE")
    add_output_arg(p)

    p = add_leaf(
        plan,
        "compare",
        cmd_plan_compare,
        "solve several policies side by side, or compare saved plans",
        description="Solve several policies on the same inputs (--fleet, --model), or give "
        "saved plan files to compare them; both with USD per million tokens.",
    )
    p.add_argument("plans", nargs="*", metavar="PLAN", help="saved plans to compare instead")
    add_problem_args(p, required=False)
    p.add_argument(
        "--policies",
        default=",".join(defaults.POLICIES),
        metavar="LIST",
        help="comma-separated policies (default: %(default)s)",
    )
    p.add_argument("--prices", metavar="FILE", help="price file (default: built-in assumptions)")
    add_output_arg(p)
    p.add_argument("--save-plans", metavar="DIR", help="save each plan as DIR/<policy>.json")

    _register_export_render(plan)
    launch.register(plan)
    plancompare.register(plan)
    _register_cost(plan)


def _register_export_render(plan: Groups) -> None:
    """``plan export`` and ``plan render``."""
    p = add_leaf(plan, "export", cmd_plan_export, "write an engine's expert-placement file")
    p.add_argument("file", metavar="FILE", help="engine-form plan (JSON or YAML)")
    p.add_argument("--format", choices=defaults.EXPORT_FORMATS, required=True)
    p.add_argument("--out", metavar="FILE", help="output file (default: stdout)")
    p.add_argument(
        "--manifest",
        metavar="FILE",
        help="where to write the manifest (engine, version, world size, R, rank -> GPU order); "
        "default: <out stem>.manifest.json beside --out",
    )
    p.add_argument(
        "--model-config",
        metavar="PATH",
        help="the plan's model config.json when the plan's model is not a preset",
    )
    p.add_argument(
        "--sidecar",
        metavar="FILE",
        help="also write per-rank DP-attention weights and runtime hints (JSON or YAML)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no hints on stderr")
    add_output_arg(p)

    p = add_leaf(plan, "render", cmd_plan_render, "draw a plan to debug it (PNG or SVG)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--out", metavar="PNG|SVG", help="default: the plan's path with .png")
    p.add_argument("--fleet", metavar="FILE", help="the plan's fleet: links and exact GPU figures")
    p.add_argument(
        "--layer",
        type=non_negative_int,
        metavar="N",
        help="model layer of the expert panel (default: the MoE layer that takes longest)",
    )
    p.add_argument("--model-config", metavar="PATH", help="the plan's model if not a preset")
    p.add_argument("--load", metavar="FILE|SPEC", help="the plan's load if it came from a file")
    add_output_arg(p)


def _register_cost(plan: Groups) -> None:
    """``plan cost`` and ``plan min-cost``."""
    p = add_leaf(plan, "cost", cmd_plan_cost, "compare policies with cost per million tokens")
    add_deployment_args(p, policy=defaults.DEFAULT_POLICY)
    p.add_argument("--tokens", type=positive_int, metavar="N", help="tokens per step per GPU")
    p.add_argument("--previous", metavar="PLAN", help="plan to stay close to (re-planning)")
    p.add_argument(
        "--policies",
        default=",".join(defaults.POLICIES),
        metavar="LIST",
        help="comma-separated policies (default: %(default)s)",
    )
    p.add_argument("--prices", metavar="FILE", help="price file (default: built-in assumptions)")

    p = add_leaf(plan, "min-cost", cmd_plan_min_cost, "cheapest node subset for a throughput")
    add_deployment_args(p, policy=defaults.DEFAULT_POLICY)
    p.add_argument("--target-tokens-per-s", type=positive_float, required=True, metavar="X")
    p.add_argument("--tokens", type=positive_int, metavar="N", help="tokens per step per GPU")
    p.add_argument(
        "--layout",
        choices=defaults.LAYOUTS,
        default=defaults.DEFAULT_LAYOUT,
        help="one EP group, replicas, or the better (default: %(default)s)",
    )
    p.add_argument("--finalists", type=positive_int, default=3, metavar="K")
    p.add_argument("--prices", metavar="FILE", help="price file (default: built-in assumptions)")
    p.add_argument("--allow-cross-vendor", action="store_true")
    p.add_argument("--save-plans", metavar="DIR", help="save the chosen plans in DIR")
