"""The command-line options of a placement question: fleet, model and workload, the solver,
the engine (:func:`add_problem_args`, :func:`add_deployment_args`, :func:`add_engine_args`),
and reading the engine options through the one engine parser (:func:`engine_from_args`).

Re-exported by :mod:`controlplane.cli.problem`, which reads the rest of the options into a
problem; import from there.
"""

from __future__ import annotations

import argparse

from apis.cliargs import non_negative_float, non_negative_int, positive_float, positive_int
from controlplane.cli.output import add_output_arg, add_progress_arg, token_count
from policies import defaults
from policies.defaults import FORMS, KV_DTYPES, PHASES, POLICIES, parse_redundant_experts
from policies.errors import InputError
from policies.estimate.engines import (
    A2A_BACKENDS,
    DISPATCH_OPTIONS,
    DP_BALANCE_OPTIONS,
    ENGINES,
    EngineSpec,
    parse_engine,
)

_TOKENS_HELP = ", ".join(f"{n} {phase}" for phase, n in defaults.DEFAULT_TOKENS_PER_GPU.items())


#: Engine flag -> the field of the engine document it sets (for error messages).
_ENGINE_FLAGS = {
    "engine.name": "--engine",
    "engine.version": "--engine",
    "engine.options.a2aBackend": "--a2a-backend",
    "engine.options.dispatch": "--dispatch",
    "engine.options.dpBalance": "--dp-balance",
}


def engine_from_args(args: argparse.Namespace) -> EngineSpec:
    """``--engine`` and its options through the one engine parser
    (:func:`policies.estimate.engines.parse_engine`, as the deployment document is read).

    Raises:
        InputError: an option the engine does not have, naming the flag.
    """
    doc = {
        "name": args.engine,
        "options": {
            "a2aBackend": args.a2a_backend,
            "dispatch": args.dispatch,
            "dpBalance": args.dp_balance,
        },
    }
    try:
        return parse_engine(doc)
    except InputError as exc:
        flag = _ENGINE_FLAGS.get(exc.field, "--engine")
        raise InputError(str(exc).removeprefix(f"{exc.field}: "), field=flag) from exc


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--engine`` and the options that change how it executes a plan."""
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="native",
        help="engine that will run the plan; the plan is solved for its replica choice and DP "
        "balancing (default: native, idealised shares no engine executes)",
    )
    backends = dict.fromkeys(b for bs in A2A_BACKENDS.values() for b in bs)
    p.add_argument(
        "--a2a-backend",
        choices=("auto", *backends),
        default="auto",
        help="all-to-all backend of the EP group (default: auto, the first every GPU supports)",
    )
    p.add_argument(
        "--dispatch",
        choices=DISPATCH_OPTIONS,
        default="auto",
        help="replica choice; static or dynamic: SGLang's --ep-dispatch-algorithm",
    )
    p.add_argument(
        "--dp-balance",
        choices=DP_BALANCE_OPTIONS,
        default="auto",
        help="who sets the DP attention shares: router (planned weights), engine (equal "
        "shares) or auto (default: router, but engine for trtllm: it takes no DP rank)",
    )


def _redundant_arg(text: str) -> int | None:
    """argparse type of ``--redundant-experts``: ``auto`` (None) or an integer >= 0."""
    try:
        return parse_redundant_experts(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither auto nor a count >= 0 (write e.g. auto, 0 or 32)"
        ) from None


def _add_inputs(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """Fleet, model and workload options of every placement question (``required=False``:
    the handler checks ``--fleet`` and ``--model``, for a command that can do without)."""
    p.add_argument("--fleet", required=required, metavar="FILE", help="Fleet file (YAML or JSON)")
    p.add_argument(
        "--exclude-nodes",
        metavar="LIST",
        help="comma-separated nodes of the fleet to leave out (e.g. a node being repaired)",
    )
    which = p.add_mutually_exclusive_group(required=required)
    which.add_argument("--model", metavar="NAME", help="model preset (mixfleetctl model list)")
    which.add_argument(
        "--model-config", metavar="PATH", help="Hugging Face config.json of the model"
    )
    p.add_argument(
        "--phase",
        choices=PHASES,
        default=defaults.DEFAULT_PHASE,
        help="default: %(default)s",
    )
    p.add_argument(
        "--context",
        type=token_count,
        default=defaults.DEFAULT_CONTEXT_LEN,
        metavar="N",
        help="context length, tokens (4096, 32k; default: %(default)s)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_DTYPES,
        default=defaults.DEFAULT_KV_CACHE_DTYPE,
        help="default: %(default)s",
    )
    p.add_argument(
        "--load",
        metavar="FILE|SPEC",
        help="expert load: a JSON file ([layers][experts] or an SGLang logical_count dump), "
        "synthetic:zipf:S:seed=N, or uniform (default)",
    )
    p.add_argument(
        "--form", choices=FORMS, default=defaults.DEFAULT_FORM, help="default: %(default)s"
    )
    p.add_argument(
        "--redundant-experts",
        type=_redundant_arg,
        default=None,
        metavar="R|auto",
        help="extra expert slots per MoE layer (engine form: experts + R must divide by the "
        "GPU count); default: auto, the smallest count the form accepts on the fleet's GPUs "
        "(said on stderr)",
    )


def _add_solver(p: argparse.ArgumentParser) -> None:
    """ILP options, the engine and the progress options."""
    p.add_argument(
        "--time-limit",
        type=positive_float,
        default=defaults.DEFAULT_SOLVER_TIME_LIMIT_S,
        metavar="S",
        help="ilp wall-clock limit per solve, seconds (default: %(default)s)",
    )
    p.add_argument(
        "--mip-gap",
        type=non_negative_float,
        default=defaults.DEFAULT_MIP_GAP,
        metavar="G",
        help="ilp relative MIP gap per layer (default: %(default)s)",
    )
    p.add_argument(
        "--solver",
        choices=defaults.MILP_SOLVERS,
        default=defaults.DEFAULT_MILP_SOLVER,
        help="MILP solver (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=non_negative_int,
        default=defaults.DEFAULT_WORKERS,
        metavar="N",
        help="processes solving layers in parallel; 0 = one per CPU (default: %(default)s)",
    )
    add_engine_args(p)
    add_progress_arg(p)


def add_problem_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """Arguments shared by ``plan solve`` and ``plan compare``."""
    _add_inputs(p, required=required)
    p.add_argument(
        "--tokens",
        type=positive_int,
        metavar="N",
        help=f"tokens per step per GPU on average (default: {_TOKENS_HELP})",
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
    _add_solver(p)


def add_deployment_args(p: argparse.ArgumentParser, *, policy: str) -> None:
    """Fleet, model, workload shape, ``--policy`` (default ``policy``: one of
    :data:`policies.defaults.DEFAULT_POLICY` or ``DEFAULT_SWEEP_POLICY``), solver options
    and ``-o`` (the dests ``plan compare`` uses)."""
    _add_inputs(p)
    sweep = policy == defaults.DEFAULT_SWEEP_POLICY != defaults.DEFAULT_POLICY
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=policy,
        help="default: %(default)s"
        + (
            " (a sweep solves one plan per point; ilp would take its time limit per point)"
            if sweep
            else ""
        ),
    )
    _add_solver(p)
    add_output_arg(p)
