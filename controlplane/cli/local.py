"""Local ``mixfleetctl`` commands: everything that needs only files, no controller.

``fleet show``, ``model list``, ``plan solve|show|compare|export|render`` and
``bench placement``. Handlers take the parsed arguments and return an exit status; they
raise :class:`policies.errors.MixfleetError` subclasses for :func:`controlplane.cli.main`
to report. Results go to stdout, progress and hints to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from controlplane.cli import files
from policies.errors import InfeasibleError, InputError, MixfleetError
from policies.exports import EXPORT_FORMATS, export_plan, export_sidecar
from policies.fleet import Fleet, fleet_to_doc
from policies.models import PRESETS, ModelSpec, preset
from policies.plan import FORMS, Plan, validate_plan
from policies.request import POLICIES, PlacementRequest, PlacementResult, SolverOptions
from policies.solve import solve
from policies.workload import KV_DTYPES, PHASES, Workload, make_workload, synthetic_zipf

OUTPUTS = ("table", "json", "yaml")
DEFAULT_TOKENS_PER_GPU = {"decode": 128, "prefill": 4096}
_DEFAULTS = SolverOptions()
_REQUEST_DEFAULTS = PlacementRequest.__dataclass_fields__


# ------------------------------------------------------------------------- helpers


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table: columns padded to their widest cell, numbers right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def numeric(cell: str) -> bool:
        stripped = cell.replace(",", "").replace("%", "").replace("x", "").strip()
        try:
            float(stripped)
        except ValueError:
            return False
        return True

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if numeric(c) else c.ljust(w) for c, w in zip(cells, widths, strict=True)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _emit(text: str) -> None:
    """Write a result to stdout, ending in one newline."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


Note = Callable[[str], None]


def stderr_note(message: str) -> None:
    """Print one progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


def quiet_note(message: str) -> None:
    """Discard a progress line."""


def _notes(args: argparse.Namespace) -> Note:
    """Where progress and hints go: stderr, or nowhere with ``--quiet``."""
    return quiet_note if getattr(args, "quiet", False) else stderr_note


def _note(args: argparse.Namespace, message: str) -> None:
    _notes(args)(message)


@contextmanager
def _ticker(note: Note, label: str, interval_s: float = 15.0) -> Iterator[None]:
    """Report ``label: N s elapsed`` every ``interval_s`` seconds while the body runs."""
    stop = threading.Event()
    t0 = time.monotonic()

    def run() -> None:
        while not stop.wait(interval_s):
            note(f"  ... {label}: {time.monotonic() - t0:.0f} s elapsed")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _fmt_opt(value: float | None, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


# ------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Problem:
    """The inputs every policy of a solve or a comparison shares.

    Attributes:
        fleet: parsed fleet.
        model: model architecture.
        workload: phase, batch, context and expert load.
        form: ``engine`` or ``native``.
        redundant_experts: extra expert slots per MoE layer.
        options: solver options.
        previous: plan to stay close to, or None.
        allow_cross_vendor: let one expert-parallel group span GPU vendors (NVIDIA and
            AMD); off, a MoE model on a mixed-vendor fleet is refused with how to split it.
    """

    fleet: Fleet
    model: ModelSpec
    workload: Workload
    form: str
    redundant_experts: int
    options: SolverOptions
    previous: Plan | None = None
    allow_cross_vendor: bool = False

    def request(self, policy: str) -> PlacementRequest:
        """The placement request for one policy."""
        return PlacementRequest(
            fleet=self.fleet,
            model=self.model,
            workload=self.workload,
            policy=policy,
            form=self.form,
            redundant_experts=self.redundant_experts,
            options=self.options,
            previous=self.previous,
            allow_cross_vendor=self.allow_cross_vendor,
        )


def read_load(spec: str | None, model: ModelSpec) -> tuple[Sequence[Sequence[float]] | None, str]:
    """Expert load from ``--load``: ``uniform`` (or absent), ``synthetic:zipf:S:seed=N`` or
    a JSON file; returns the rows (None for uniform) and the plan's ``load_source``.

    Raises:
        InputError: malformed synthetic spec, unreadable or malformed file.
    """
    if spec is None or spec == "uniform":
        return None, "uniform"
    if spec.startswith("synthetic:"):
        return synthetic_zipf(model, spec), spec
    return files.read_expert_load(spec, model), f"file:{spec}"


def read_model(args: argparse.Namespace) -> ModelSpec:
    """``--model NAME`` (a preset) or ``--model-config PATH`` (a config.json).

    Raises:
        InputError: unknown preset or bad config file.
    """
    if getattr(args, "model_config", None):
        return files.read_model_config(args.model_config)
    return preset(args.model)


def problem_from_args(args: argparse.Namespace) -> Problem:
    """Read every input file named on the command line and build the shared problem.

    Raises:
        InputError: any bad file or value.
    """
    fleet = files.read_fleet(args.fleet)
    model = read_model(args)
    rows, source = read_load(args.load, model)
    tokens = args.tokens if args.tokens is not None else DEFAULT_TOKENS_PER_GPU[args.phase]
    workload = make_workload(
        model,
        phase=args.phase,
        tokens_per_gpu=tokens,
        context_len=args.context,
        load=rows,
        kv_cache_dtype=args.kv_cache_dtype,
        load_source=source,
    )
    options = SolverOptions(
        time_limit_s=args.time_limit,
        mip_gap=args.mip_gap,
        solver=args.solver,
        workers=args.workers,
    )
    previous = files.read_plan(args.previous) if args.previous else None
    return Problem(
        fleet,
        model,
        workload,
        args.form,
        args.redundant_experts,
        options,
        previous,
        allow_cross_vendor=bool(getattr(args, "allow_cross_vendor", False)),
    )


def _add_problem_args(p: argparse.ArgumentParser) -> None:
    """Arguments shared by ``plan solve`` and ``plan compare``."""
    p.add_argument("--fleet", required=True, metavar="FILE", help="Fleet file (YAML or JSON)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="NAME", help="model preset (mixfleetctl model list)")
    which.add_argument(
        "--model-config", metavar="PATH", help="Hugging Face config.json of the model"
    )
    p.add_argument("--phase", choices=PHASES, default="decode", help="default: decode")
    p.add_argument(
        "--tokens",
        type=int,
        metavar="N",
        help="tokens per step per GPU on average (default: 128 decode, 4096 prefill)",
    )
    p.add_argument("--context", type=int, default=4096, metavar="N", help="context length, tokens")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="bf16", help="default: bf16")
    p.add_argument(
        "--load",
        metavar="FILE|SPEC",
        help="expert load: a JSON file ([layers][experts] or an SGLang logical_count dump), "
        "synthetic:zipf:S:seed=N, or uniform (default)",
    )
    p.add_argument("--form", choices=FORMS, default="engine", help="default: engine")
    p.add_argument(
        "--redundant-experts",
        type=int,
        default=_REQUEST_DEFAULTS["redundant_experts"].default,
        metavar="R",
        help="extra expert slots per MoE layer (engine form: experts + R must divide by the "
        "GPU count; default: %(default)s)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=_DEFAULTS.time_limit_s,
        metavar="S",
        help="ilp wall-clock limit, seconds (default: %(default)s)",
    )
    p.add_argument(
        "--mip-gap",
        type=float,
        default=_DEFAULTS.mip_gap,
        metavar="G",
        help="ilp relative MIP gap per layer (default: %(default)s)",
    )
    p.add_argument("--solver", choices=("highs", "cbc"), default=_DEFAULTS.solver)
    p.add_argument(
        "--workers",
        type=int,
        default=_DEFAULTS.workers,
        metavar="N",
        help="processes solving layers in parallel; 0 = one per CPU",
    )
    p.add_argument(
        "--previous", metavar="PLAN", help="plan to stay close to (re-planning), JSON or YAML"
    )
    p.add_argument(
        "--allow-cross-vendor",
        action="store_true",
        help="let one expert-parallel group span NVIDIA and AMD GPUs (only for runtimes that "
        "bridge vendors; default: a MoE model on a mixed-vendor fleet is refused)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def _add_output_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o", "--output", choices=OUTPUTS, default="table", help="stdout format (default: table)"
    )


# --------------------------------------------------------------------- fleet, model


def _gpu_groups(models: Sequence[str]) -> str:
    """``8x A100-SXM4-80GB + 8x H100-SXM5-80GB`` (consecutive runs)."""
    runs: list[list[Any]] = []
    for m in models:
        if runs and runs[-1][1] == m:
            runs[-1][0] += 1
        else:
            runs.append([1, m])
    return " + ".join(f"{n}x {m}" for n, m in runs)


def cmd_fleet_show(args: argparse.Namespace) -> int:
    """``fleet show FILE``: nodes, GPUs, links and totals."""
    fleet = files.read_fleet(args.file)
    if args.output != "table":
        _emit(files.dump_document(fleet_to_doc(fleet), args.output))
        return 0
    gpus = fleet.gpus
    memory = sum(g.spec.memory_gib for g in gpus)
    tflops = sum(g.spec.bf16_tflops for g in gpus)
    _emit(
        f"fleet {fleet.name}: {len(fleet.nodes)} nodes, {len(gpus)} GPUs, {memory:,.0f} GiB, "
        f"{tflops:,.0f} dense BF16 TFLOPS"
    )
    rows = []
    for n in fleet.nodes:
        nv = f"{n.nvlink.domain} {n.nvlink.per_gpu_bidir_gbytes_per_s:g} GB/s bidirectional" if n.nvlink else "none (PCIe)"
        nics = ", ".join(
            f"{x.count}x {x.per_direction_gbits_per_s:g} Gb/s {x.fabric} ({'IB' if x.link_layer == 'infiniband' else 'RoCE'})"
            for x in n.nics
        )
        labels = ",".join(f"{k}={v}" for k, v in sorted(n.labels.items()))
        rows.append(
            [
                n.name,
                _gpu_groups([g.spec.model for g in n.gpus]),
                nv,
                nics or "-",
                labels or "-",
            ]
        )
    _emit(format_table(["node", "GPUs", "NVLink per GPU", "NICs", "labels"], rows))
    for link in fleet.fabric_links:
        _emit(f"fabric link {link.a} <-> {link.b}: {link.per_direction_gbits_per_s:g} Gb/s, +{link.latency_us:g} us")
    return 0


def _model_row(m: ModelSpec) -> dict[str, Any]:
    return {
        "name": m.name,
        "family": m.family,
        "layers": m.num_layers,
        "moe_layers": m.num_moe_layers,
        "experts": m.num_experts,
        "top_k": m.top_k,
        "hidden": m.hidden,
        "attention": m.attention,
        "weights": m.weight_dtype,
        "experts_dtype": m.expert_dtype,
        "total_params_b": round(m.total_params / 1e9, 1),
        "active_params_b": round(m.active_params / 1e9, 1),
    }


def cmd_model_list(args: argparse.Namespace) -> int:
    """``model list``: the presets."""
    rows = [_model_row(m) for m in PRESETS.values()]
    if args.output != "table":
        _emit(files.dump_document(rows, args.output))
        return 0
    headers = list(rows[0])
    _emit(format_table(headers, [[str(r[h]) for h in headers] for r in rows]))
    _emit("Or --model-config PATH for a Hugging Face config.json.")
    return 0


# -------------------------------------------------------------------------- plans


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
        f"{_fmt_opt(None if s.lower_bound_us is None else s.lower_bound_us / 1e3, '.2f')} ms  "
        f"gap {_fmt_opt(None if s.gap is None else s.gap * 100, '.2f')}%  solve {s.solve_s:.1f} s  "
        f"imbalance {s.imbalance:.3f}  moves {_fmt_opt(s.expert_moves, 'd')}  "
        f"feasible {'yes' if s.feasible else 'NO'}",
        f"solver: {s.solver}",
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


def plan_problems(plan: Plan) -> tuple[str, ...]:
    """Why a plan cannot be deployed: the cost model's violations (memory, coverage), else
    the validator's findings (e.g. unequal slots in engine form); empty when it can."""
    if plan.violations:
        return tuple(plan.violations)
    return tuple(validate_plan(plan))


def _print_plan(plan: Plan, output: str) -> None:
    if output == "table":
        _emit(plan_table(plan))
    else:
        _emit(files.dump_document(plan.to_dict(), output))


def _describe(problem: Problem, policy: str) -> str:
    m = problem.model
    fleet = problem.fleet
    what = f"{m.name} ({m.num_moe_layers} MoE layers x {m.num_experts} experts"
    if m.is_moe:
        what += f", {m.num_experts + problem.redundant_experts} slots"
    what += ")"
    line = (
        f"solving {policy} ({problem.form} form): {what} on {fleet.name} "
        f"({_gpu_groups([g.spec.model for g in fleet.gpus])})"
    )
    if policy == "ilp":
        line += f", time limit {problem.options.time_limit_s:g} s"
    return line


def _result_line(result: PlacementResult) -> str:
    s = result.plan.summary
    gap = f", gap {s.gap * 100:.2f}%" if s.gap is not None else ""
    problems = plan_problems(result.plan)
    state = f"INFEASIBLE ({len(problems)} problems)" if problems else "feasible"
    return (
        f"{s.policy}: step {s.step_time_us / 1e3:.2f} ms, {s.tokens_per_s:,.0f} tokens/s{gap}, "
        f"{state}, solved in {s.solve_s:.1f} s"
    )


def solve_with_progress(problem: Problem, policy: str, note: Note) -> PlacementResult:
    """Solve one policy, reporting what is solved, a heartbeat and the result to ``note``.

    Raises:
        InputError: from :func:`policies.solve.solve`.
        InfeasibleError: the policy found no placement (``require_placed``).
    """
    note(_describe(problem, policy))
    with _ticker(note, f"{policy} still solving"):
        result = solve(problem.request(policy)).require_placed()
    note(_result_line(result))
    return result


def cmd_plan_solve(args: argparse.Namespace) -> int:
    """``plan solve``: one policy; prints the plan, optionally saves it."""
    problem = problem_from_args(args)
    result = solve_with_progress(problem, args.policy, _notes(args))
    plan = result.plan
    if args.out:
        path = files.write_document(args.out, plan.to_dict(), "plan")
        _note(args, f"wrote plan {plan.id} to {path}")
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
        for p in validate_plan(plan):
            _emit(f"INVALID: {p}")
    return 0


@dataclass(frozen=True)
class CompareRow:
    """One policy of a comparison: its result, or why it has none.

    Attributes:
        policy: policy name.
        result: the solve's result, or None when the policy found no plan.
        error: the reason there is no result.
    """

    policy: str
    result: PlacementResult | None
    error: str = ""


def parse_policies(text: str) -> list[str]:
    """``uniform,eplb,greedy,ilp`` -> a list, checked against the known policies.

    Raises:
        InputError: empty list or unknown policy.
    """
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown:
        raise InputError(
            f"unknown policies {unknown or [text]}. To fix: give a comma-separated list of "
            f"{', '.join(POLICIES)}",
            field="policies",
        )
    return list(dict.fromkeys(names))


def compare_policies(problem: Problem, policies: Sequence[str], note: Note) -> list[CompareRow]:
    """Solve every policy on the same problem. A policy that proves infeasible gets a row
    with the reason; when all do, the first error is raised.

    Raises:
        InfeasibleError: no policy found a plan.
    """
    rows: list[CompareRow] = []
    first: InfeasibleError | None = None
    for policy in policies:
        try:
            rows.append(CompareRow(policy, solve_with_progress(problem, policy, note)))
        except InfeasibleError as exc:
            first = first or exc
            note(f"{policy}: infeasible: {exc}")
            rows.append(CompareRow(policy, None, str(exc).splitlines()[0]))
    if first is not None and all(r.result is None for r in rows):
        raise first
    return rows


def _baseline(rows: Sequence[CompareRow]) -> float | None:
    for r in rows:
        if r.policy == "uniform" and r.result is not None:
            return r.result.plan.summary.tokens_per_s
    return None


def compare_table(rows: Sequence[CompareRow]) -> str:
    """Side-by-side table of a comparison."""
    base = _baseline(rows)
    table = []
    for r in rows:
        if r.result is None:
            table.append([r.policy, "-", "-", "-", "-", "-", "no: " + r.error[:60]])
            continue
        s = r.result.plan.summary
        speedup = f"{s.tokens_per_s / base:.3f}x" if base else "-"
        table.append(
            [
                r.policy,
                f"{s.step_time_us / 1e3:.2f}",
                f"{s.tokens_per_s:,.0f}",
                speedup,
                "-" if s.gap is None else f"{s.gap * 100:.2f}%",
                f"{s.solve_s:.1f}",
                "NO" if plan_problems(r.result.plan) else "yes",
            ]
        )
    return format_table(
        ["policy", "step ms", "tokens/s", "vs uniform", "gap", "solve s", "feasible"], table
    )


def compare_document(problem: Problem, rows: Sequence[CompareRow]) -> dict[str, Any]:
    """JSON/YAML form of a comparison."""
    base = _baseline(rows)
    wl = problem.workload
    out_rows: list[dict[str, Any]] = []
    for r in rows:
        if r.result is None:
            out_rows.append({"policy": r.policy, "feasible": False, "error": r.error})
            continue
        d = asdict(r.result.plan.summary)
        d["plan_id"] = r.result.plan.id
        d["problems"] = list(plan_problems(r.result.plan)[:12])
        d["speedup_vs_uniform"] = d["tokens_per_s"] / base if base else None
        out_rows.append(d)
    return {
        "fleet": problem.fleet.name,
        "model": problem.model.name,
        "workload": {
            "phase": wl.phase,
            "tokens_per_gpu": wl.tokens_per_gpu,
            "context_len": wl.context_len,
            "kv_cache_dtype": wl.kv_cache_dtype,
            "load_source": wl.load_source,
        },
        "form": problem.form,
        "redundant_experts": problem.redundant_experts,
        "policies": out_rows,
    }


def cmd_plan_compare(args: argparse.Namespace) -> int:
    """``plan compare``: the policies side by side on the same inputs."""
    policies = parse_policies(args.policies)
    problem = problem_from_args(args)
    rows = compare_policies(problem, policies, _notes(args))
    if args.save_plans:
        for r in rows:
            if r.result is not None:
                path = Path(args.save_plans) / f"{r.policy}.json"
                files.write_document(path, r.result.plan.to_dict(), "plan")
                _note(args, f"wrote {r.policy} plan to {path}")
    if args.output == "table":
        _emit(compare_table(rows))
    else:
        _emit(files.dump_document(compare_document(problem, rows), args.output))
    return 0


_EXPORT_USE = {
    "sglang": "SGLang: --init-expert-location {path} --ep-num-redundant-experts {r}",
    "vllm": "vLLM: no flag loads a placement; load this EPLB state from your launcher",
    "trtllm": "TensorRT-LLM: moe_config: {{load_balancer: {path}}} in the LLM API options",
}


def cmd_plan_export(args: argparse.Namespace) -> int:
    """``plan export FILE --format F``: an engine's placement file (plus a sidecar)."""
    plan = files.read_plan(args.file)
    doc = export_plan(plan, args.format)
    text = files.dump_document(doc, "yaml" if args.format == "trtllm" else "json")
    if args.out:
        path = files.write_text(args.out, text, f"{args.format} export")
        _note(args, f"wrote {args.format} placement of plan {plan.id} to {path}")
        _note(args, _EXPORT_USE[args.format].format(path=path, r=plan.num_redundant))
        if args.format == "sglang" and path.suffix != ".json":
            _note(args, "note: SGLang reads a file only when its name ends in .json")
    else:
        _emit(text)
    if args.sidecar:
        path = files.write_document(args.sidecar, export_sidecar(plan), "sidecar")
        _note(args, f"wrote DP-attention weights and runtime hints to {path}")
    return 0


def cmd_plan_render(args: argparse.Namespace) -> int:
    """``plan render FILE``: GPU x layer heatmaps of load and predicted time (PNG)."""
    from controlplane.cli.render import render_plan  # matplotlib is slow to import

    plan = files.read_plan(args.file)
    model = files.read_model_config(args.model_config) if args.model_config else None
    fleet = files.read_fleet(args.fleet) if args.fleet else None
    load = None
    if args.load:
        m = model
        if m is None:
            m = preset(plan.model)
        load, _ = read_load(args.load, m)
    out = args.out or str(Path(args.file).with_suffix(".png"))
    path = render_plan(plan, out, model=model, load=load, fleet=fleet)
    _emit(str(path))
    return 0


# -------------------------------------------------------------------------- bench


def cmd_bench_placement(args: argparse.Namespace) -> int:
    """``bench placement``: runs :func:`bench.placement.placement_main`."""
    try:
        module = importlib.import_module("bench.placement")
    except ModuleNotFoundError as exc:
        if exc.name != "bench.placement":
            raise
        raise MixfleetError(
            "the placement benchmark is not part of this installation "
            "(controlplane/benchmarks.py is missing)"
        ) from exc
    run: Callable[[argparse.Namespace], int] = module.placement_main
    return int(run(args))


# ----------------------------------------------------------------------- register


def _leaf(
    group: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Callable[[argparse.Namespace], int],
    help_text: str,
) -> argparse.ArgumentParser:
    p = group.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(handler=handler)
    return p


def _group(
    groups: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    p = groups.add_parser(name, help=help_text, description=help_text)
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION", required=True)


def register(groups: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the local command groups ``fleet``, ``model``, ``plan`` and ``bench``."""
    fleet = _group(groups, "fleet", "inspect fleet files")
    p = _leaf(fleet, "show", cmd_fleet_show, "show a fleet file's nodes, GPUs and links")
    p.add_argument("file", metavar="FILE")
    _add_output_arg(p)

    model = _group(groups, "model", "model presets")
    p = _leaf(model, "list", cmd_model_list, "list the model presets")
    _add_output_arg(p)

    plan = _group(groups, "plan", "solve, inspect, compare, export and render placement plans")
    p = _leaf(plan, "solve", cmd_plan_solve, "place attention and experts with one policy")
    _add_problem_args(p)
    p.add_argument("--policy", choices=POLICIES, default="ilp", help="default: ilp")
    _add_output_arg(p)
    p.add_argument("--out", metavar="FILE", help="also save the plan (.json, or .yaml/.yml)")

    p = _leaf(plan, "show", cmd_plan_show, "show a saved plan")
    p.add_argument("file", metavar="FILE")
    _add_output_arg(p)

    p = _leaf(plan, "compare", cmd_plan_compare, "solve several policies side by side")
    _add_problem_args(p)
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        metavar="LIST",
        help="comma-separated policies (default: %(default)s)",
    )
    _add_output_arg(p)
    p.add_argument("--save-plans", metavar="DIR", help="save each plan as DIR/<policy>.json")

    p = _leaf(plan, "export", cmd_plan_export, "write an engine's expert-placement file")
    p.add_argument("file", metavar="FILE", help="engine-form plan (JSON or YAML)")
    p.add_argument("--format", choices=EXPORT_FORMATS, required=True)
    p.add_argument("--out", metavar="FILE", help="output file (default: stdout)")
    p.add_argument(
        "--sidecar",
        metavar="FILE",
        help="also write per-rank DP-attention weights and runtime hints (JSON or YAML)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no hints on stderr")

    p = _leaf(plan, "render", cmd_plan_render, "draw a plan as a PNG (GPU x layer heatmaps)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--out", metavar="PNG", help="default: the plan's path with .png")
    p.add_argument("--fleet", metavar="FILE", help="the plan's fleet, for exact GPU figures")
    p.add_argument("--model-config", metavar="PATH", help="the plan's model if not a preset")
    p.add_argument("--load", metavar="FILE|SPEC", help="the plan's load if it came from a file")

    bench = _group(groups, "bench", "benchmarks")
    p = _leaf(bench, "placement", cmd_bench_placement, "placement benchmark scenarios")
    p.add_argument("--scenario", default="all", metavar="NAME|all", help="default: all")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--out", metavar="PATH", help="results JSON file")
    p.add_argument("--docs", metavar="PATH", help="Markdown table to write")
