"""Cost: dollars per GPU-hour in, dollars per million tokens out, and the cheapest subset
of a fleet that meets a throughput target.

A :class:`PriceTable` gives a price per GPU-hour for each catalog GPU model. A plan costs
the sum of its GPUs' prices per hour whether they are busy or not, so

    usd_per_million_tokens = usd_per_hour / (tokens_per_s * 3600) * 1e6

with the plan's predicted throughput. The defaults below are ASSUMPTIONS - rounded,
indicative on-demand cloud list prices for one GPU of each type as of 2025 - not quotes:
replace them with your own (``mixfleetctl ... --prices FILE``; the file is read by the
controlplane and checked here by :func:`price_table_from_dict`).

Minimum cost (:func:`min_cost`): the cheapest set of whole nodes that reaches a throughput
target. Nodes of identical make-up are interchangeable, so subsets are enumerated as counts
per node group ``k_t in 0..n_t`` and priced ``sum_t k_t * price_t``. In order of price each
subset is screened with a fast policy (``greedy``); a subset containing one that already met
the target is skipped (it only costs more). Screening stops once ``finalists`` subsets meet
the target. The finalists, and the cheaper subsets the screen put within ``slack`` of the
target (the final policy may lift them over it), are solved with the final policy (``ilp``)
cheapest first; the first that meets the target wins. Subsets spanning GPU vendors are
skipped for MoE models unless cross-vendor all-to-all is allowed (:mod:`policies.vendors`).

Units: US dollars (``usd``), hours, tokens per second. Pure: no I/O.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.catalog import CATALOG, closest, lookup
from policies.deployment import (
    Deployment,
    Outcome,
    describe_nodes,
    node_groups,
    sub_fleet,
    try_solve,
)
from policies.errors import InfeasibleError, InputError
from policies.fleet import Fleet
from policies.plan import Plan
from policies.request import PlacementResult
from policies.vendors import vendors_of

#: Default price per GPU-hour, USD. ASSUMPTIONS: rounded, indicative on-demand cloud list
#: prices (2025) for one GPU; override them with a price file for real decisions.
DEFAULT_USD_PER_GPU_HOUR: Mapping[str, float] = {
    "V100-SXM2-32GB": 0.90,
    "V100-SXM2-16GB": 0.70,
    "A100-SXM4-40GB": 1.30,
    "A100-SXM4-80GB": 1.80,
    "H100-PCIe": 2.40,
    "H100-SXM5-80GB": 2.99,
    "H800-SXM5": 2.60,
    "H200-SXM-141GB": 3.80,
    "L40S": 1.00,
    "L4": 0.45,
    "B200": 5.90,
    "MI300X": 2.90,
}


@dataclass(frozen=True)
class PriceTable:
    """Price per GPU-hour by GPU model.

    Attributes:
        usd_per_gpu_hour: catalog (or fleet-file) GPU model -> USD per GPU-hour.
        currency: label of the unit (``USD``); all figures use it.
        source: where the prices came from (``defaults`` or a file path).
    """

    usd_per_gpu_hour: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_USD_PER_GPU_HOUR)
    )
    currency: str = "USD"
    source: str = "defaults (assumed list prices)"

    def price(self, gpu_model: str) -> float:
        """Price of one GPU-hour of ``gpu_model``.

        Raises:
            InputError: no price for that model.
        """
        if gpu_model in self.usd_per_gpu_hour:
            return self.usd_per_gpu_hour[gpu_model]
        raise InputError(
            f"no price for GPU model {gpu_model!r} in the price table ({self.source}). To fix: "
            f"add '{gpu_model}: <{self.currency} per GPU-hour>' under 'prices:' in a price file "
            "and pass it with --prices",
            field="prices",
        )


def price_table_from_dict(
    doc: Any, *, source: str = "file", base: Mapping[str, float] | None = None
) -> PriceTable:
    """Build a price table from a loaded document.

    Accepts ``{"currency": "USD", "prices": {model: usd_per_gpu_hour}}`` or a flat
    ``{model: usd_per_gpu_hour}`` mapping. Names are catalog names or aliases (``H100``,
    ``NVIDIA H200``) or the names of custom GPUs of a fleet file; catalog aliases are
    stored under the catalog name. Entries replace the defaults (``base``); the others
    keep their default price.

    Raises:
        InputError: not a mapping, or a price that is not a finite number >= 0.
    """
    if not isinstance(doc, Mapping):
        raise InputError("a price file must be a mapping of GPU model to price", field="prices")
    currency = str(doc.get("currency", "USD"))
    raw = doc.get("prices", None)
    if raw is None:
        raw = {k: v for k, v in doc.items() if k != "currency"}
    if not isinstance(raw, Mapping):
        raise InputError("'prices' must map GPU models to prices per GPU-hour", field="prices")
    table = dict(DEFAULT_USD_PER_GPU_HOUR if base is None else base)
    for key, value in raw.items():
        name = str(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(
                f"must be a number per GPU-hour, got {value!r}", field=f"prices.{name}"
            )
        v = float(value)
        if math.isnan(v) or math.isinf(v) or v < 0:
            raise InputError(f"must be a finite number >= 0, got {value!r}", field=f"prices.{name}")
        with contextlib.suppress(InputError):  # a custom GPU of a fleet file keeps its name
            name = lookup(name).model
        table[name] = v
    return PriceTable(table, currency, source)


def catalog_price_table(
    usd_per_gpu_hour: Mapping[str, Any],
    *,
    base: Mapping[str, float] | None = None,
    field_path: str = "gpuHourPrices",
    source: str = "gpuHourPrices",
) -> PriceTable:
    """Prices keyed by exact catalog GPU names (what deployment documents and
    PlacementPolicies carry), replacing ``base`` (default: the built-in assumed prices).

    Args:
        usd_per_gpu_hour: catalog GPU model -> USD per GPU-hour.
        base: prices of the models not listed, USD per GPU-hour.
        field_path: field named in errors (``spec.gpuHourPrices``).
        source: where the prices came from, for messages.

    Raises:
        InputError: a name that is not a catalog name (the message lists the closest ones),
            or a price that is not a finite number >= 0; ``field`` is ``<field_path>.<name>``.
    """
    table = dict(DEFAULT_USD_PER_GPU_HOUR if base is None else base)
    for key, value in usd_per_gpu_hour.items():
        name = str(key)
        if name not in CATALOG:
            near = ", ".join(closest(name)) or "none"
            raise InputError(
                f"{name!r} is not a catalog GPU model (closest: {near}). To fix: key the "
                f"prices by catalog names: {', '.join(CATALOG)}",
                field=f"{field_path}.{name}",
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise InputError(
                f"must be a finite number >= 0, USD per GPU-hour; got {value!r}",
                field=f"{field_path}.{name}",
            )
        table[name] = float(value)
    return PriceTable(table, "USD", source)


def fleet_usd_per_hour(fleet: Fleet, prices: PriceTable) -> float:
    """Price of running every GPU of a fleet for one hour.

    Raises:
        InputError: a GPU model without a price.
    """
    return sum(prices.price(g.spec.model) for g in fleet.gpus)


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    """Cost of a million tokens at a throughput; infinite when nothing is produced."""
    if tokens_per_s <= 0:
        return math.inf
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


@dataclass(frozen=True)
class PlanCost:
    """What a plan costs.

    Attributes:
        usd_per_hour: all of the plan's GPUs for one hour.
        tokens_per_s: the plan's predicted throughput.
        usd_per_million_tokens: ``usd_per_hour / (tokens_per_s * 3600) * 1e6``.
        gpus_by_model: GPU count per model.
        currency: unit label.
    """

    usd_per_hour: float
    tokens_per_s: float
    usd_per_million_tokens: float
    gpus_by_model: Mapping[str, int]
    currency: str = "USD"


def plan_cost(plan: Plan, prices: PriceTable) -> PlanCost:
    """Cost per hour and per million tokens of a plan (its GPUs at the table's prices).

    Raises:
        InputError: a GPU model without a price.
    """
    counts: dict[str, int] = {}
    for g in plan.gpus:
        counts[g.model] = counts.get(g.model, 0) + 1
    per_hour = sum(prices.price(m) * c for m, c in counts.items())
    tps = plan.summary.tokens_per_s if plan.summary.feasible else 0.0
    return PlanCost(per_hour, tps, usd_per_million_tokens(per_hour, tps), counts, prices.currency)


# ----------------------------------------------------------------------------- min-cost

LAYOUTS = ("best", "group", "replicas")


def plans_cost(plans: Sequence[Plan], prices: PriceTable) -> PlanCost:
    """Cost of several plans run side by side (independent replicas): prices and
    throughputs add up.

    Raises:
        InputError: a GPU model without a price; no plan.
    """
    if not plans:
        raise InputError("no plan to price", field="plans")
    parts = [plan_cost(p, prices) for p in plans]
    counts: dict[str, int] = {}
    for part in parts:
        for m, c in part.gpus_by_model.items():
            counts[m] = counts.get(m, 0) + c
    per_hour = sum(x.usd_per_hour for x in parts)
    tps = sum(x.tokens_per_s for x in parts)
    return PlanCost(per_hour, tps, usd_per_million_tokens(per_hour, tps), counts, prices.currency)


@dataclass(frozen=True)
class CostCandidate:
    """A subset of whole nodes, priced and screened.

    Attributes:
        counts: nodes taken from each node group (``MinCostResult.groups`` order).
        nodes: the node names.
        gpus: GPU count.
        usd_per_hour: price of the subset.
        screened_tokens_per_s: throughput with the screening policy (0 when no plan fits).
        layout: ``group`` (one expert-parallel deployment over the subset) or ``replicas``
            (an independent copy of the model per node), whichever screened faster.
        final_tokens_per_s: throughput with the final policy; None when not solved with it.
        reason: why the subset has no usable plan; empty when it has one.
    """

    counts: tuple[int, ...]
    nodes: tuple[str, ...]
    gpus: int
    usd_per_hour: float
    screened_tokens_per_s: float
    layout: str = "group"
    final_tokens_per_s: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class MinCostResult:
    """The cheapest subset found and how it was found.

    Attributes:
        target_tokens_per_s: throughput asked for.
        groups: node groups (interchangeable nodes), fleet order.
        best: the chosen subset.
        results: its plans: one (``group`` layout) or one per node (``replicas``).
        cost: the plans' cost together.
        description: the subset in words (``1x (8x H200-SXM-141GB)``).
        screened: every subset screened, in order of price.
        finalists: subsets solved with the final policy, cheapest first.
        notes: remarks (subsets skipped for vendors, screening cut short).
    """

    target_tokens_per_s: float
    groups: tuple[tuple[str, ...], ...]
    best: CostCandidate
    results: tuple[PlacementResult, ...]
    cost: PlanCost
    description: str
    screened: tuple[CostCandidate, ...]
    finalists: tuple[CostCandidate, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Evaluated:
    """Throughput of a subset in one layout."""

    tokens_per_s: float
    results: tuple[PlacementResult, ...]
    layout: str
    reason: str


def _subset(groups: Sequence[tuple[str, ...]], counts: Sequence[int]) -> tuple[str, ...]:
    return tuple(n for g, k in zip(groups, counts, strict=True) for n in g[:k])


class _Evaluator:
    """Solves subsets in either layout, caching per-node replica solves by node group."""

    def __init__(
        self, dep: Deployment, tokens_per_gpu: int, groups: Sequence[tuple[str, ...]], layout: str
    ) -> None:
        self.dep = dep
        self.tokens = tokens_per_gpu
        self.groups = groups
        self.layout = layout
        self.replica_tps: dict[tuple[int, str], Outcome] = {}

    def group(self, names: Sequence[str], policy: str) -> _Evaluated:
        fleet = self.dep.fleet
        part = sub_fleet(fleet, names, name=f"{fleet.name}-subset")
        out = try_solve(self.dep.request(self.tokens, fleet=part, policy=policy))
        if out.ok and out.result is not None:
            return _Evaluated(out.result.plan.summary.tokens_per_s, (out.result,), "group", "")
        return _Evaluated(0.0, (), "group", out.reason)

    def _replica(self, node: str, policy: str) -> Outcome:
        part = sub_fleet(self.dep.fleet, [node], name=f"{self.dep.fleet.name}-{node}")
        return try_solve(self.dep.request(self.tokens, fleet=part, policy=policy))

    def replicas(self, counts: Sequence[int], policy: str, *, plans: bool) -> _Evaluated:
        """One replica per node; with ``plans`` every node is solved (its own GPU ids),
        else one node per group stands for the others."""
        fleet = self.dep.fleet
        if any(
            fleet.node(n).nvlink is not None and self._shared_domain(n)
            for g in self.groups
            for n in g
        ):
            return _Evaluated(0.0, (), "replicas", "a multi-node NVLink domain")
        tps = 0.0
        results: list[PlacementResult] = []
        for gi, (grp, k) in enumerate(zip(self.groups, counts, strict=True)):
            if k == 0:
                continue
            key = (gi, policy)
            if key not in self.replica_tps:
                self.replica_tps[key] = self._replica(grp[0], policy)
            out = self.replica_tps[key]
            if not out.ok or out.result is None:
                return _Evaluated(0.0, (), "replicas", f"{grp[0]} alone: {out.reason}")
            tps += k * out.result.plan.summary.tokens_per_s
            if plans:
                results.append(out.result)
                for node in grp[1:k]:
                    more = self._replica(node, policy)
                    if more.result is None or not more.ok:
                        return _Evaluated(0.0, (), "replicas", f"{node} alone: {more.reason}")
                    results.append(more.result)
        return _Evaluated(tps, tuple(results), "replicas", "")

    def _shared_domain(self, node: str) -> bool:
        fleet = self.dep.fleet
        nv = fleet.node(node).nvlink
        return (
            nv is not None
            and sum(1 for n in fleet.nodes if n.nvlink and n.nvlink.domain == nv.domain) > 1
        )

    def best(
        self, names: Sequence[str], counts: Sequence[int], policy: str, *, plans: bool
    ) -> _Evaluated:
        options: list[_Evaluated] = []
        if self.layout in ("best", "group"):
            options.append(self.group(names, policy))
        if self.layout in ("best", "replicas"):
            options.append(self.replicas(counts, policy, plans=plans))
        ok = [o for o in options if o.tokens_per_s > 0]
        if not ok:
            return _Evaluated(0.0, (), options[0].layout, "; ".join(o.reason for o in options))
        return max(ok, key=lambda o: o.tokens_per_s)


def min_cost(
    dep: Deployment,
    target_tokens_per_s: float,
    prices: PriceTable,
    *,
    tokens_per_gpu: int,
    final_policy: str = "ilp",
    screen_policy: str = "greedy",
    layout: str = "best",
    finalists: int = 3,
    slack: float = 0.15,
    max_screens: int = 200,
    allow_cross_vendor: bool = False,
) -> MinCostResult:
    """The cheapest subset of the fleet's nodes whose plans reach ``target_tokens_per_s``.

    Args:
        dep: the deployment (fleet, model, phase, context...); its ``policy`` is ignored.
        target_tokens_per_s: throughput to reach, tokens/s.
        prices: price table.
        tokens_per_gpu: batch per GPU per step at which throughput is judged.
        final_policy: policy that solves the finalists.
        screen_policy: fast policy that screens every subset.
        layout: ``group`` - the subset is one expert-parallel deployment; ``replicas`` -
            every node runs its own copy of the model (no all-to-all over the network);
            ``best`` - whichever is faster for each subset.
        finalists: stop screening after this many subsets meet the target.
        slack: subsets the screen puts within ``target / (1 + slack)`` also go to the final
            policy (it may lift them over the target).
        max_screens: most subsets screened.
        allow_cross_vendor: let a MoE deployment's all-to-all span GPU vendors (``group``
            layout; replicas never span vendors).

    Raises:
        InputError: non-positive target, bad options, a GPU without a price.
        InfeasibleError: no subset (the whole fleet included) reaches the target; the
            message gives the best throughput found and what to change.
    """
    if not (target_tokens_per_s > 0 and math.isfinite(target_tokens_per_s)):
        raise InputError(f"must be > 0 tokens/s, got {target_tokens_per_s!r}", field="target")
    if finalists < 1 or max_screens < 1 or slack < 0:
        raise InputError("finalists and max_screens must be >= 1 and slack >= 0", field="min_cost")
    if layout not in LAYOUTS:
        raise InputError(f"must be one of {LAYOUTS}, got {layout!r}", field="layout")
    dep = replace(dep, allow_cross_vendor=allow_cross_vendor)
    fleet = dep.fleet
    groups = tuple(node_groups(fleet))
    node_price = [
        sum(prices.price(g.spec.model) for g in fleet.node(grp[0]).gpus) for grp in groups
    ]
    gpus_in = [len(fleet.node(grp[0]).gpus) for grp in groups]
    combos = [c for c in itertools.product(*(range(len(g) + 1) for g in groups)) if any(c)]
    combos.sort(
        key=lambda c: (
            sum(k * p for k, p in zip(c, node_price, strict=True)),
            sum(k * n for k, n in zip(c, gpus_in, strict=True)),
        )
    )
    ev = _Evaluator(dep, tokens_per_gpu, groups, layout)
    screened: list[CostCandidate] = []
    met: list[tuple[int, ...]] = []
    near: list[CostCandidate] = []
    skipped_vendor = 0
    for counts in combos:
        if len(met) >= finalists or len(screened) >= max_screens:
            break
        if any(all(c >= m for c, m in zip(counts, prev, strict=True)) for prev in met):
            continue
        names = _subset(groups, counts)
        part = sub_fleet(fleet, names)
        mixed = dep.model.is_moe and len(vendors_of(part)) > 1
        if mixed and not allow_cross_vendor and layout == "group":
            skipped_vendor += 1
            continue
        if mixed and not allow_cross_vendor:
            got = ev.replicas(counts, screen_policy, plans=False)
        else:
            got = ev.best(names, counts, screen_policy, plans=False)
        cand = CostCandidate(
            counts,
            names,
            len(part.gpus),
            sum(k * p for k, p in zip(counts, node_price, strict=True)),
            got.tokens_per_s,
            got.layout,
            reason=got.reason,
        )
        screened.append(cand)
        if got.tokens_per_s >= target_tokens_per_s:
            met.append(counts)
        elif got.tokens_per_s >= target_tokens_per_s / (1.0 + slack):
            near.append(cand)
    notes: list[str] = []
    if skipped_vendor:
        notes.append(
            f"{skipped_vendor} subset(s) spanning GPU vendors skipped (expert-parallel traffic "
            "stays inside one vendor)"
        )
    if len(screened) >= max_screens and len(met) < finalists:
        notes.append(f"screening stopped after {max_screens} subsets (max_screens)")
    pool = sorted(
        [c for c in screened if c.counts in met] + near, key=lambda c: (c.usd_per_hour, c.gpus)
    )
    solved: list[CostCandidate] = []
    for cand in pool:
        if cand.layout == "replicas":
            final = ev.replicas(cand.counts, final_policy, plans=True)
            screen = ev.replicas(cand.counts, screen_policy, plans=True)
        else:
            final = ev.group(cand.nodes, final_policy)
            screen = ev.group(cand.nodes, screen_policy)
        best = final if final.tokens_per_s >= screen.tokens_per_s else screen
        done = CostCandidate(
            cand.counts,
            cand.nodes,
            cand.gpus,
            cand.usd_per_hour,
            cand.screened_tokens_per_s,
            cand.layout,
            best.tokens_per_s,
            best.reason,
        )
        solved.append(done)
        if best.results and best.tokens_per_s >= target_tokens_per_s:
            return MinCostResult(
                target_tokens_per_s,
                groups,
                done,
                best.results,
                plans_cost([r.plan for r in best.results], prices),
                describe_nodes(fleet, cand.nodes),
                tuple(screened),
                tuple(solved),
                tuple(notes),
            )
    top = max(screened, key=lambda c: c.screened_tokens_per_s, default=None)
    if top is None or top.screened_tokens_per_s <= 0:
        best_seen = "no subset produced a plan"
    else:
        best_seen = (
            f"the best subset screened reaches {top.screened_tokens_per_s:,.0f} tokens/s "
            f"({describe_nodes(fleet, top.nodes)}, {top.layout} layout)"
        )
    raise InfeasibleError(
        f"no subset of {fleet.name} reaches {target_tokens_per_s:,.0f} tokens/s at "
        f"{tokens_per_gpu} tokens per GPU",
        (f"{best_seen}. To fix: lower the target, raise the batch (--tokens), or add GPUs", *notes),
    )
