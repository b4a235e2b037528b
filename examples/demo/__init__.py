"""``make demo``: the control plane end to end on simulated agents (:mod:`demo.e2e`);
``--compare``: the mixed-24-decode scenario with all four policies.

The comparison: 8x A100-SXM4-80GB + 8x H100-SXM5-80GB + 8x H200 (examples/fleets/mixed-24.yaml),
DeepSeek-V3 decode, 128 tokens per GPU, context 4096, FP8 KV cache, skewed synthetic load
(``synthetic:zipf:0.5:seed=1``), 32 redundant experts, engine form. Prints the comparison
table and writes the plans and a picture of the ``ilp`` plan under ``out/demo/``
(git-ignored; a temporary directory when ``out/`` is not writable).

Equivalent command::

    mixfleetctl plan compare --fleet examples/fleets/mixed-24.yaml --model deepseek-v3 \\
        --phase decode --tokens 128 --context 4096 --kv-cache-dtype fp8 \\
        --load synthetic:zipf:0.5:seed=1 --redundant-experts 32 --form engine \\
        --save-plans out/demo
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from controlplane.cli import files
from controlplane.cli.output import quiet_note, stderr_note
from controlplane.cli.plan import compare_table
from controlplane.cli.problem import CompareRow, Problem, compare_policies
from policies.errors import InfeasibleError, MixfleetError
from policies.estimate.workload import make_workload, synthetic_zipf
from policies.model.architecture import preset
from policies.request import POLICIES, SolverOptions

REPO = Path(__file__).resolve().parents[2]
FLEET_FILE = REPO / "examples" / "fleets" / "mixed-24.yaml"
LOAD_SPEC = "synthetic:zipf:0.5:seed=1"


def scenario(time_limit_s: float = 60.0) -> Problem:
    """The mixed-24-decode problem.

    Raises:
        InputError: the example fleet file is missing or invalid.
    """
    fleet = files.read_fleet(FLEET_FILE)
    model = preset("deepseek-v3")
    workload = make_workload(
        model,
        phase="decode",
        tokens_per_gpu=128,
        context_len=4096,
        load=synthetic_zipf(model, LOAD_SPEC),
        kv_cache_dtype="fp8",
        load_source=LOAD_SPEC,
    )
    return Problem(
        fleet=fleet,
        model=model,
        workload=workload,
        form="engine",
        redundant_experts=32,
        options=SolverOptions(time_limit_s=time_limit_s),
    )


def _out_dir(requested: str | None) -> Path:
    """``--out``, else ``out/demo`` in the repository, else a fresh temporary directory."""
    candidate = Path(requested) if requested else REPO / "out" / "demo"
    try:
        candidate.mkdir(parents=True, exist_ok=True)
        probe = candidate / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError:
        if requested:
            raise
        return Path(tempfile.mkdtemp(prefix="mixfleet-demo-"))
    return candidate


def _ratios(rows: Sequence[CompareRow]) -> str:
    """``ilp tokens/s: 1.72x uniform, 1.25x eplb, 1.05x greedy``."""
    tps = {r.policy: r.result.plan.summary.tokens_per_s for r in rows if r.result is not None}
    if "ilp" not in tps:
        return "ilp found no plan"
    parts = [f"{tps['ilp'] / tps[p]:.2f}x {p}" for p in ("uniform", "eplb", "greedy") if p in tps]
    return "ilp tokens/s: " + ", ".join(parts)


def run(out: str | None = None, *, time_limit_s: float = 60.0, quiet: bool = False) -> Path:
    """Solve, print the comparison, save the plans and render the ilp plan.

    Returns:
        Path of the rendered PNG.

    Raises:
        MixfleetError: a solve or a file failed.
    """
    from controlplane.cli.render import render_plan

    note = quiet_note if quiet else stderr_note
    problem = scenario(time_limit_s)
    directory = _out_dir(out)
    print(
        "mixed-24-decode: 8x A100-SXM4-80GB + 8x H100-SXM5-80GB + 8x H200-SXM-141GB, "
        f"DeepSeek-V3 decode, 128 tokens/GPU, context 4096, KV fp8, load {LOAD_SPEC}, "
        "32 redundant experts, engine form\n"
    )
    rows = compare_policies(problem, POLICIES, note)
    print(compare_table(rows))
    print(_ratios(rows))
    for r in rows:
        if r.result is not None:
            files.write_document(directory / f"{r.policy}.json", r.result.plan.to_dict(), "plan")
    best = next((r for r in rows if r.policy == "ilp" and r.result is not None), None)
    if best is None or best.result is None:
        raise InfeasibleError("the ilp policy found no plan to render")
    png = render_plan(best.result.plan, directory / "mixed-24-decode-ilp.png")
    print(f"\nplans: {directory}/<policy>.json")
    print(f"picture of the ilp plan: {png}")
    return png


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m demo`` (``make demo``); returns the exit status.

    Without options: the control plane end to end (:mod:`demo.e2e`: controller on SQLite,
    simulated agents for mixed-24, a DeepSeek-V3 deployment, mixfleet-router sending requests
    to its DP ranks by the plan, contingency plans, a sustained load shift and the
    migration-aware re-plan; its logs go to ``--out``, default ``out/demo/``). ``--compare``:
    the four policies side by side on the mixed-24-decode scenario, with the picture of the
    ilp plan.
    """
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__, allow_abbrev=False)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="compare the four policies instead of the end-to-end run",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where the plans and the picture (--compare) or the logs go (default: out/demo)",
    )
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="S")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    if not args.compare:
        from demo import e2e as demo_e2e

        status = demo_e2e.main(["--log-dir", args.out] if args.out else [])
        if status == 0:
            print(
                "\nthe four policies side by side: PYTHONPATH=examples .venv/bin/python -m demo --compare"
            )
        return status
    try:
        run(args.out, time_limit_s=args.time_limit, quiet=args.quiet)
    except InfeasibleError as exc:
        print(f"error: infeasible: {exc}", file=sys.stderr)
        return 3
    except MixfleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write the demo output: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
