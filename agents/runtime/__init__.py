"""Reference runtime: executes a plan's native form for one MoE transformer layer.

One process per GPU (``torch.distributed``; NCCL on GPUs, gloo on CPUs). Each rank computes
attention (plus the shared expert and the router) for its share of the step's tokens, sends
every token-expert pair to the GPU holding the chosen replica (``all_to_all_single``), runs
the expert FFNs it holds under the plan (any number of experts per GPU, any token share per
replica) and sends the results back (combine). The same code runs on CPU with small
dimensions, where tests compare it with a single-device reference.

Modules: :mod:`agents.runtime.fast` (the fast runtime: CUDA graphs, grouped expert GEMMs,
FP8 experts, the engines' replica choice; its expert phase in :mod:`agents.runtime.experts`
and the rooflines of its phases in :mod:`agents.runtime.roofline`),
:mod:`agents.runtime.layer` (the plan executor: the layer, its weights and the reference),
:mod:`agents.runtime.routing` (rank placement from a plan, replica choice per pair, the FP8
dispatch wire), :mod:`agents.runtime.launch` (process group start-up),
:mod:`agents.runtime.slowdown` (making one GPU slower by occupying some of its SMs),
:mod:`agents.runtime.bench` (the fidelity and heterogeneity measurements of
docs/validation.md; its inputs in :mod:`agents.runtime.bench_config`, its results file in
:mod:`agents.runtime.bench_results`).

torch is an optional dependency (``pip install mixfleet[gpu]``); importing this package
does not import it.
"""
