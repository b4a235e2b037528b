"""Estimate: the one cost model every policy, planner and simulator scores with.

- :mod:`policies.estimate.costmodel` - per-GPU time and memory coefficients
  (:func:`~policies.estimate.costmodel.build_cost_table`), with its settings in
  :mod:`policies.estimate.costsettings` and its measured reference figures in
  :mod:`policies.estimate.reference`;
- :mod:`policies.estimate.workload` - phase, batch shape and per-layer expert load;
- :mod:`policies.estimate.evaluation` - a placement's predicted phase times, memory and
  violations;
- :mod:`policies.estimate.forwarding` - the token exchange of DeepEP's normal kernels (a token
  once per GPU and per node, forwarded over NVLink), which prefill runs;
- :mod:`policies.estimate.engines` - what SGLang, vLLM and TensorRT-LLM do with a plan, with
  the replica choice in :mod:`policies.estimate.replica_choice`;
  :mod:`policies.estimate.execution` - a placement as its engine runs it, scored;
- :mod:`policies.estimate.tensor_parallel` - tensor-parallel attention inside a node.

Pure: no I/O.
"""
