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
skipped for MoE models unless cross-vendor all-to-all is allowed (:mod:`policies.hardware.vendors`).
Solving one subset in either layout lives in :mod:`policies.advice.subsets`.

Units: US dollars (``usd``), hours, tokens per second. Pure: no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.advice.subsets import SubsetEvaluator, SubsetThroughput, subset_nodes
from policies.defaults import LAYOUTS as LAYOUTS  # one default: policies.defaults
from policies.deployment import (
    Deployment,
    describe_nodes,
    node_groups,
    sub_fleet,
)
from policies.errors import InfeasibleError, InputError
from policies.hardware.catalog import CATALOG, AmbiguousGpuNameError, closest, lookup
from policies.hardware.fleet import Fleet
from policies.hardware.vendors import vendors_of
from policies.keys import check_keys
from policies.plan import Plan
from policies.request import PlacementResult

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
    ``{model: usd_per_gpu_hour}`` mapping (with ``prices``, no other key than ``currency``).
    Names are catalog names or aliases (``H100-SXM``, ``NVIDIA H200``; an ambiguous short
    name such as ``H100`` is refused) or the names of custom GPUs of a fleet file; catalog aliases are
    stored under the catalog name. Entries replace the defaults (``base``); the others
    keep their default price.

    Raises:
        InputError: not a mapping, or a price that is not a finite number >= 0.
    """
    if not isinstance(doc, Mapping):
        raise InputError("a price file must be a mapping of GPU model to price", field="prices")
    currency = str(doc.get("currency", "USD"))
    raw = doc.get("prices", None)
    if raw is not None:
        check_keys(doc, ("currency", "prices"), "")
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
        try:  # a custom GPU of a fleet file keeps its name; an ambiguous one is refused
            name = lookup(name, field_path=f"prices.{name}").model
        except AmbiguousGpuNameError:
            raise
        except InputError:
            pass
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
    ev = SubsetEvaluator(dep, tokens_per_gpu, groups, layout)
    scr = _screen(
        ev,
        prices,
        target_tokens_per_s,
        screen_policy=screen_policy,
        finalists=finalists,
        slack=slack,
        max_screens=max_screens,
        allow_cross_vendor=allow_cross_vendor,
    )
    notes = scr.notes(max_screens=max_screens, finalists=finalists)
    pool = sorted(
        [c for c in scr.screened if c.counts in scr.met] + scr.near,
        key=lambda c: (c.usd_per_hour, c.gpus),
    )
    solved: list[CostCandidate] = []
    for cand in pool:
        done, best = _solve_finalist(ev, cand, final_policy, screen_policy)
        solved.append(done)
        if best.results and best.tokens_per_s >= target_tokens_per_s:
            return MinCostResult(
                target_tokens_per_s,
                groups,
                done,
                best.results,
                plans_cost([r.plan for r in best.results], prices),
                describe_nodes(fleet, cand.nodes),
                tuple(scr.screened),
                tuple(solved),
                tuple(notes),
            )
    raise _no_subset_error(fleet, scr.screened, target_tokens_per_s, tokens_per_gpu, notes)


@dataclass
class _Screening:
    """What screening the subsets found.

    Attributes:
        screened: every subset screened, cheapest first.
        met: node counts of the subsets that reached the target.
        near: subsets within ``target / (1 + slack)`` of the target.
        skipped_vendor: subsets skipped because they span GPU vendors.
    """

    screened: list[CostCandidate] = field(default_factory=list)
    met: list[tuple[int, ...]] = field(default_factory=list)
    near: list[CostCandidate] = field(default_factory=list)
    skipped_vendor: int = 0

    def notes(self, *, max_screens: int, finalists: int) -> list[str]:
        """Remarks on what screening left out."""
        notes: list[str] = []
        if self.skipped_vendor:
            notes.append(
                f"{self.skipped_vendor} subset(s) spanning GPU vendors skipped (expert-parallel "
                "traffic stays inside one vendor)"
            )
        if len(self.screened) >= max_screens and len(self.met) < finalists:
            notes.append(f"screening stopped after {max_screens} subsets (max_screens)")
        return notes


def _screen(
    ev: SubsetEvaluator,
    prices: PriceTable,
    target_tokens_per_s: float,
    *,
    screen_policy: str,
    finalists: int,
    slack: float,
    max_screens: int,
    allow_cross_vendor: bool,
) -> _Screening:
    """Screen node subsets cheapest first (then fewest GPUs) with ``screen_policy``, skipping
    supersets of a subset that already met the target (see :func:`min_cost`)."""
    dep, groups, layout = ev.dep, ev.groups, ev.layout
    fleet = dep.fleet
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
    out = _Screening()
    for counts in combos:
        if len(out.met) >= finalists or len(out.screened) >= max_screens:
            break
        if any(all(c >= m for c, m in zip(counts, prev, strict=True)) for prev in out.met):
            continue
        names = subset_nodes(groups, counts)
        part = sub_fleet(fleet, names)
        mixed = dep.model.is_moe and len(vendors_of(part)) > 1
        if mixed and not allow_cross_vendor and layout == "group":
            out.skipped_vendor += 1
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
        out.screened.append(cand)
        if got.tokens_per_s >= target_tokens_per_s:
            out.met.append(counts)
        elif got.tokens_per_s >= target_tokens_per_s / (1.0 + slack):
            out.near.append(cand)
    return out


def _solve_finalist(
    ev: SubsetEvaluator, cand: CostCandidate, final_policy: str, screen_policy: str
) -> tuple[CostCandidate, SubsetThroughput]:
    """Solve a screened subset in its layout with both policies; the faster one wins.

    Returns:
        The candidate with its final throughput and reason, and the winning evaluation.
    """
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
    return done, best


def _no_subset_error(
    fleet: Fleet,
    screened: Sequence[CostCandidate],
    target_tokens_per_s: float,
    tokens_per_gpu: int,
    notes: Sequence[str],
) -> InfeasibleError:
    """The error :func:`min_cost` raises when no subset reaches the target."""
    top = max(screened, key=lambda c: c.screened_tokens_per_s, default=None)
    if top is None or top.screened_tokens_per_s <= 0:
        best_seen = "no subset produced a plan"
    else:
        best_seen = (
            f"the best subset screened reaches {top.screened_tokens_per_s:,.0f} tokens/s "
            f"({describe_nodes(fleet, top.nodes)}, {top.layout} layout)"
        )
    return InfeasibleError(
        f"no subset of {fleet.name} reaches {target_tokens_per_s:,.0f} tokens/s at "
        f"{tokens_per_gpu} tokens per GPU",
        (f"{best_seen}. To fix: lower the target, raise the batch (--tokens), or add GPUs", *notes),
    )
