"""The planning core: pure functions from a fleet, a model and a deployment to a plan.

The front door, at the top level:

- :mod:`policies.request` - what every policy is asked (:class:`PlacementRequest`) and answers;
- :mod:`policies.solve` - :func:`~policies.solve.solve`, a request to a :class:`Plan`;
- :mod:`policies.plan` (types in :mod:`policies.plan_types`, documents in
  :mod:`policies.plan_doc`) - the partition plan, its validator and wire form;
- :mod:`policies.assignment` - the views of a plan handed to nodes and engines;
- :mod:`policies.deployment` - a deployment to size: everything but the batch;
- :mod:`policies.grouping` - one expert-parallel group per fabric segment, or one across;
- :mod:`policies.errors`, :mod:`policies.defaults`, :mod:`policies.keys`,
  :mod:`policies.limits` - errors, defaults and the input checks every reader shares.

Grouped beside it:

- :mod:`policies.hardware` - the fleet: GPU catalog, nodes, inventory, topology;
- :mod:`policies.model` - the model: architectures, presets, ``config.json``, Model files;
- :mod:`policies.estimate` - the one cost model: per-GPU coefficients, workload, scoring,
  what each engine does with a plan;
- :mod:`policies.solvers` - the placement solvers (ILP, greedy, EPLB, locality search);
- :mod:`policies.spec` - the deployment spec a user writes, and how it becomes a request;
- :mod:`policies.fleetplan` - fleet plans: instances and prefill/decode pools that serve
  every deployment's demand within its SLOs;
- :mod:`policies.scheduling` - the fleet scheduler for deployments that state no demand;
- :mod:`policies.serving` - traffic, SLOs and the serving simulator;
- :mod:`policies.launch` - engine launch recipes for a plan's instances;
- :mod:`policies.exports` - the files engines load;
- :mod:`policies.advice` - batch advice, dollars, cheapest subsets, tier splits.

Pure: no I/O (import-linter contract in pyproject.toml).
"""
