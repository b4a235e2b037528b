"""Small step curves and plans whose timelines can be worked out by hand."""

from __future__ import annotations

from policies.serving.curves import StepCurve
from policies.serving.plan import InstanceGroup, KvPath, Pool, ServingPlan


def flat_curve(
    decode_us: float = 1000.0,
    prefill_us: float = 5000.0,
    *,
    max_batch: int = 64,
    kv_bytes_per_token: float = 1e5,
    kv_capacity_tokens: int = 0,
) -> StepCurve:
    """A decode step of ``decode_us`` and a prefill forward of ``prefill_us`` whatever the
    batch, context or prompt (one-point grids)."""
    return StepCurve(
        batch_grid=(1,),
        context_grid=(1_000_000,),
        decode_step_us=((decode_us,),),
        prefill_grid=(1,),
        prefill_us=(prefill_us,),
        max_batch=max_batch,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_capacity_tokens=kv_capacity_tokens,
    )


def linear_curve(*, max_batch: int = 256) -> StepCurve:
    """Step times linear in batch, context and prompt: decode ``10000 + 50 b + 0.001 b c``
    us, prefill ``2000 + 10 t`` us (exact under linear interpolation and extrapolation)."""
    batches = (1, 64, 256)
    contexts = (1, 8192)
    return StepCurve(
        batch_grid=batches,
        context_grid=contexts,
        decode_step_us=tuple(
            tuple(10_000.0 + 50.0 * b + 0.001 * b * c for c in contexts) for b in batches
        ),
        prefill_grid=(1, 16384),
        prefill_us=(2000.0 + 10.0, 2000.0 + 10.0 * 16384),
        max_batch=max_batch,
        kv_bytes_per_token=70_000.0,
    )


def aggregated(
    curve: StepCurve, *, count: int = 1, chunk: int = 8192, batch_limit: int = 0, usd: float = 0.0
) -> ServingPlan:
    """One pool of ``count`` aggregated instances."""
    group = InstanceGroup(
        count=count, curve=curve, batch_limit=batch_limit, chunk_tokens=chunk, usd_per_hour=usd
    )
    return ServingPlan(pools=(Pool(name="agg", share=1.0, instances=group),))


def disaggregated(
    prefill: StepCurve,
    decode: StepCurve,
    *,
    gbytes_per_s: float = 50.0,
    latency_us: float = 0.0,
    chunk: int = 8192,
) -> ServingPlan:
    """One prefill/decode pool of one instance each."""
    return ServingPlan(
        pools=(
            Pool(
                name="pd",
                share=1.0,
                prefill=InstanceGroup(count=1, curve=prefill, chunk_tokens=chunk),
                decode=InstanceGroup(count=1, curve=decode),
                kv_path=KvPath(gbytes_per_s=gbytes_per_s, latency_us=latency_us),
            ),
        )
    )
