"""The router's choice of a DP rank: pure, no I/O, no clock.

A plan gives each DP attention rank a weight ``w_r`` (``Routing.dp_weights``): the share of
the step's tokens the rank's attention is sized for. A request of ``work`` tokens (prompt
plus expected output) goes, among the eligible ranks that are not backed up, to the one
with the smallest pass value after taking it (stride scheduling)::

    backed up:  open_r / w_r  >  min_j (open_j / w_j)  +  slack * work / w_r
    choose:     argmin_r (routed_r + work) / w_r       ties: open_r / w_r, then rank order

``open_r`` is the rank's outstanding tokens, ``routed_r`` the tokens routed to it since its
tier's weights last changed. The stride rule gives every rank its weighted share of the
work at any concurrency, idle or loaded (in an expert-parallel engine all ranks step
together, so the plan's shares are shares of work). The backed-up rule is the load
feedback: a rank that serves slower than planned holds its work longer, falls more than
``slack`` requests behind the least loaded rank (per unit weight) and is skipped until it
drains, so it receives less. Eligible: weight > 0, its instance healthy, not excluded
(already tried) and not at its batch limit (``full``), fewer than ``queue_limit`` requests
open. The weights of one instance's
ranks are scaled to the instance's share of its tier (:func:`effective_weights`).
"""

from __future__ import annotations

from collections.abc import Collection, Container, Sequence
from dataclasses import dataclass


@dataclass
class RankState:
    """One DP rank of one engine instance, as the router tracks it.

    Attributes:
        instance: engine instance name.
        rank: the engine's DP attention rank (the value pinned in the request).
        tier: tier the instance serves.
        weight: effective weight within the tier (see :func:`effective_weights`), >= 0.
        planned_weight: the plan's ``dp_weight`` of the rank (mean 1 over the instance).
        outstanding_tokens: estimated tokens of the requests open on it.
        open_requests: requests open on it (its queue depth as the router sees it).
        routed_tokens: tokens routed to it since its tier's weights last changed.
        routed_requests: requests routed to it since then.
    """

    instance: str
    rank: int
    tier: str
    weight: float
    planned_weight: float = 1.0
    outstanding_tokens: float = 0.0
    open_requests: int = 0
    routed_tokens: float = 0.0
    routed_requests: int = 0

    def acquire(self, work: float) -> None:
        """Count a request of ``work`` tokens as open and routed here."""
        self.outstanding_tokens += work
        self.open_requests += 1
        self.routed_tokens += work
        self.routed_requests += 1

    def release(self, work: float) -> None:
        """The request of ``work`` tokens has ended (done, failed or cancelled)."""
        self.outstanding_tokens = max(0.0, self.outstanding_tokens - work)
        self.open_requests = max(0, self.open_requests - 1)


@dataclass(frozen=True)
class Choice:
    """The outcome of :func:`choose`.

    Attributes:
        rank: the chosen rank; None when none is eligible.
        reason: "" when a rank was chosen; ``batch_full`` when some otherwise eligible rank's
            instance is at its batch limit (a slot may free up: the request may wait);
            else ``overloaded`` when every otherwise eligible rank is at its queue limit;
            ``no_rank`` when no rank is healthy with weight > 0.
    """

    rank: RankState | None
    reason: str = ""


def choose(
    ranks: Sequence[RankState],
    work: float,
    *,
    queue_limit: int,
    healthy: Container[str],
    exclude: Container[str] = (),
    full: Collection[str] = (),
    slack: float = 2.0,
) -> Choice:
    """Pick the rank for a request of ``work`` tokens (rules in the module docstring).

    Args:
        ranks: the tier's ranks (all instances).
        work: estimated tokens of the request (prompt plus expected output), >= 0.
        queue_limit: most requests open per rank.
        healthy: names of the instances that pass their health checks.
        exclude: instances not to use (tried already for this request).
        full: instances at their batch limit (skipped; see :attr:`Choice.reason`).
        slack: how many requests of this size a rank may be behind the least loaded one
            (per unit weight) before it counts as backed up.
    """
    candidates: list[RankState] = []
    queued = batched = False
    capped = bool(full)  # usually no instance is full: no lookup per rank then
    for r in ranks:
        if r.weight <= 0 or r.instance not in healthy or r.instance in exclude:
            continue
        if capped and r.instance in full:
            batched = True
            continue
        if r.open_requests >= queue_limit:
            queued = True
            continue
        candidates.append(r)
    if not candidates:
        return Choice(None, "batch_full" if batched else "overloaded" if queued else "no_rank")
    unit = max(work, 1.0)
    floor = min(r.outstanding_tokens / r.weight for r in candidates)
    best: RankState | None = None
    best_key = (0.0, 0.0)
    for r in candidates:
        load = r.outstanding_tokens / r.weight
        if load > floor + slack * unit / r.weight:
            continue  # backed up: serving slower than its share
        key = ((r.routed_tokens + unit) / r.weight, load)
        if best is None or key < best_key:
            best, best_key = r, key
    return Choice(best)


def effective_weights(planned: Sequence[float], instance_share: float) -> list[float]:
    """Per-rank weights of one instance scaled so they sum to ``instance_share``.

    Args:
        planned: the plan's weight of each DP rank (any positive scale; negative or NaN
            values count as 0).
        instance_share: the instance's share of its tier's traffic (any positive scale:
            the default is its number of DP ranks, so homogeneous instances of one tier get
            equal per-rank weights).
    """
    clean = [w if w > 0 else 0.0 for w in planned]  # NaN > 0 is False
    total = sum(clean)
    if total <= 0:
        return [0.0 for _ in clean]
    return [instance_share * w / total for w in clean]


def shares(ranks: Sequence[RankState]) -> tuple[list[float], list[float]]:
    """(planned, achieved) share of each rank within ``ranks``: planned from the weights,
    achieved from the tokens routed since the weights last changed (0 when none)."""
    wsum = sum(r.weight for r in ranks)
    tsum = sum(r.routed_tokens for r in ranks)
    planned = [r.weight / wsum if wsum > 0 else 0.0 for r in ranks]
    achieved = [r.routed_tokens / tsum if tsum > 0 else 0.0 for r in ranks]
    return planned, achieved
