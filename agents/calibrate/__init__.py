"""``mixfleet-agent calibrate``: measure what each GPU of this node really achieves.

Per GPU (one process per GPU, all GPUs at once, so each is measured as it runs in service):

* GEMM throughput at expert-FFN shapes (``[m, hidden] x [hidden, 2 ffn]`` then
  ``[m, ffn] x [ffn, hidden]``) for token counts m = 1..8192, in BF16 and in FP8
  (``torch._scaled_mm``, per-tensor scales; m padded to a multiple of 16);
* the grouped expert GEMM the reference runtime runs (``torch._grouped_mm`` over the
  experts of one GPU) for 1..512 rows per expert: small batches show the weight-streaming
  bandwidth, large ones the grouped compute rate;
* device-memory bandwidth (a device-to-device copy, bytes read plus written);
* attention through PyTorch SDPA's flash backend at a prefill shape (causal) and a decode
  shape (one query per sequence over a KV cache), and through ``flash_attn`` when installed;
* between the node's GPUs, NCCL ``all_to_all_single`` time for 1..16384 tokens per rank and
  the runtime's dispatch + combine round trip for one token (its fixed latency).

* the fast runtime's own kernels (:mod:`agents.calibrate.runtime_figures`): attention and
  expert rates, dense-weight streaming, per-token and per-pair times of its other kernels,
  and the idle time between kernels in a CUDA-graph replay.

Everything is measured ``repeats`` times (default 3); a figure the runs disagree on by more
than 5% is dropped with the reason (:func:`stable_figures`). The result is a JSON document:
per GPU the :class:`policies.estimate.costmodel.MeasuredFigures` (``measured``), what was dropped,
every run's figures and raw curves, and how long calibration took. :func:`apply_calibration`
puts the figures into a :class:`NodeInventory`; :func:`planning_inputs` builds the fleet and
cost settings a solve needs from such an inventory.

torch is optional (``pip install 'mixfleet[gpu]'``): it is imported only when calibration
runs, and a clear error says how to install it when missing.

Units: microseconds (``_us``), TFLOPS, GB/s (1e9 B/s), bytes.

Modules: :mod:`agents.calibrate.options` (shapes and effort),
:mod:`agents.calibrate.measure` (the measurements of one GPU, needs torch),
:mod:`agents.calibrate.runtime_figures` (the fast runtime's kernels, needs torch),
:mod:`agents.calibrate.fit` (curves -> figures -> planning inputs, pure) and
:mod:`agents.calibrate.node` (one process per GPU, the sub-command).
"""

from agents.calibrate.fit import (
    NOISE_TOLERANCE,
    STABILITY_TOLERANCE,
    apply_calibration,
    figures_from_curves,
    planning_inputs,
    pool_within_noise,
    runtime_overheads,
    stable_figures,
)
from agents.calibrate.measure import (
    attention_figures,
    calibrate_gpu,
    gemm_curves,
    grouped_expert_curve,
    hbm_copy,
    nccl_figures,
    runtime_profile,
    time_us,
)
from agents.calibrate.node import (
    add_arguments,
    calibrate_node,
    main,
    measure_rank,
    options_from_args,
    software_versions,
)
from agents.calibrate.options import (
    DEFAULT_A2A_TOKENS,
    DEFAULT_ROWS_PER_EXPERT,
    DEFAULT_TOKEN_COUNTS,
    CalibrationOptions,
    profile_model,
)

__all__ = [
    "DEFAULT_A2A_TOKENS",
    "DEFAULT_ROWS_PER_EXPERT",
    "DEFAULT_TOKEN_COUNTS",
    "NOISE_TOLERANCE",
    "STABILITY_TOLERANCE",
    "CalibrationOptions",
    "add_arguments",
    "apply_calibration",
    "attention_figures",
    "calibrate_gpu",
    "calibrate_node",
    "figures_from_curves",
    "gemm_curves",
    "grouped_expert_curve",
    "hbm_copy",
    "main",
    "measure_rank",
    "nccl_figures",
    "options_from_args",
    "planning_inputs",
    "pool_within_noise",
    "profile_model",
    "runtime_overheads",
    "runtime_profile",
    "software_versions",
    "stable_figures",
    "time_us",
]
