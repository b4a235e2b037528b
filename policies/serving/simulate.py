"""The serving simulator: requests through a :class:`~policies.serving.plan.ServingPlan`,
event by event, to check what the planner predicts.

:func:`simulate` is a discrete-event simulation (a heap of events in simulated
microseconds, one seeded :class:`random.Random`, deterministic for a seed) of
``options.requests`` requests of a :class:`~policies.serving.traffic.Traffic`:

- **Arrivals** follow the traffic (Poisson, or gamma gaps for bursty traffic); prompt and
  output lengths are drawn from its distributions, in that order per request, from the
  same generator as the gaps.
- **Router**: pools are picked by smooth weighted round robin over their shares (nginx's
  algorithm: deterministic, every window of ``sum(shares)`` requests in proportion); inside
  a pool a request goes to the least loaded instance (aggregated and decode: fewest requests
  waiting or running; prefill: fewest prompt tokens waiting or in the forward; ties: the
  lowest index). An instance serves its own queue first come, first served.
- **Aggregated instance** (continuous batching with chunked prefill): at the start of each
  step it admits waiting requests while it runs fewer than ``batch_limit`` sequences and
  their reserved KV (prompt + full output, tokens) fits in the curve's KV capacity (a
  request larger than the capacity runs alone). A step decodes one token for every
  sequence past its prefill and prefills up to ``chunk_tokens`` prompt tokens of the
  admitted sequences in admission order; it lasts
  :meth:`~policies.serving.curves.StepCurve.mixed_step_us`. A sequence whose last prompt
  chunk ran gets its first token at the end of that step; each later step gives one more.
- **Prefill/decode pool**: a prefill instance runs a forward over waiting prompts, first
  come first served, up to ``chunk_tokens`` prompt tokens (at least one prompt; batched
  prompts cost the forward of their summed tokens); at its end the first token exists and
  every prompt's KV (``input tokens x kv_bytes_per_token`` of the prefill curve) moves over
  the pool's KV path: the transfers out of one prefill instance hold its bandwidth one
  after the other, first come first served (``bytes / bandwidth`` each), and each arrives
  ``latency_us`` after its last byte left. When it has arrived, the least loaded decode instance queues the request
  and admits it at its next step start as above; the first token reaches the client then
  (SGLang and Dynamo stream the whole output from the decode instance), so **TTFT** runs
  from arrival to that admission and includes the prefill queue, the forward, the transfer
  and the wait for a decode slot.
- **TTFT** (aggregated): arrival to the end of the step that ran the last prompt chunk.
  **TPOT**: ``(finish - first token) / (output tokens - 1)`` (requests of one output token
  have none and are left out of its percentiles, and meet any TPOT target).

Statistics cover the requests after the first ``warmup_requests``; the measured window
runs from the last warm-up arrival (0 without warm-up) to the last arrival (or to the time
limit), so the offered rate is measured requests over that window, goodput is those within
both SLOs over it, and throughput is the output tokens the instances produced inside it (a
short run is not diluted by the drain after the last arrival).

This module is the front door: the engine is :mod:`policies.serving.sim_engine`, the options
and the report (with its JSON document) are :mod:`policies.serving.sim_types`, re-exported
here.

Pure: no I/O.
"""

from __future__ import annotations

from policies.serving.plan import ServingPlan, check_plan
from policies.serving.sim_engine import Simulation
from policies.serving.sim_types import MAX_SIM_REQUESTS as MAX_SIM_REQUESTS
from policies.serving.sim_types import GroupReport as GroupReport
from policies.serving.sim_types import Percentiles as Percentiles
from policies.serving.sim_types import PoolReport as PoolReport
from policies.serving.sim_types import RequestRecord as RequestRecord
from policies.serving.sim_types import SimOptions as SimOptions
from policies.serving.sim_types import SimReport as SimReport
from policies.serving.sim_types import check_options as check_options
from policies.serving.sim_types import percentiles as percentiles
from policies.serving.sim_types import quantile_sorted as quantile_sorted
from policies.serving.sim_types import report_to_doc as report_to_doc
from policies.serving.traffic import Slo, Traffic, check_slo, check_traffic

#: The options :func:`simulate` runs with when given none (frozen: shared safely).
_DEFAULT_OPTIONS = SimOptions()


def simulate(
    plan: ServingPlan, traffic: Traffic, slo: Slo | None, options: SimOptions = _DEFAULT_OPTIONS
) -> SimReport:
    """Simulate ``options.requests`` requests of ``traffic`` through ``plan`` (the module
    docstring gives the semantics); deterministic for ``options.seed``. Without an SLO
    (None) every finished request counts as within it, and ``slo_met`` means all finished.

    Raises:
        InputError: an invalid plan, traffic, SLO or option (the field is named).
    """
    check_plan(plan)
    check_traffic(traffic, "traffic")
    if slo is not None:
        check_slo(slo, "slo")
    check_options(options)
    sim = Simulation(plan, traffic, slo, options)
    sim.run()
    return sim.report()
