"""Which dropped engine instance drains first on a full fleet, and what its loss costs
(policies.fleetplan.instances.first_to_drain, capacity_lost): the one rule the standalone
controller and the Kubernetes operator both call."""

from __future__ import annotations

import itertools
import random

import pytest

from policies.fleetplan.instances import ServingInstance, capacity_lost, first_to_drain


def test_an_aggregated_instance_loses_its_own_capacity_a_pd_one_its_pools_share() -> None:
    insts = {
        "agg": ServingInstance("aggregated", "a", 7.0),
        "p0": ServingInstance("prefill", "pd", 10.0),
        "p1": ServingInstance("prefill", "pd", 10.0),
        "d0": ServingInstance("decode", "pd", 12.0),
    }
    serving = set(insts)
    assert capacity_lost("agg", insts, serving) == 7.0
    # The pool serves min(20, 12) = 12; without p0 min(10, 12) = 10; without d0 nothing.
    assert capacity_lost("p0", insts, serving) == 2.0
    assert capacity_lost("d0", insts, serving) == 12.0
    assert capacity_lost("d0", insts, serving - {"d0"}) == 0.0  # not serving: no loss
    # p1 not serving: p0 is then the pool's only prefill.
    assert capacity_lost("p0", insts, serving - {"p1"}) == 10.0


def test_the_cheapest_blocker_drains_only_when_everything_waits_and_one_at_a_time() -> None:
    lost = {"old-a": 5.0, "old-b": 1.0, "old-c": 1.0}
    waits = {"new-0": {"old-a"}, "new-1": {"old-b", "old-c"}}
    assert first_to_drain(waits, (), lost) == "old-b"  # least loss, then by name
    assert first_to_drain({**waits, "new-2": set()}, (), lost) == ""  # new-2 can come up
    assert first_to_drain(waits, {"old-a"}, lost) == ""  # a drain is under way
    assert first_to_drain(waits, (), lost, exclude={"old-b"}) == "old-c"
    assert first_to_drain(waits, (), lost, exclude=set(lost)) == ""
    assert first_to_drain({}, (), lost) == ""


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_is_the_least_loss_among_the_blockers_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    olds = [f"old-{i}" for i in range(rng.randint(1, 5))]
    lost = {o: float(rng.randint(0, 3)) for o in olds}
    waits = {f"new-{i}": set(rng.sample(olds, rng.randint(1, len(olds)))) for i in range(3)}
    held = set(itertools.chain.from_iterable(waits.values()))
    best = min(held, key=lambda o: (lost[o], o))
    assert first_to_drain(waits, (), lost) == best
    assert all(lost[best] <= lost[o] for o in held)
