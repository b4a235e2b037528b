"""``mixfleetctl advise``: deployment-strategy advice from files (issue 6).

* ``advise batch``   - largest batch per GPU that fits memory and meets a TPOT/TTFT target,
  with the throughput curve (table, JSON/YAML, ``--png``);
* ``advise context`` - per policy, attention shares and KV per GPU model at long contexts
  and the longest context each holds at a batch;
* ``advise tiers``   - interactive/batch split of the fleet's nodes for an SLO and a rate.

Handlers read files (fleet, model config, load, prices), call the pure planners in
:mod:`policies.advice.advise` and :mod:`policies.advice.tiers`, and print. Exit 3 (infeasible) when the
question has no answer: no batch meets the target, the SLO cannot be met (the error lists
what to add).
"""

from __future__ import annotations

import argparse

from apis.cliargs import positive_float, positive_int
from controlplane.cli.output import (
    Groups,
    add_group,
    add_leaf,
    emit,
    emit_document,
    notes,
    show_progress,
    ticker,
    token_count,
)
from controlplane.cli.problem import (
    DEFAULT_TOKENS_PER_GPU,
    add_deployment_args,
    deployment_from_args,
    parse_policies,
    read_prices,
)
from policies import defaults
from policies.errors import InfeasibleError, InputError

# ------------------------------------------------------------------------ inputs


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
    """``32k,64k,131072`` -> token counts (k = 1024).

    Raises:
        InputError: an entry that is not a positive integer.
    """
    out = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        try:
            out.append(token_count(part))
        except argparse.ArgumentTypeError as exc:
            raise InputError(
                f"{part.lower()!r} is not a positive token count. To fix: write e.g. "
                "32k,64k,131072",
                field=field,
            ) from exc
    if not out:
        raise InputError("give at least one context", field=field)
    return tuple(out)


# ---------------------------------------------------------------------- handlers


def cmd_advise_batch(args: argparse.Namespace) -> int:
    """``advise batch``: the batch-size curve and the largest batch meeting the target."""
    from controlplane.cli.reports import batch_document, batch_table
    from policies.advice.advise import advise_batch

    dep = deployment_from_args(args)
    target = _target(args, dep.phase)
    note = notes(args)
    note(f"sizing the batch of {dep.model.name} on {dep.fleet.name} with {dep.policy}")
    with ticker(note, "batch sizing still solving", enabled=show_progress(args)):
        advice = advise_batch(dep, target, max_tokens_per_gpu=args.max_tokens)
    if args.png:
        from controlplane.cli.plots import render_batch_curve  # matplotlib is slow

        path = render_batch_curve(
            advice, args.png, title=f"{dep.model.name} on {dep.fleet.name}: batch sizing"
        )
        note(f"wrote {path}")
    if args.output == "table":
        emit(batch_table(advice))
    else:
        emit_document(batch_document(advice), args.output, [f"batch/{advice.phase}"])
    if advice.infeasible:
        raise InfeasibleError("no batch size works", advice.infeasible)
    return 0


def cmd_advise_context(args: argparse.Namespace) -> int:
    """``advise context``: long-context capacity per policy."""
    from controlplane.cli.reports import context_document, context_table
    from policies.advice.advise import advise_context

    dep = deployment_from_args(args)
    contexts = _ints(args.contexts, "--contexts")
    policies = parse_policies(args.policies)
    notes(args)(f"long-context report of {', '.join(policies)} at {args.tokens} tokens/GPU")
    with ticker(notes(args), "context report still solving", enabled=show_progress(args)):
        advice = advise_context(dep, args.tokens, contexts=contexts, policies=policies)
    if args.output == "table":
        emit(context_table(advice))
    else:
        names = [f"policy/{rep.policy}" for rep in advice.policies]
        emit_document(context_document(advice), args.output, names)
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
    from controlplane.cli.reports import tiers_document, tiers_table
    from policies.advice.tier_planner import plan_tiers
    from policies.advice.tiers import BatchTier, InteractiveTier, TierRequest

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
    notes(args)(
        f"splitting {dep.fleet.name} for {args.rate:g} req/s ({args.preference}); final "
        f"plans with {dep.policy}"
    )
    with ticker(notes(args), "tier split still solving", enabled=show_progress(args)):
        tp = plan_tiers(req)
    if args.output == "table":
        emit(tiers_table(tp))
    else:
        emit_document(tiers_document(tp), args.output, ["tiers/interactive", "tiers/batch"])
    if not tp.interactive.slo_met:
        adds = tuple(
            f"add {a.nodes} node(s) of {a.gpus_per_node}x {a.gpu_model} ({a.gpus} GPUs)"
            for a in tp.interactive.additions
        )
        raise InfeasibleError(
            "the interactive SLO cannot be met with this fleet", (*tp.interactive.reasons, *adds)
        )
    return 0


# ---------------------------------------------------------------------- register


def _add_targets(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tpot-ms", type=positive_float, metavar="MS", help="time-per-output-token target"
    )
    p.add_argument(
        "--ttft-ms", type=positive_float, metavar="MS", help="time-to-first-token target"
    )


def register(groups: Groups) -> None:
    """Add the ``advise`` group: ``batch``, ``context`` and ``tiers``."""
    advise = add_group(groups, "advise", "batch size, long context and tier advice")
    p = add_leaf(
        advise, "batch", cmd_advise_batch, "largest batch per GPU that fits and meets a target"
    )
    add_deployment_args(p, policy=defaults.DEFAULT_SWEEP_POLICY)
    _add_targets(p)
    p.add_argument(
        "--max-tokens", type=positive_int, metavar="N", help="largest batch to try, tokens per GPU"
    )
    p.add_argument("--png", metavar="OUT.png", help="also draw the throughput curve")

    p = add_leaf(advise, "context", cmd_advise_context, "long-context capacity of each policy")
    add_deployment_args(p, policy=defaults.DEFAULT_SWEEP_POLICY)
    p.add_argument(
        "--tokens", type=positive_int, required=True, metavar="N", help="batch, tokens/GPU"
    )
    p.add_argument(
        "--contexts",
        default=",".join(f"{c // 1024}k" for c in defaults.DEFAULT_CONTEXTS),
        metavar="LIST",
        help="contexts to solve, tokens (e.g. 32k,64k,128k; default: %(default)s)",
    )
    p.add_argument(
        "--policies",
        default="uniform,greedy,ilp",
        metavar="LIST",
        help="comma-separated policies (default: %(default)s)",
    )
    _register_tiers(advise)


def _register_tiers(advise: Groups) -> None:
    """``advise tiers``."""
    p = add_leaf(
        advise,
        "tiers",
        cmd_advise_tiers,
        "split nodes into interactive and batch tiers",
        description=(
            "Split the fleet's nodes between an interactive tier (replicas inside one NVLink "
            "domain each, meeting --tpot-ms/--ttft-ms at --rate requests/s) and a batch tier "
            "(one expert-parallel deployment over the rest). --phase, --context and --tokens "
            "describe the batch tier's workload; --policy solves the final plans."
        ),
    )
    add_deployment_args(p, policy=defaults.DEFAULT_POLICY)
    _add_targets(p)
    p.add_argument("--rate", type=positive_float, required=True, metavar="R", help="requests/s")
    p.add_argument("--prompt-tokens", type=positive_int, default=2048, metavar="N")
    p.add_argument("--output-tokens", type=positive_int, default=256, metavar="N")
    p.add_argument("--max-utilisation", type=positive_float, default=0.8, metavar="U")
    p.add_argument(
        "--tokens",
        type=positive_int,
        metavar="N",
        help="batch tier: tokens per GPU (phase default)",
    )
    p.add_argument(
        "--batch-min-tokens-per-s", type=positive_float, metavar="X", help="batch target"
    )
    p.add_argument(
        "--preference",
        choices=defaults.PREFERENCES,
        default=defaults.DEFAULT_PREFERENCE,
        help="what the interactive units favour (default: %(default)s)",
    )
    p.add_argument(
        "--additions",
        metavar="LIST",
        help="catalog GPUs to size when the SLO is unmet (default: all FlashAttention-class)",
    )
    p.add_argument("--prices", metavar="FILE", help="price file to rank additions by cost")
    p.add_argument("--allow-cross-vendor", action="store_true")
