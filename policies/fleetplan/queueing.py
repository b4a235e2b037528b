"""How much traffic an instance of ``c`` sequence slots takes before the wait for a slot
breaks the TTFT target: the queueing bound the fleet planner sizes capacity with
(:mod:`policies.fleetplan.sizing`).

An aggregated or decode instance at its batch limit is a queue with ``c`` servers (its
slots): a request holds a slot for ``S`` seconds (its output tokens at the step time of the
full batch) and waits for one when all are taken. With Poisson arrivals at ``lam`` requests
per second, the offered load is ``a = lam S`` and the chance an arrival waits is Erlang C,
``C(c, a)``; a waiting request waits longer than ``x`` seconds with probability::

    P(W > x) = C_z(c, a) exp(-(c / S - lam) x k),   k = 2 / (ca^2 + cv^2)

(the M/M/c tail, its rate scaled by the Allen-Cunneen factor ``k`` for a service time of
squared coefficient of variation ``cv^2`` - output lengths vary less than an exponential -
and gaps between arrivals of squared coefficient of variation ``ca^2``: 1 for Poisson
arrivals, the burst CV squared for bursty ones, whose waits are that much longer).
``C_z`` is the chance of waiting for arrivals of peakedness ``z`` (:func:`delay_chance`):
Erlang C for Poisson arrivals (``z = 1``); bursty ones fill the slots in clusters, so they
wait more often at the same utilisation, as ``c / z`` slots would (Hayward's approximation,
``z = 1 + (ca^2 - 1) / (1 + cv^2)``, the heavy-traffic peakedness of renewal arrivals
against the hold time). Without it the bound rated a 24-slot instance at burst CV 2 34%
above the simulator's steady state (93% at CV 3); with it +3.7% (-1.8%).
:func:`slo_rate` is the largest ``lam`` with ``P(W > x) <= miss``: ``x`` is what the TTFT
target leaves after the queueing-free TTFT, ``miss`` the share of requests the SLO's
percentile lets miss. Few slots queue sooner at the same utilisation than many (at 32
slots this holds about 0.82 of the rate at the batch limit, at 2,900 about 0.99), which a
flat utilisation does not see. Against the serving simulator run to steady state
(``bench/goodput_headroom.py``): within 3% for 155-2,905 slots, the bound slightly high
for 4,096-token prompts (the prefill chunks of the arrivals lengthen the steps).

Units: requests per second, seconds. Pure: no I/O.
"""

from __future__ import annotations

import math

__all__ = ["EXACT_UP_TO", "delay_chance", "erlang_c", "peakedness", "slo_rate", "wait_tail"]


EXACT_UP_TO = 64
"""Slots up to which :func:`erlang_c` is exact; above, the Halfin-Whitt limit (O(1): the
planner sizes hundreds of variants; from 64 slots the :func:`slo_rate` it gives is within
0.3% of the exact one, the wait probability itself within a few percent near full load)."""


def erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits in an M/M/c queue: ``servers`` slots, ``offered`` load
    (arrival rate x mean hold time, in slots; below ``servers``). Up to
    :data:`EXACT_UP_TO` slots, Erlang B over the Poisson distribution of mean ``offered``
    (its term at ``servers`` over its sum up to ``servers``), summed down from ``servers``
    until the terms vanish (O(servers - offered + sqrt(offered)) steps, stable); above,
    ``1 / (1 + beta Phi(beta) / phi(beta))`` with ``beta = (1 - rho) sqrt(servers)``
    (Halfin and Whitt's heavy-traffic limit, O(1))."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if offered <= 0.0:
        return 0.0
    if offered >= servers:
        return 1.0
    if servers > EXACT_UP_TO:
        beta = (1.0 - offered / servers) * math.sqrt(servers)
        cdf = 0.5 * (1.0 + math.erf(beta / math.sqrt(2.0)))
        pdf = math.exp(-beta * beta / 2.0) / math.sqrt(2.0 * math.pi)
        return 1.0 / (1.0 + beta * cdf / pdf) if pdf > 0.0 else 0.0
    # Poisson terms relative to the one at ``servers``: p(k-1) = p(k) k / offered.
    total, term, k = 1.0, 1.0, servers
    while k > 0:
        term *= k / offered
        total += term
        k -= 1
        if k < offered and term < 1e-16 * total:
            break
    b = 1.0 / total  # Erlang B
    rho = offered / servers
    return b / (1.0 - rho + rho * b)


def peakedness(arrival_cv2: float, cv2: float) -> float:
    """Heavy-traffic peakedness of renewal arrivals whose gaps have squared coefficient of
    variation ``arrival_cv2`` against hold times of ``cv2``: ``1 + (ca^2 - 1) eta`` with
    ``eta = mu * integral of P(S > t)^2 dt``, 1/2 for exponential hold times and 1 for fixed
    ones, taken as ``1 / (1 + cv2)`` between them. 1 for Poisson arrivals."""
    return 1.0 + (max(0.0, arrival_cv2) - 1.0) / (1.0 + max(0.0, cv2))


def delay_chance(servers: int, offered: float, z: float = 1.0) -> float:
    """The chance an arrival waits for one of ``servers`` slots at ``offered`` load (slots)
    for arrivals of peakedness ``z`` (:func:`peakedness`): Erlang C of ``servers / z``
    slots at the same utilisation (Hayward), at least one slot, linear between the whole
    numbers around it. :func:`erlang_c` itself at ``z = 1``."""
    if z == 1.0 or offered <= 0.0:
        return erlang_c(servers, offered)
    rho = offered / servers
    if rho >= 1.0:
        return 1.0
    equivalent = max(1.0, servers / max(z, 1e-9))
    low = int(equivalent)
    frac = equivalent - low
    chance = erlang_c(low, rho * low)
    if frac > 0.0:
        chance += frac * (erlang_c(low + 1, rho * (low + 1)) - chance)
    return chance


def wait_tail(
    servers: int, hold_s: float, rate: float, wait_s: float, cv2: float, arrival_cv2: float = 1.0
) -> float:
    """``P(W > wait_s)`` at ``rate`` requests/s for ``servers`` slots held ``hold_s`` s on
    average (service-time variation ``cv2``, arrival-gap variation ``arrival_cv2``): the
    module docstring's formula."""
    if rate <= 0.0:
        return 0.0
    slack = servers / hold_s - rate
    if slack <= 0.0:
        return 1.0
    k = 2.0 / max(1e-9, max(0.0, arrival_cv2) + max(0.0, cv2))
    z = peakedness(arrival_cv2, cv2)
    return delay_chance(servers, rate * hold_s, z) * math.exp(-slack * max(0.0, wait_s) * k)


def slo_rate(
    servers: int, hold_s: float, wait_s: float, miss: float, cv2: float, arrival_cv2: float = 1.0
) -> float:
    """The largest arrival rate, requests/s, at which at most ``miss`` of the requests wait
    longer than ``wait_s`` s for one of ``servers`` slots held ``hold_s`` s on average
    (bisection to 2e-5 of the rate at which every slot is busy, ``servers / hold_s``;
    ``cv2`` and ``arrival_cv2`` as in :func:`wait_tail`)."""
    full = servers / hold_s
    if miss >= 1.0:
        return full
    lo, hi = 0.0, full
    for _ in range(16):
        mid = (lo + hi) / 2.0
        if wait_tail(servers, hold_s, mid, wait_s, cv2, arrival_cv2) <= miss:
            lo = mid
        else:
            hi = mid
    return lo
