"""``mixfleetctl serve simulate``: run the serving simulator (:mod:`policies.serving.simulate`)
on a serving plan and a traffic description.

The plan is a serving-plan file (``examples/serving/*plan*.yaml``, the document of
:func:`policies.serving.plan.plan_from_doc`) or a fleet plan written by ``mixfleetctl schedule
show -o json`` (``kind: FleetPlan``; ``--deployment`` picks one of its deployments, whose
``servingPlan``, ``traffic`` and ``slo`` are read and whose ``predicted`` latencies are shown
next to the simulated ones).

Traffic and SLO come from a file (``--traffic``: ``{traffic: ..., slo: ...}`` or a
ModelDeployment document with ``spec.traffic`` and ``spec.slo``), from flags (``--rps``,
``--isl``, ``--osl`` ...), or from the fleet plan, whose fields the flags replace (``--rps
40`` runs the plan's lengths at 40 requests/s); flags and a file are not mixed.

Prints TTFT/TPOT percentiles, goodput against the SLOs, throughput and cost, per pool its
share, attainment and instance use; ``-o json|yaml`` the same as a document; ``--plot
FILE.png`` draws the TTFT and TPOT distributions.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apis.cliargs import non_negative_float, non_negative_int, positive_float, positive_int
from controlplane.cli import files
from controlplane.cli.output import (
    Groups,
    add_group,
    add_leaf,
    add_output_arg,
    emit,
    emit_document,
    table,
    token_count,
)
from policies.errors import InputError

if TYPE_CHECKING:
    from policies.serving.plan import ServingPlan
    from policies.serving.simulate import SimReport
    from policies.serving.traffic import Slo, Traffic

_TRAFFIC_FLAGS = (
    "rps",
    "output_tokens_per_s",
    "isl",
    "osl",
    "isl_p90",
    "osl_p90",
    "arrival",
    "burst_cv",
)
_SLO_FLAGS = ("ttft_ms", "tpot_ms", "percentile")


def _flag(name: str) -> str:
    return "--" + {"output_tokens_per_s": "output-tokens-per-s"}.get(name, name.replace("_", "-"))


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [_flag(n) for n in names if getattr(args, n) is not None]


def _traffic_of_flags(args: argparse.Namespace, base: Traffic | None) -> Traffic:
    """Traffic of ``--rps``/``--output-tokens-per-s``, ``--isl``, ``--osl`` ..., through the
    one document parser (so the checks and messages are the deployment's). With ``base``
    (the fleet plan's traffic) the flags replace its fields and the rest is kept: ``--rps
    40`` runs the plan's lengths at 40 requests/s."""
    from policies.serving.traffic import traffic_from_doc, traffic_to_doc

    doc: dict[str, Any] = traffic_to_doc(base) if base is not None else {}
    for key, mean, p90, flag in (
        ("inputTokens", args.isl, args.isl_p90, "--isl"),
        ("outputTokens", args.osl, args.osl_p90, "--osl"),
    ):
        if mean is not None:
            doc[key] = {"mean": mean, "p90": p90 or mean}
        elif key not in doc:
            raise InputError(
                "traffic needs the prompt and output lengths. To fix: pass --isl and --osl "
                "(e.g. --isl 4096 --osl 512), or --traffic FILE",
                field=flag,
            )
        elif p90 is not None:
            if "mean" not in doc[key]:
                raise InputError(
                    f"the plan's {key} are a histogram, which has no p90 to replace. To fix: "
                    f"pass {flag} with {flag}-p90",
                    field=f"{flag}-p90",
                )
            doc[key] = {"mean": doc[key]["mean"], "p90": p90}
    if args.rps is not None or args.output_tokens_per_s is not None:
        doc.pop("requestsPerS", None)
        doc.pop("outputTokensPerS", None)
    if args.arrival == "poisson" and args.burst_cv is not None:
        raise InputError(
            "a burst CV is for bursty arrivals (Poisson gaps have a CV of 1). To fix: pass --arrival "
            "bursty, or drop --burst-cv",
            field="--burst-cv",
        )
    if args.arrival is not None:
        doc["arrival"] = args.arrival
        if args.arrival == "poisson":
            doc.pop("burstCv", None)
    elif args.burst_cv is not None:  # a burst CV asks for bursty arrivals
        doc["arrival"] = "bursty"
    doc.setdefault("arrival", "poisson")
    doc.update(
        _fields_given(
            args,
            {
                "burstCv": "burst_cv",
                "requestsPerS": "rps",
                "outputTokensPerS": "output_tokens_per_s",
            },
        )
    )
    try:
        return traffic_from_doc(doc, "traffic")
    except InputError as exc:
        flags = {
            "traffic.requestsPerS": "--rps",
            "traffic.outputTokensPerS": "--output-tokens-per-s",
            "traffic.inputTokens.p90": "--isl-p90",
            "traffic.outputTokens.p90": "--osl-p90",
            "traffic.burstCv": "--burst-cv",
        }
        raise _flag_error(exc, flags.get(exc.field, exc.field)) from exc


def _slo_of_flags(args: argparse.Namespace) -> Slo | None:
    from policies.serving.traffic import slo_from_doc

    if args.ttft_ms is None and args.tpot_ms is None:
        return None
    keys = {"ttftMs": "ttft_ms", "tpotMs": "tpot_ms", "percentile": "percentile"}
    doc = _fields_given(args, keys)
    try:
        return slo_from_doc(doc, "slo")
    except InputError as exc:
        attr = keys.get((exc.field or "").rpartition(".")[2])
        flag = "--" + attr.replace("_", "-") if attr else "--ttft-ms/--tpot-ms"
        raise _flag_error(exc, flag) from exc


def _fields_given(args: argparse.Namespace, keys: dict[str, str]) -> dict[str, Any]:
    """The document fields of the flags given: ``keys`` maps a field to its ``args``
    attribute; a flag left out (None) gives no field."""
    return {k: getattr(args, a) for k, a in keys.items() if getattr(args, a) is not None}


def _flag_error(exc: InputError, flag: str) -> InputError:
    """``exc``'s message without its document path, naming the command-line ``flag``."""
    return InputError(str(exc).split(": ", 1)[-1], field=flag)


def _traffic_file(path: str) -> tuple[Traffic | None, Slo | None]:
    """``{traffic, slo}`` or a ModelDeployment document's ``spec.traffic`` and ``spec.slo``."""
    from policies.keys import check_keys
    from policies.serving.traffic import slo_from_doc, traffic_from_doc
    from policies.spec.build import parse_deployment

    doc = files.read_document(path, "deployment")
    where = f"traffic file {path!r}"
    try:
        if isinstance(doc, Mapping) and doc.get("kind") == "ModelDeployment":
            spec = parse_deployment(doc)
            if spec.traffic is None:
                raise InputError(
                    "the deployment has no traffic. To fix: add spec.traffic", field="spec.traffic"
                )
            return spec.traffic, spec.slo
        if not isinstance(doc, Mapping):
            raise InputError("must be a mapping {traffic: ..., slo: ...}", field="")
        check_keys(doc, ("traffic", "slo"), "")
        if "traffic" not in doc:
            raise InputError("missing. To fix: give traffic: {requestsPerS: ...}", field="traffic")
        slo = slo_from_doc(doc["slo"], "slo") if doc.get("slo") is not None else None
        return traffic_from_doc(doc["traffic"], "traffic"), slo
    except InputError as exc:
        wrapped = InputError(f"{where}: {exc}")
        wrapped.field = exc.field
        raise wrapped from exc


class _PlanInput:
    """What the plan file gave: the serving plan, and from a fleet plan its deployment's
    traffic, SLO and the planner's predictions."""

    def __init__(
        self,
        plan: ServingPlan,
        *,
        deployment: str = "",
        traffic: Traffic | None = None,
        slo: Slo | None = None,
        predicted: Mapping[str, Any] | None = None,
    ) -> None:
        self.plan = plan
        self.deployment = deployment
        self.traffic = traffic
        self.slo = slo
        self.predicted = predicted or {}


def _plan_file(path: str, deployment: str | None) -> _PlanInput:
    from policies.serving.plan import plan_from_doc
    from policies.serving.traffic import slo_from_doc, traffic_from_doc

    doc = files.read_document(path, "plan")
    where = f"plan file {path!r}"
    try:
        if not isinstance(doc, Mapping):
            raise InputError("must be a mapping: a serving plan {pools: [...]} or a FleetPlan")
        if doc.get("kind") != "FleetPlan":
            if deployment:
                raise InputError(
                    "--deployment picks a deployment of a fleet plan (kind: FleetPlan); this "
                    "is a serving plan. To fix: drop --deployment",
                    field="--deployment",
                )
            return _PlanInput(plan_from_doc(doc, "plan"))
        deps = doc.get("deployments")
        if not isinstance(deps, list) or not all(isinstance(d, Mapping) for d in deps):
            raise InputError("must be a list of deployments", field="deployments")
        names = [str(d.get("name", "")) for d in deps]
        served = [n for n, d in zip(names, deps, strict=True) if d.get("servingPlan")]
        if deployment is None:
            if len(served) != 1:
                raise InputError(
                    f"the fleet plan serves {len(served)} deployments "
                    f"({', '.join(served) or 'none'}). To fix: pass --deployment NAME",
                    field="--deployment",
                )
            deployment = served[0]
        if deployment not in names:
            raise InputError(
                f"no deployment {deployment!r} in the fleet plan (it has: {', '.join(names)})",
                field="--deployment",
            )
        i = names.index(deployment)
        d = deps[i]
        at = f"deployments[{i}]"
        if not d.get("servingPlan"):
            raise InputError(
                f"deployment {deployment!r} has no instances in this fleet plan (nothing to "
                "simulate); see its shortfall in `schedule show`",
                field=f"{at}.servingPlan",
            )
        plan = plan_from_doc(d["servingPlan"], f"{at}.servingPlan")
        traffic = traffic_from_doc(d["traffic"], f"{at}.traffic") if d.get("traffic") else None
        slo = slo_from_doc(d["slo"], f"{at}.slo") if d.get("slo") else None
        predicted = d.get("predicted") if isinstance(d.get("predicted"), Mapping) else None
        return _PlanInput(
            plan, deployment=deployment, traffic=traffic, slo=slo, predicted=predicted
        )
    except InputError as exc:
        wrapped = InputError(f"{where}: {exc}")
        wrapped.field = exc.field
        raise wrapped from exc


def _inputs(args: argparse.Namespace) -> tuple[_PlanInput, Traffic, Slo | None]:
    """The plan, traffic and SLO (None: no targets) of the command line (exactly one source
    of each)."""
    given = _plan_file(args.plan, args.deployment)
    flags = _given(args, _TRAFFIC_FLAGS)
    slo_flags = _given(args, _SLO_FLAGS)
    if args.traffic and flags:
        raise InputError(
            f"--traffic and {', '.join(flags)} both give the traffic. To fix: use one of the two",
            field=flags[0],
        )
    traffic, slo = given.traffic, given.slo
    if args.traffic:
        traffic, file_slo = _traffic_file(args.traffic)
        slo = file_slo or slo
    elif flags:
        traffic = _traffic_of_flags(args, traffic)
    if traffic is None:
        raise InputError(
            "no traffic to simulate. To fix: pass --rps N --isl TOKENS --osl TOKENS, or "
            "--traffic FILE",
            field="--rps",
        )
    if slo_flags:
        from policies.serving.traffic import check_slo

        targets = _slo_of_flags(args)
        if targets is not None:
            slo = targets
        elif slo is None:
            raise InputError(
                "--percentile needs a target. To fix: add --ttft-ms and/or --tpot-ms",
                field="--percentile",
            )
        else:  # only --percentile: the file's targets at that percentile
            slo = dataclasses.replace(slo, percentile=args.percentile)
            try:
                check_slo(slo, "slo")
            except InputError as exc:
                raise InputError(str(exc).split(": ", 1)[-1], field="--percentile") from exc
    return given, traffic, slo


def _ms(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:,.1f}"


def _usd(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:,.3f}"


def _latency_table(r: SimReport) -> str:
    """The TTFT and TPOT percentiles (ms) of the measured requests, as a small table."""
    return table(
        ["", "P50", "P90", "P99", "MEAN"],
        [
            [
                "TTFT ms",
                *(_ms(x) for x in (r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99, r.ttft_ms.mean)),
            ],
            [
                "TPOT ms",
                *(_ms(x) for x in (r.tpot_ms.p50, r.tpot_ms.p90, r.tpot_ms.p99, r.tpot_ms.mean)),
            ],
        ],
    )


def _summary_lines(r: SimReport, slo: Slo | None, given: _PlanInput) -> list[str]:
    """The run as a whole: requests, latencies, the planner's prediction, the SLO verdict,
    goodput, throughput and cost, one line each (the latency table in the middle)."""
    targets = [f"TTFT <= {slo.ttft_ms:g} ms"] if slo and slo.ttft_ms else []
    targets += [f"TPOT <= {slo.tpot_ms:g} ms"] if slo and slo.tpot_ms else []
    lines = []
    if given.deployment:
        lines.append(f"deployment {given.deployment}")
    lines += [
        f"requests   {r.requests:,} measured ({r.completed:,} finished), offered "
        f"{r.offered_rps:,.3f} req/s over {r.window_s:,.1f} s simulated",
        _latency_table(r),
    ]
    if given.predicted:
        pred = given.predicted
        lines.append(
            f"planner    predicted TTFT {pred.get('ttftMs', '-')} ms, "
            f"TPOT {pred.get('tpotMs', '-')} ms"
        )
    if slo is not None:
        verdict = "met" if r.slo_met else "MISSED"
        lines.append(
            f"SLO        {', '.join(targets)} for {slo.percentile:g}% of requests: "
            f"{100 * r.attainment:.1f}% within ({verdict})"
        )
    lines += [
        f"goodput    {r.goodput_rps:,.3f} req/s, {r.goodput_tokens_per_s:,.0f} output tokens/s",
        f"throughput {r.throughput_rps:,.3f} req/s, {r.throughput_tokens_per_s:,.0f} output "
        "tokens/s",
        f"cost       {r.usd_per_hour:,.2f} USD/h: {_usd(r.usd_per_million_tokens)} USD per "
        f"million output tokens ({_usd(r.usd_per_million_good_tokens)} within the SLO)",
    ]
    return lines


def _pool_table(r: SimReport) -> str:
    """One row per instance group of every pool; the pool's own figures on its first row."""
    rows = []
    for p in r.pools:
        for k, g in enumerate(p.groups):
            first = k == 0
            rows.append(
                [
                    p.name if first else "",
                    f"{p.requests:,}" if first else "",
                    f"{100 * p.attainment:.1f}%" if first else "",
                    _ms(p.ttft_p90_ms) if first else "",
                    _ms(p.tpot_p90_ms) if first else "",
                    f"{g.role} (KV link {100 * p.kv_link_utilisation:.0f}%)"
                    if g.role == "prefill"
                    else g.role,
                    g.instances,
                    f"{100 * g.utilisation:.0f}%",
                    f"{g.mean_running:.1f}",
                    _ms(g.mean_wait_ms),
                    g.max_queue,
                ]
            )
    return table(
        [
            "POOL",
            "REQUESTS",
            "WITHIN SLO",
            "TTFT P90 MS",
            "TPOT P90 MS",
            "ROLE",
            "INSTANCES",
            "BUSY",
            "RUNNING",
            "WAIT MS",
            "MAX QUEUE",
        ],
        rows,
    )


def _table(r: SimReport, slo: Slo | None, given: _PlanInput) -> str:
    """The report of ``mixfleetctl serve simulate``: the summary, a blank line, the pools."""
    return "\n".join([*_summary_lines(r, slo, given), "", _pool_table(r)])


def render_latencies(r: SimReport, slo: Slo | None, out: str | Path, title: str = "") -> Path:
    """Write the TTFT and TPOT distributions (cumulative, with the SLO targets) as a PNG
    (or SVG) and return its path.

    Raises:
        InputError: the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from controlplane.cli.render import save_png

    measured = r.records[len(r.records) - r.requests :]
    ttft = sorted(x.ttft_ms for x in measured if math.isfinite(x.ttft_ms))
    tpot = sorted(x.tpot_ms for x in measured if math.isfinite(x.tpot_ms) and x.output_tokens > 1)
    fig = Figure(figsize=(10.0, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for k, (name, values, target, pct) in enumerate(
        (
            ("TTFT", ttft, slo.ttft_ms if slo else 0.0, r.ttft_ms),
            ("TPOT", tpot, slo.tpot_ms if slo else 0.0, r.tpot_ms),
        )
    ):
        ax = fig.add_subplot(1, 2, k + 1)
        if values:
            n = len(values)
            ax.plot(values, [(i + 1) / n for i in range(n)], color="#1f77b4", label="requests")
        for q, v, style in ((50, pct.p50, ":"), (90, pct.p90, "--"), (99, pct.p99, "-.")):
            ax.axvline(v, color="#7f7f7f", linestyle=style, label=f"p{q} {v:,.1f} ms")
        if target:
            ax.axvline(target, color="#d62728", linewidth=2, label=f"SLO {target:g} ms")
        if slo is not None and target:
            ax.axhline(slo.percentile / 100, color="#d62728", linestyle=":", linewidth=1)
        ax.set_xlabel(f"{name}, ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
        ax.legend(loc="lower right", fontsize="small")
        ax.set_title(f"{name} ({len(values):,} requests)")
    head = title or "serving simulation"
    fig.suptitle(
        f"{head}: {r.offered_rps:,.2f} req/s offered, goodput {r.goodput_rps:,.2f} req/s "
        f"({100 * r.attainment:.1f}% within SLO)"
    )
    return save_png(fig, out, "--plot")


def _warmup(args: argparse.Namespace, traffic: Traffic, slo: Slo | None) -> int:
    """``--warmup``, or by default the requests that arrive within one request lifetime at
    the SLO (:func:`policies.serving.traffic.request_lifetime_s`; 10% of the requests
    without both targets), at most half of them: statistics from an empty fleet would
    measure instances still filling their batches."""
    from policies.serving.traffic import request_lifetime_s

    if args.warmup is not None:
        return int(args.warmup)
    life = request_lifetime_s(traffic, slo) if slo is not None else None
    n = math.ceil(traffic.requests_per_s * life) if life is not None else args.requests // 10
    return int(min(n, args.requests // 2))


def cmd_simulate(args: argparse.Namespace) -> int:
    from policies.serving.simulate import SimOptions, report_to_doc, simulate
    from policies.serving.traffic import slo_to_doc, traffic_to_doc

    given, traffic, slo = _inputs(args)
    options = SimOptions(
        requests=args.requests,
        seed=args.seed,
        warmup_requests=_warmup(args, traffic, slo),
        max_sim_s=args.max_sim_s,
    )
    try:
        report = simulate(given.plan, traffic, slo, options)
    except InputError as exc:
        if exc.field.startswith("options."):
            flag = {"options.warmupRequests": "--warmup", "options.requests": "--requests"}
            raise InputError(
                str(exc).split(": ", 1)[-1], field=flag.get(exc.field, exc.field)
            ) from exc
        raise
    if args.plot:
        path = render_latencies(report, slo, args.plot, given.deployment)
        print(f"wrote {path}", file=sys.stderr)
    if args.output == "table":
        emit(_table(report, slo, given))
        return 0
    doc: dict[str, Any] = {"kind": "ServingSimulation"}
    if given.deployment:
        doc["deployment"] = given.deployment
    doc["traffic"] = traffic_to_doc(traffic)
    if slo is not None:
        doc["slo"] = slo_to_doc(slo)
    doc["options"] = {
        "requests": options.requests,
        "seed": options.seed,
        "warmupRequests": options.warmup_requests,
        "maxSimS": options.max_sim_s,
    }
    if given.predicted:
        doc["predicted"] = dict(given.predicted)
    doc["simulated"] = report_to_doc(report)
    emit_document(doc, args.output, [f"servingsimulation/{given.deployment or 'plan'}"])
    return 0


def register(groups: Groups) -> None:
    """``serve simulate``."""
    serve = add_group(groups, "serve", "serving: simulate requests through a serving plan")
    p = add_leaf(
        serve,
        "simulate",
        cmd_simulate,
        "simulate requests through a serving plan: TTFT/TPOT percentiles, goodput, cost",
        description="Simulate requests through a serving plan (or one deployment of a fleet "
        "plan from `schedule show -o json`): TTFT/TPOT percentiles, goodput within the SLOs, "
        "throughput and USD per million output tokens. Traffic comes from --traffic FILE, "
        "from the flags, or from the fleet plan (the flags replace its fields: --rps 40 runs "
        "its lengths at 40 requests/s).",
    )
    p.add_argument(
        "plan",
        metavar="PLAN",
        help="serving plan file (YAML/JSON {pools: [...]}) or a fleet plan from "
        "`schedule show -o json`",
    )
    p.add_argument("--deployment", help="which deployment of a fleet plan (default: its only one)")
    p.add_argument(
        "--traffic",
        metavar="FILE",
        help="traffic file: {traffic: ..., slo: ...} or a ModelDeployment with spec.traffic",
    )
    t = p.add_argument_group("traffic (instead of --traffic; over a fleet plan's traffic)")
    t.add_argument("--rps", type=positive_float, help="mean arrival rate, requests per second")
    t.add_argument(
        "--output-tokens-per-s",
        type=positive_float,
        help="the demand as output tokens per second (instead of --rps)",
    )
    t.add_argument("--isl", type=token_count, help="mean prompt length, tokens (4096 or 4k)")
    t.add_argument("--osl", type=token_count, help="mean output length, tokens")
    t.add_argument("--isl-p90", type=token_count, help="p90 prompt length (default: --isl)")
    t.add_argument("--osl-p90", type=token_count, help="p90 output length (default: --osl)")
    t.add_argument("--arrival", choices=("poisson", "bursty"), help="arrivals (default poisson)")
    t.add_argument(
        "--burst-cv",
        type=positive_float,
        help="bursty: coefficient of variation of the gaps between arrivals, > 1 (default 2; "
        "given alone, it makes the arrivals bursty)",
    )
    s = p.add_argument_group("latency targets (override the file's)")
    s.add_argument("--ttft-ms", type=positive_float, help="time to first token target, ms")
    s.add_argument("--tpot-ms", type=positive_float, help="time per output token target, ms")
    s.add_argument("--percentile", type=positive_float, help="percentile of requests (default 90)")
    r = p.add_argument_group("the run")
    r.add_argument("--requests", type=positive_int, default=10_000, help="requests to simulate")
    r.add_argument("--seed", type=non_negative_int, default=0, help="random seed")
    r.add_argument(
        "--warmup",
        type=non_negative_int,
        help="first requests left out of the statistics (default: those arriving within one "
        "request lifetime, the TTFT target plus the p90 output at the TPOT target, at most "
        "half of --requests; 10%% without an SLO)",
    )
    r.add_argument(
        "--max-sim-s",
        type=non_negative_float,
        default=0.0,
        help="stop at this simulated time, s (unfinished requests miss); 0 = until all finish",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw the TTFT and TPOT distributions")
    add_output_arg(p)
