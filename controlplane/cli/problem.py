"""The inputs of a placement question, read from the command line, and solving them.

Shared by the ``plan`` and ``advise`` groups (and the demo and benchmarks):

* :class:`Problem` - fleet, model, workload and solver options of ``plan solve|compare|cost``,
  from :func:`add_problem_args` / :func:`problem_from_args`;
* :func:`deployment_from_args` - the same inputs as a :class:`policies.deployment.Deployment`
  for ``advise *`` and ``plan min-cost`` (:func:`add_deployment_args`), and
  :func:`read_prices` for the cost commands;
* the options themselves are declared in :mod:`controlplane.cli.problem_args` and
  re-exported here;
* :func:`solve_with_progress` and :func:`compare_policies` - one policy or several on the
  same problem, with progress lines on stderr;
* :func:`plan_problems` - why a plan cannot be deployed.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.cli import files
from controlplane.cli.output import Note, gpu_groups, notes, show_progress, ticker
from controlplane.cli.problem_args import add_deployment_args as add_deployment_args
from controlplane.cli.problem_args import add_engine_args as add_engine_args
from controlplane.cli.problem_args import add_problem_args as add_problem_args
from controlplane.cli.problem_args import engine_from_args as engine_from_args
from policies import defaults
from policies.defaults import POLICIES, auto_redundant_experts
from policies.errors import InfeasibleError, InputError
from policies.estimate.engines import EngineSpec

if TYPE_CHECKING:  # the solver and the cost model are imported when a command runs
    from policies.advice.cost import PriceTable
    from policies.deployment import Deployment
    from policies.estimate.workload import Workload
    from policies.hardware.fleet import Fleet
    from policies.model.architecture import ModelSpec
    from policies.plan import Plan
    from policies.request import PlacementRequest, PlacementResult, SolverOptions

#: Tokens per step per GPU when ``--tokens`` is not given, by phase (policies.defaults).
DEFAULT_TOKENS_PER_GPU = defaults.DEFAULT_TOKENS_PER_GPU


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
        engine: the engine that will run the plan (``--engine`` and its options).
        progress: show the elapsed time of each solve on stderr (``--progress`` or a
            terminal).
    """

    fleet: Fleet
    model: ModelSpec
    workload: Workload
    form: str
    redundant_experts: int
    options: SolverOptions
    previous: Plan | None = None
    allow_cross_vendor: bool = False
    engine: EngineSpec = field(default_factory=EngineSpec)
    progress: bool = False

    def request(self, policy: str) -> PlacementRequest:
        """The placement request for one policy."""
        from policies.request import PlacementRequest

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
            engine=self.engine,
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
        from policies.estimate.workload import synthetic_zipf

        return synthetic_zipf(model, spec), spec
    return files.read_expert_load(spec, model), f"file:{spec}"


def read_model(args: argparse.Namespace) -> ModelSpec:
    """``--model NAME`` (a preset) or ``--model-config PATH`` (a config.json).

    Raises:
        InputError: unknown preset or bad config file.
    """
    if getattr(args, "model_config", None):
        return files.read_model_config(args.model_config)
    from policies.model.architecture import preset

    return preset(args.model)


def read_fleet_args(args: argparse.Namespace) -> Fleet:
    """``--fleet FILE`` less the nodes of ``--exclude-nodes a,b``.

    Raises:
        InputError: a bad fleet file, an excluded node the fleet does not have, or no node
            left.
    """
    fleet = files.read_fleet(args.fleet)
    text = getattr(args, "exclude_nodes", None)
    if not text:
        return fleet
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = [n.name for n in fleet.nodes]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InputError(
            f"fleet {fleet.name} has no node {', '.join(unknown)}. To fix: exclude some of "
            f"{', '.join(known)}",
            field="--exclude-nodes",
        )
    left = fleet.without_nodes(names)
    if not left.nodes:
        raise InputError(
            "every node of the fleet is excluded. To fix: keep at least one node",
            field="--exclude-nodes",
        )
    return left


def redundant_for(args: argparse.Namespace, model: ModelSpec, fleet: Fleet) -> int:
    """``--redundant-experts``: the number given, or for ``auto`` (the default) the count
    :func:`policies.defaults.auto_redundant_experts` chooses for the fleet, said on stderr."""
    given: int | None = args.redundant_experts
    if given is not None:
        return given
    experts = model.num_experts if model.is_moe else 0
    chosen = auto_redundant_experts(experts, len(fleet.gpus), args.form)
    if experts:
        notes(args)(
            f"redundant experts: auto -> {chosen} ({experts} + {chosen} slots per MoE layer "
            f"on {len(fleet.gpus)} GPUs, {args.form} form; set --redundant-experts to choose)"
        )
    return chosen


def problem_from_args(args: argparse.Namespace) -> Problem:
    """Read every input file named on the command line and build the shared problem.

    Raises:
        InputError: any bad file or value.
    """
    from policies.estimate.workload import make_workload
    from policies.request import SolverOptions

    fleet = read_fleet_args(args)
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
    engine = engine_from_args(args)
    previous = files.read_plan(args.previous) if args.previous else None
    if previous is not None:
        this = {
            "fleet": fleet.name,
            "model": model.name,
            "phase": workload.phase,
            "tokens_per_gpu": workload.tokens_per_gpu,
            "context_len": workload.context_len,
            "kv_cache_dtype": workload.kv_cache_dtype,
            "engine": engine.name,
        }
        check_same_question(
            plan_context(previous),
            this,
            "the --previous plan and this solve",
            "--previous",
            notes(args),
        )
    return Problem(
        fleet,
        model,
        workload,
        args.form,
        redundant_for(args, model, fleet),
        options,
        previous,
        allow_cross_vendor=bool(getattr(args, "allow_cross_vendor", False)),
        engine=engine,
        progress=show_progress(args),
    )


#: What a plan answers besides its placement: fleet, model, workload and engine.
CONTEXT_FIELDS = (
    "fleet",
    "model",
    "phase",
    "tokens_per_gpu",
    "context_len",
    "kv_cache_dtype",
    "engine",
)


def plan_context(plan: Plan) -> dict[str, Any]:
    """The question ``plan`` answers (:data:`CONTEXT_FIELDS`), from the plan file."""
    w = plan.workload
    return {
        "fleet": plan.fleet,
        "model": plan.model,
        **{k: w.get(k) for k in ("phase", "tokens_per_gpu", "context_len", "kv_cache_dtype")},
        "engine": plan.engine.name,
    }


def context_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """``fleet mixed-24 -> mixed-64``, one per field of :data:`CONTEXT_FIELDS` that differs
    between two contexts (:func:`plan_context`)."""
    return [f"{k} {a[k]} -> {b[k]}" for k in CONTEXT_FIELDS if a.get(k) != b.get(k)]


def check_same_question(
    a: Mapping[str, Any], b: Mapping[str, Any], what: str, field: str, note: Note
) -> None:
    """Refuse two plans (or a plan and a solve) of different models or fleets: their experts
    or GPUs are not the same ones, so moves between them mean nothing. Note (``warning:``)
    the workload or engine fields that differ. ``what`` names the pair in the messages.

    Raises:
        InputError: the models or the fleets differ (on ``field``).
    """
    hard = [d for d in context_differences(a, b) if d.split(" ", 1)[0] in ("fleet", "model")]
    if hard:
        raise InputError(
            f"{what} answer different questions ({'; '.join(hard)}): their GPUs or experts "
            "are not the same ones, so moves between them mean nothing. To fix: give plans "
            "of one model on one fleet",
            field=field,
        )
    soft = context_differences(a, b)
    if soft:
        note(f"warning: {what} differ in {'; '.join(soft)}")


def read_prices(path: str | None) -> PriceTable:
    """The price table: the defaults, with a price file's entries on top.

    A price file is YAML or JSON: ``{currency: USD, prices: {H100-SXM5-80GB: 2.99, ...}}``
    (USD per GPU-hour by catalog name, alias or custom GPU name).

    Raises:
        InputError: unreadable file or a bad price.
    """
    from policies.advice.cost import PriceTable, price_table_from_dict

    if not path:
        return PriceTable()
    doc = files.read_document(path, "price")
    try:
        return price_table_from_dict(doc, source=str(path))
    except InputError as exc:
        wrapped = InputError(f"price file {str(path)!r}: {exc}")
        wrapped.field = exc.field
        raise wrapped from exc


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """Read the files named on the command line into a :class:`Deployment`.

    Raises:
        InputError: any bad file or value.
    """
    from policies.deployment import Deployment
    from policies.request import SolverOptions

    fleet = read_fleet_args(args)
    model = read_model(args)
    rows, source = read_load(args.load, model)
    return Deployment(
        fleet=fleet,
        model=model,
        phase=args.phase,
        context_len=args.context,
        kv_cache_dtype=args.kv_cache_dtype,
        load=None if rows is None else tuple(tuple(float(x) for x in r) for r in rows),
        load_source=source,
        policy=args.policy,
        form=args.form,
        # auto: the fewest; a Deployment raises it to what each subset's GPU count accepts
        redundant_experts=args.redundant_experts or 0,
        options=SolverOptions(
            time_limit_s=args.time_limit,
            mip_gap=args.mip_gap,
            solver=args.solver,
            workers=args.workers,
        ),
        engine=engine_from_args(args),
    )


# ------------------------------------------------------------------------ solving


def plan_problems(plan: Plan) -> tuple[str, ...]:
    """Why a plan cannot be deployed: the cost model's violations (memory, coverage), else
    the validator's findings (e.g. unequal slots in engine form); empty when it can."""
    if plan.violations:
        return tuple(plan.violations)
    from policies.plan import validate_plan

    return tuple(validate_plan(plan))


def _describe(problem: Problem, policy: str) -> str:
    m = problem.model
    fleet = problem.fleet
    what = f"{m.name} ({m.num_moe_layers} MoE layers x {m.num_experts} experts"
    if m.is_moe:
        what += f", {m.num_experts + problem.redundant_experts} slots"
    what += ")"
    engine = "" if problem.engine.name == "native" else f" for {problem.engine.label}"
    line = (
        f"solving {policy} ({problem.form} form{engine}): {what} on {fleet.name} "
        f"({gpu_groups([g.spec.model for g in fleet.gpus])})"
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
    from policies.solve import solve

    note(_describe(problem, policy))
    with ticker(note, f"{policy} still solving", enabled=problem.progress):
        result = solve(problem.request(policy)).require_placed()
    note(_result_line(result))
    return result


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
