"""Advice: questions asked beside a plan, answered with the same cost model.

- :mod:`policies.advice.advise` - batch-size and long-context advice for a deployment;
- :mod:`policies.advice.cost` - dollars per GPU-hour in, dollars per million tokens out, and
  the cheapest node subset (:func:`~policies.advice.cost.min_cost`, solving subsets in
  :mod:`policies.advice.subsets`);
- :mod:`policies.advice.tiers` and :mod:`policies.advice.tier_planner` - splitting a fleet's
  nodes between an interactive and a batch tier.

Pure: no I/O.
"""
