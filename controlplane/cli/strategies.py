"""``mixfleetctl`` commands for deployment strategies (issue 6).

* ``advise batch``   - largest batch per GPU that fits memory and meets a TPOT/TTFT target,
  with the throughput curve (table, JSON/YAML, ``--png``);
* ``advise context`` - per policy, attention shares and KV per GPU model at long contexts
  and the longest context each holds at a batch;
* ``advise tiers``   - interactive/batch split of the fleet's nodes for an SLO and a rate;
* ``plan cost``      - ``plan compare`` with USD per hour and per million tokens;
* ``plan min-cost``  - the cheapest subset of whole nodes that reaches a throughput target.

Handlers read files (fleet, model config, load, prices), call the pure planners in
:mod:`policies.advise`, :mod:`policies.tiers` and :mod:`policies.cost`, and print. Exit 3
(infeasible) when the question has no answer: no batch meets the target, the SLO cannot be
met (the error lists what to add), no subset reaches the throughput.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from controlplane.cli import files
from controlplane.cli.local import (
    DEFAULT_TOKENS_PER_GPU,
    OUTPUTS,
    compare_policies,
    parse_policies,
    problem_from_args,
    quiet_note,
    read_load,
    read_model,
    stderr_note,
)
from controlplane.cli.reports import (
    batch_document,
    batch_table,
    context_document,
    context_table,
    cost_document,
    cost_table,
    min_cost_document,
    min_cost_table,
    tiers_document,
    tiers_table,
)
from policies.advise import DEFAULT_CONTEXTS, advise_batch, advise_context
from policies.cost import LAYOUTS, PriceTable, min_cost, price_table_from_dict
from policies.deployment import Deployment
from policies.errors import InfeasibleError, InputError
from policies.plan import FORMS
from policies.request import POLICIES, SolverOptions
from policies.tiers import PREFERENCES, BatchTier, InteractiveTier, TierRequest, plan_tiers
from policies.workload import KV_DTYPES, PHASES

Handler = Callable[[argparse.Namespace], int]
_DEFAULTS = SolverOptions()


# ------------------------------------------------------------------------------ inputs


def read_prices(path: str | None) -> PriceTable:
    """The price table: the defaults, with a price file's entries on top.

    A price file is YAML or JSON: ``{currency: USD, prices: {H100-SXM5-80GB: 2.99, ...}}``
    (USD per GPU-hour by catalog name, alias or custom GPU name).

    Raises:
        InputError: unreadable file or a bad price.
    """
    if not path:
        return PriceTable()
    doc = files.read_document(path, "price")
    try:
        return price_table_from_dict(doc, source=str(path))
    except InputError as exc:
        wrapped = InputError(f"price file {str(path)!r}: {exc}")
        wrapped.field = exc.field
        raise wrapped from exc


def _add_inputs(p: argparse.ArgumentParser, *, policy: str, redundant: int) -> None:
    """Fleet, model, workload shape and solver options (the dests ``plan compare`` uses)."""
    p.add_argument("--fleet", required=True, metavar="FILE", help="Fleet file (YAML or JSON)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="NAME", help="model preset (mixfleetctl model list)")
    which.add_argument("--model-config", metavar="PATH", help="Hugging Face config.json")
    p.add_argument("--phase", choices=PHASES, default="decode", help="default: decode")
    p.add_argument("--context", type=int, default=4096, metavar="N", help="context, tokens")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="bf16", help="default: bf16")
    p.add_argument(
        "--load", metavar="FILE|SPEC", help="expert load: a JSON file, synthetic:zipf:S:seed=N"
    )
    p.add_argument("--policy", choices=POLICIES, default=policy, help="default: %(default)s")
    p.add_argument("--form", choices=FORMS, default="engine", help="default: engine")
    p.add_argument(
        "--redundant-experts",
        type=int,
        default=redundant,
        metavar="R",
        help="extra expert slots per MoE layer; in engine form raised to the next count the "
        "GPU count divides (default: %(default)s)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=_DEFAULTS.time_limit_s,
        metavar="S",
        help="ilp wall-clock limit per solve, seconds (default: %(default)s)",
    )
    p.add_argument("--mip-gap", type=float, default=_DEFAULTS.mip_gap, metavar="G")
    p.add_argument("--solver", choices=("highs", "cbc"), default=_DEFAULTS.solver)
    p.add_argument(
        "--workers", type=int, default=_DEFAULTS.workers, metavar="N", help="0 = one per CPU"
    )
    p.add_argument("-o", "--output", choices=OUTPUTS, default="table", help="default: table")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """Read the files named on the command line into a :class:`Deployment`.

    Raises:
        InputError: any bad file or value.
    """
    fleet = files.read_fleet(args.fleet)
    model = read_model(args)
    rows, source = read_load(args.load, model)
    if args.time_limit <= 0:
        raise InputError(f"must be > 0 seconds, got {args.time_limit}", field="--time-limit")
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
        redundant_experts=args.redundant_experts,
        options=SolverOptions(
            time_limit_s=args.time_limit,
            mip_gap=args.mip_gap,
            solver=args.solver,
            workers=args.workers,
        ),
    )


def _note(args: argparse.Namespace) -> Callable[[str], None]:
    return quiet_note if getattr(args, "quiet", False) else stderr_note


def _print(text: str) -> None:
    """Write a result to stdout, ending in one newline."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _target(args: argparse.Namespace, phase: str) -> float | None:
    """The step-time target of ``--tpot-ms`` (decode) or ``--ttft-ms`` (prefill).

    Raises:
        InputError: a target that does not belong to the phase.
    """
    if args.tpot_ms is not None and phase != "decode":
        raise InputError(
            "TPOT is a decode target. To fix: use --phase decode, or --ttft-ms for prefill",
            field="--tpot-ms",
        )
    if args.ttft_ms is not None and phase != "prefill":
        raise InputError(
            "TTFT is a prefill target. To fix: use --phase prefill, or --tpot-ms for decode",
            field="--ttft-ms",
        )
    target: float | None = args.tpot_ms if args.tpot_ms is not None else args.ttft_ms
    return target


def _ints(text: str, field: str) -> tuple[int, ...]:
    """``32k,64k,131072`` -> token counts.

    Raises:
        InputError: an entry that is not a positive integer (``k`` = 1024).
    """
    out = []
    for part in (x.strip().lower() for x in text.split(",") if x.strip()):
        scale = 1024 if part.endswith("k") else 1
        try:
            value = int(part[:-1] if scale > 1 else part) * scale
        except ValueError:
            value = 0
        if value <= 0:
            raise InputError(
                f"{part!r} is not a positive token count. To fix: write e.g. 32k,64k,131072",
                field=field,
            )
        out.append(value)
    if not out:
        raise InputError("give at least one context", field=field)
    return tuple(out)


# ---------------------------------------------------------------------------- handlers


def cmd_advise_batch(args: argparse.Namespace) -> int:
    """``advise batch``: the batch-size curve and the largest batch meeting the target."""
    dep = deployment_from_args(args)
    target = _target(args, dep.phase)
    note = _note(args)
    note(f"sizing the batch of {dep.model.name} on {dep.fleet.name} with {dep.policy}")
    advice = advise_batch(dep, target, max_tokens_per_gpu=args.max_tokens)
    if args.png:
        from controlplane.cli.plots import render_batch_curve  # matplotlib is slow

        path = render_batch_curve(
            advice, args.png, title=f"{dep.model.name} on {dep.fleet.name}: batch sizing"
        )
        note(f"wrote {path}")
    if args.output == "table":
        _print(batch_table(advice))
    else:
        _print(files.dump_document(batch_document(advice), args.output))
    if advice.infeasible:
        raise InfeasibleError("no batch size works", advice.infeasible)
    return 0


def cmd_advise_context(args: argparse.Namespace) -> int:
    """``advise context``: long-context capacity per policy."""
    dep = deployment_from_args(args)
    contexts = _ints(args.contexts, "--contexts")
    policies = parse_policies(args.policies)
    _note(args)(f"long-context report of {', '.join(policies)} at {args.tokens} tokens/GPU")
    advice = advise_context(dep, args.tokens, contexts=contexts, policies=policies)
    if args.output == "table":
        _print(context_table(advice))
    else:
        _print(files.dump_document(context_document(advice), args.output))
    if all(rep.longest_context is None for rep in advice.policies):
        raise InfeasibleError(
            f"no policy holds even {min(contexts):,} tokens of context at {args.tokens} "
            "tokens per GPU",
            (
                "To fix: lower --tokens, use --kv-cache-dtype fp8, try shorter --contexts, or "
                "add GPUs with more memory",
            ),
        )
    return 0


def cmd_advise_tiers(args: argparse.Namespace) -> int:
    """``advise tiers``: split the nodes between an interactive and a batch tier."""
    dep = deployment_from_args(args)
    prices = read_prices(args.prices) if args.prices else None
    additions = None
    if args.additions:
        additions = tuple(x.strip() for x in args.additions.split(",") if x.strip())
    req = TierRequest(
        deployment=dep,
        interactive=InteractiveTier(
            tpot_ms=args.tpot_ms,
            ttft_ms=args.ttft_ms,
            requests_per_s=args.rate,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            max_utilisation=args.max_utilisation,
        ),
        batch=BatchTier(
            phase=args.phase,
            tokens_per_gpu=args.tokens or DEFAULT_TOKENS_PER_GPU[args.phase],
            context_len=args.context,
            min_tokens_per_s=args.batch_min_tokens_per_s,
        ),
        preference=args.preference,
        allow_cross_vendor=args.allow_cross_vendor,
        additions=additions,
        prices=prices,
    )
    _note(args)(
        f"splitting {dep.fleet.name} for {args.rate:g} req/s ({args.preference}); final "
        f"plans with {dep.policy}"
    )
    tp = plan_tiers(req)
    if args.output == "table":
        _print(tiers_table(tp))
    else:
        _print(files.dump_document(tiers_document(tp), args.output))
    if not tp.interactive.slo_met:
        adds = tuple(
            f"add {a.nodes} node(s) of {a.gpus_per_node}x {a.gpu_model} ({a.gpus} GPUs)"
            for a in tp.interactive.additions
        )
        raise InfeasibleError(
            "the interactive SLO cannot be met with this fleet", (*tp.interactive.reasons, *adds)
        )
    return 0


def cmd_plan_cost(args: argparse.Namespace) -> int:
    """``plan cost``: policies side by side with cost per hour and per million tokens."""
    prices = read_prices(args.prices)
    problem = problem_from_args(args)
    rows = compare_policies(problem, parse_policies(args.policies), _note(args))
    if args.output == "table":
        _print(cost_table(rows, prices))
    else:
        _print(files.dump_document(cost_document(rows, prices), args.output))
    return 0


def cmd_plan_min_cost(args: argparse.Namespace) -> int:
    """``plan min-cost``: the cheapest subset of whole nodes reaching a throughput."""
    dep = deployment_from_args(args)
    prices = read_prices(args.prices)
    tokens = args.tokens or DEFAULT_TOKENS_PER_GPU[dep.phase]
    _note(args)(
        f"cheapest subset of {dep.fleet.name} for {args.target_tokens_per_s:,.0f} tokens/s: "
        f"screen greedy, finalists {dep.policy}"
    )
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
            _note(args)(f"wrote plan {r.plan.id} to {path}")
    if args.output == "table":
        _print(min_cost_table(res))
    else:
        _print(files.dump_document(min_cost_document(res), args.output))
    return 0


def cmd_bench_strategies(args: argparse.Namespace) -> int:
    """``bench strategies``: runs :func:`bench.strategies.main`."""
    from bench.strategies import main

    return main(args)


# ---------------------------------------------------------------------------- register


def _group(
    groups: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """The sub-command action of group ``name``: the existing one (``plan`` is registered
    by :mod:`controlplane.cli.local`), else a new group."""
    existing = groups.choices.get(name) if isinstance(groups.choices, dict) else None
    if isinstance(existing, argparse.ArgumentParser):
        for action in existing._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action
    p = groups.add_parser(name, help=help_text, description=help_text)
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION", required=True)


def _leaf(
    group: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Handler,
    help_text: str,
) -> argparse.ArgumentParser:
    p = group.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(handler=handler)
    return p


def _add_targets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tpot-ms", type=float, metavar="MS", help="time-per-output-token target")
    p.add_argument("--ttft-ms", type=float, metavar="MS", help="time-to-first-token target")


def register(groups: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``advise batch|context|tiers`` and ``plan cost|min-cost``. Register after
    :func:`controlplane.cli.local.register` so the ``plan`` group is shared."""
    advise = _group(groups, "advise", "batch size, long context and tier advice")
    p = _leaf(
        advise, "batch", cmd_advise_batch, "largest batch per GPU that fits and meets a target"
    )
    _add_inputs(p, policy="greedy", redundant=0)
    _add_targets(p)
    p.add_argument(
        "--max-tokens", type=int, metavar="N", help="largest batch to try, tokens per GPU"
    )
    p.add_argument("--png", metavar="OUT.png", help="also draw the throughput curve")

    p = _leaf(advise, "context", cmd_advise_context, "long-context capacity of each policy")
    _add_inputs(p, policy="greedy", redundant=0)
    p.add_argument("--tokens", type=int, required=True, metavar="N", help="batch, tokens/GPU")
    p.add_argument(
        "--contexts",
        default=",".join(str(c) for c in DEFAULT_CONTEXTS),
        metavar="LIST",
        help="contexts to solve, tokens (e.g. 32k,64k,128k; default: %(default)s)",
    )
    p.add_argument(
        "--policies",
        default="uniform,greedy,ilp",
        metavar="LIST",
        help="comma-separated policies (default: %(default)s)",
    )

    p = _leaf(advise, "tiers", cmd_advise_tiers, "split nodes into interactive and batch tiers")
    p.description = (
        "Split the fleet's nodes between an interactive tier (replicas inside one NVLink "
        "domain each, meeting --tpot-ms/--ttft-ms at --rate requests/s) and a batch tier "
        "(one expert-parallel deployment over the rest). --phase, --context and --tokens "
        "describe the batch tier's workload; --policy solves the final plans."
    )
    _add_inputs(p, policy="ilp", redundant=0)
    _add_targets(p)
    p.add_argument("--rate", type=float, required=True, metavar="R", help="requests/s")
    p.add_argument("--prompt-tokens", type=int, default=2048, metavar="N")
    p.add_argument("--output-tokens", type=int, default=256, metavar="N")
    p.add_argument("--max-utilisation", type=float, default=0.8, metavar="U")
    p.add_argument(
        "--tokens", type=int, metavar="N", help="batch tier: tokens per GPU (phase default)"
    )
    p.add_argument("--batch-min-tokens-per-s", type=float, metavar="X", help="batch target")
    p.add_argument("--preference", choices=PREFERENCES, default="fastest")
    p.add_argument(
        "--additions",
        metavar="LIST",
        help="catalog GPUs to size when the SLO is unmet (default: all FlashAttention-class)",
    )
    p.add_argument("--prices", metavar="FILE", help="price file to rank additions by cost")
    p.add_argument("--allow-cross-vendor", action="store_true")

    plan = _group(groups, "plan", "solve, inspect, compare, export and render placement plans")
    p = _leaf(plan, "cost", cmd_plan_cost, "compare policies with cost per million tokens")
    _add_inputs(p, policy="ilp", redundant=32)
    p.add_argument("--tokens", type=int, metavar="N", help="tokens per step per GPU")
    p.add_argument("--previous", metavar="PLAN", help="plan to stay close to (re-planning)")
    p.add_argument("--policies", default=",".join(POLICIES), metavar="LIST")
    p.add_argument("--prices", metavar="FILE", help="price file (default: built-in assumptions)")

    p = _leaf(plan, "min-cost", cmd_plan_min_cost, "cheapest node subset for a throughput")
    _add_inputs(p, policy="ilp", redundant=0)
    p.add_argument("--target-tokens-per-s", type=float, required=True, metavar="X")
    p.add_argument("--tokens", type=int, metavar="N", help="tokens per step per GPU")
    p.add_argument("--layout", choices=LAYOUTS, default="best", help="default: best")
    p.add_argument("--finalists", type=int, default=3, metavar="K")
    p.add_argument("--prices", metavar="FILE", help="price file (default: built-in assumptions)")
    p.add_argument("--allow-cross-vendor", action="store_true")
    p.add_argument("--save-plans", metavar="DIR", help="save the chosen plans in DIR")

    bench = _group(groups, "bench", "benchmarks")
    p = _leaf(bench, "strategies", cmd_bench_strategies, "deployment-strategy scenarios")
    from bench.strategies import add_arguments

    add_arguments(p)
