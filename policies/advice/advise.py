"""Batch-size and long-context advice for a deployment, from the shared cost model.

Batch sizing (:func:`advise_batch`). The step time of a plan grows with the batch and so
does throughput, until a GPU runs out of memory (weights, expert replicas, KV cache at the
deployment's context, activations, communication buffers) or the step no longer meets a
latency target - the time per output token (TPOT) in decode, the time to first token
(TTFT) of a prefill batch. Engines size the batch so the GPU with the least memory fits an
equal split; the planner can shift tokens to GPUs with room, so the search starts there
and grows::

    start  = max t such that, on every GPU g at an equal split,
             W_g + S * L_moe * B + K(t) + A * t <= U_g             (what fits the smallest GPU)
    t_k+1  = ceil(growth * t_k)  while solve(t_k) fits and meets the target
    then bisect between the last good and the first bad batch (to ``tolerance``)

with ``W_g`` the shared weights and buffers, ``S`` slots per GPU, ``B`` bytes of one expert
replica, ``K(t)`` the KV cache of ``t`` tokens (``t * context`` tokens of KV in decode,
``max(t, context)`` in prefill), ``A`` activation bytes per token and ``U_g`` usable memory.
Every point is a full :func:`policies.solve.solve`, so the curve (tokens/s against
tokens per GPU) is the cost model's prediction for the deployment's policy.

Long context (:func:`advise_context`). At 32k-128k tokens of context the KV cache, not
compute, limits a plan: a GPU's KV capacity is ``(U_g - W_g - experts_g - activations_g) /
kv_bytes_per_token`` tokens, and a plan at attention shares ``a_g`` holds a context of at
most ``min_g capacity_g / (a_g * T)`` (``T`` tokens per step). Equal shares (``uniform``,
``eplb``) are bound by the GPU with the least memory; ``greedy`` caps shares by memory and
``ilp``'s attention LP has the memory constraint (1d) of :mod:`policies.solvers.ilp`, so
both move attention - and its KV cache - to GPUs with memory to spare. For each policy the
report gives, per context, the attention share and KV per GPU model, and the longest
context it can hold at the batch (a grid of contexts refined by bisection).

Units: tokens, microseconds (``_us``), milliseconds (``_ms``) for targets, GiB for memory.
Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policies.defaults import DEFAULT_CONTEXTS as DEFAULT_CONTEXTS  # one default: policies.defaults
from policies.deployment import Deployment, try_solve
from policies.errors import InputError
from policies.estimate.costmodel import GIB, build_cost_table
from policies.plan import Plan
from policies.request import POLICIES

#: Largest batch the search tries when none is given, tokens per GPU per step.
DEFAULT_MAX_TOKENS_PER_GPU = {"decode": 4096, "prefill": 262_144}


# ------------------------------------------------------------------------- batch sizing


@dataclass(frozen=True)
class BatchPoint:
    """One batch size, solved.

    Attributes:
        tokens_per_gpu: tokens per step per GPU on average (decode: sequences per GPU).
        step_time_us: predicted step time (TPOT in decode, TTFT in prefill); None when no
            plan was found.
        tokens_per_s: predicted throughput of the whole deployment; 0 without a plan.
        max_gpu_tokens: most tokens any one GPU serves per step in the plan (the plan may
            give big GPUs more than the average).
        fits_memory: the plan fits every GPU's memory (and covers every expert).
        meets_target: fits and the step time is within the target (True without target).
        reason: why the point is not usable; empty when it is.
        plan_id: the plan's id ("" without a plan).
    """

    tokens_per_gpu: int
    step_time_us: float | None
    tokens_per_s: float
    max_gpu_tokens: float
    fits_memory: bool
    meets_target: bool
    reason: str = ""
    plan_id: str = ""

    @property
    def ok(self) -> bool:
        return self.fits_memory and self.meets_target


@dataclass(frozen=True)
class BatchAdvice:
    """The batch-size search's answer.

    Attributes:
        phase: ``decode`` (target = TPOT) or ``prefill`` (target = TTFT).
        policy: the placement policy every point was solved with.
        target_ms: step-time target, ms; None for "largest batch that fits".
        start_tokens_per_gpu: the batch the GPU with the least memory holds at an equal
            split - where the search started.
        start_gpu: that GPU's id.
        largest_tokens_per_gpu: the largest batch found that fits and meets the target;
            None when not even one token per GPU does.
        best: the point at ``largest_tokens_per_gpu``.
        limit: what stopped growth: ``memory``, ``target`` or ``max_tokens`` (the search
            cap); ``none`` when nothing fits.
        points: every batch solved, ascending (the throughput curve).
        infeasible: why no batch works, with how to fix it (empty when one does).
    """

    phase: str
    policy: str
    target_ms: float | None
    start_tokens_per_gpu: int
    start_gpu: str
    largest_tokens_per_gpu: int | None
    best: BatchPoint | None
    limit: str
    points: tuple[BatchPoint, ...]
    infeasible: tuple[str, ...] = ()

    @property
    def target_name(self) -> str:
        """``TPOT`` (decode) or ``TTFT`` (prefill)."""
        return "TPOT" if self.phase == "decode" else "TTFT"


def equal_split_start(dep: Deployment) -> tuple[int, str]:
    """Largest tokens per GPU every GPU fits at an equal split, and the GPU that binds.

    Engine form counts ``(E + R) / G`` expert slots per GPU, native form its ceiling.
    Returns at least 1 (the search then finds out whether 1 fits).
    """
    table = build_cost_table(dep.fleet, dep.model, dep.workload(1), dep.settings)
    n = table.num_gpus
    slots = 0
    if dep.model.is_moe:
        slots = -(-(dep.model.num_experts + dep.redundancy_for(n)) // n)
    expert_bytes = slots * table.num_moe_layers * table.expert_bytes
    kv, act, ctx = table.kv_bytes_per_token, table.act_bytes_per_token, table.context_len
    best: tuple[int, str] | None = None
    for gid, c in zip(table.gpu_ids, table.gpus, strict=True):
        room = c.usable_bytes - c.fixed_bytes - expert_bytes
        if table.decode:
            t = room / (ctx * kv + act)
        elif room >= (kv + act) * ctx:  # prefill: KV of max(t, context) tokens
            t = room / (kv + act)
        else:
            t = (room - kv * ctx) / act
        fit = max(0, math.floor(t))
        if best is None or fit < best[0]:
            best = (fit, gid)
    assert best is not None  # a fleet has at least one GPU
    return max(1, best[0]), best[1]


def _check_target(target_ms: float | None) -> float | None:
    if target_ms is None:
        return None
    if isinstance(target_ms, bool) or not (target_ms > 0 and math.isfinite(target_ms)):
        raise InputError(f"must be a finite number of ms > 0, got {target_ms!r}", field="target")
    return target_ms * 1e3


def solve_batch(dep: Deployment, tokens_per_gpu: int, target_ms: float | None) -> BatchPoint:
    """Solve one batch size and judge it against memory and the target.

    Raises:
        InputError: invalid deployment or batch.
    """
    target_us = _check_target(target_ms)
    out = try_solve(dep.request(tokens_per_gpu))
    if out.result is None:
        return BatchPoint(tokens_per_gpu, None, 0.0, 0.0, False, False, out.reason)
    plan = out.result.plan
    s = plan.summary
    fits = not out.reason
    meets = fits and (target_us is None or s.step_time_us <= target_us)
    reason = out.reason
    if fits and not meets and target_ms is not None:
        name = "TPOT" if dep.phase == "decode" else "TTFT"
        reason = f"step {s.step_time_us / 1e3:.2f} ms exceeds the {name} target {target_ms:g} ms"
    top = max(g.attention_share for g in plan.gpus) * tokens_per_gpu * len(plan.gpus)
    return BatchPoint(
        tokens_per_gpu,
        s.step_time_us,
        s.tokens_per_s if fits else 0.0,
        top,
        fits,
        meets,
        reason,
        plan.id,
    )


def advise_batch(
    dep: Deployment,
    target_ms: float | None = None,
    *,
    max_tokens_per_gpu: int | None = None,
    growth: float = 1.5,
    tolerance: float = 0.02,
    below: int = 4,
) -> BatchAdvice:
    """Largest batch per GPU that fits memory and meets a step-time target, with the curve.

    Args:
        dep: the deployment (its phase decides whether the target is TPOT or TTFT).
        target_ms: largest allowed step time, ms; None = largest batch that fits memory.
        max_tokens_per_gpu: stop growing here (default 4096 decode, 262144 prefill).
        growth: factor between successive batches while growing (> 1).
        tolerance: relative precision of the final bisection (0.02 = within 2%).
        below: batches solved below the start, geometrically spaced, for the curve.

    Returns:
        The advice; ``infeasible`` says why when not even one token per GPU works.

    Raises:
        InputError: invalid target, growth, tolerance or deployment.
    """
    _check_target(target_ms)
    if not growth > 1 or not math.isfinite(growth):
        raise InputError(f"must be > 1, got {growth!r}", field="growth")
    if not 0 < tolerance < 1:
        raise InputError(f"must be in (0, 1), got {tolerance!r}", field="tolerance")
    cap = max_tokens_per_gpu or DEFAULT_MAX_TOKENS_PER_GPU[dep.phase]
    if cap < 1:
        raise InputError(f"must be >= 1, got {cap}", field="max_tokens_per_gpu")
    start, start_gpu = equal_split_start(dep)
    start = min(start, cap)
    points: dict[int, BatchPoint] = {}

    def at(t: int) -> BatchPoint:
        if t not in points:
            points[t] = solve_batch(dep, t, target_ms)
        return points[t]

    lows = sorted({max(1, math.floor(start / growth ** (2 * k))) for k in range(1, below + 1)})
    for t in lows:
        if t < start:
            at(t)
    good, bad = _bracket(at, points, start, cap, growth)
    while good is not None and bad is not None and bad - good > max(1, tolerance * good):
        mid = (good + bad) // 2
        if at(mid).ok:
            good = mid
        else:
            bad = mid
    curve = tuple(points[t] for t in sorted(points))
    if good is None:
        first = points[min(points)]
        return BatchAdvice(
            dep.phase,
            dep.policy,
            target_ms,
            start,
            start_gpu,
            None,
            None,
            "none",
            curve,
            _why_not(dep, first, target_ms),
        )
    limit = "max_tokens"
    if bad is not None:
        limit = "target" if points[bad].fits_memory else "memory"
    return BatchAdvice(
        dep.phase, dep.policy, target_ms, start, start_gpu, good, points[good], limit, curve
    )


def _bracket(
    at: Callable[[int], BatchPoint],
    points: Mapping[int, BatchPoint],
    start: int,
    cap: int,
    growth: float,
) -> tuple[int | None, int | None]:
    """The largest batch known to work and the smallest known to fail around ``start``.

    From a working ``start`` the batch grows by ``growth`` until one fails or ``cap`` is
    reached; from a failing one the largest working batch already solved below it is taken
    (trying 1 token per GPU when none is).

    Args:
        at: solves (memoised) one batch, tokens per GPU.
        points: the batches solved so far (``at`` adds to it).
        start: first batch, tokens per GPU; cap: largest batch tried.
        growth: factor between successive batches while growing.

    Returns:
        ``(good, bad)``: tokens per GPU; ``good`` None when nothing works, ``bad`` None when
        every batch up to ``cap`` works.
    """
    good: int | None = None
    bad: int | None = None
    if at(start).ok:
        good = start
        t = start
        while t < cap:
            t = min(cap, max(t + 1, math.ceil(t * growth)))
            if at(t).ok:
                good = t
            else:
                bad = t
                break
    else:
        bad = start
        oks = [t for t, p in points.items() if p.ok and t < start]
        good = max(oks) if oks else None
        if good is None and 1 not in points:
            good = 1 if at(1).ok else None
        if good is None:
            bad = min(bad, 1)
        else:
            bad = min((t for t, p in points.items() if not p.ok and t > good), default=bad)
    return good, bad


def _why_not(dep: Deployment, first: BatchPoint, target_ms: float | None) -> tuple[str, ...]:
    """Reasons, with fixes, when not even the smallest batch works."""
    if not first.fits_memory:
        return (
            f"{first.tokens_per_gpu} token(s) per GPU do not fit: {first.reason}. To fix: "
            "shorten the context, use an FP8 KV cache, add GPUs or use GPUs with more memory",
        )
    name = "TPOT" if dep.phase == "decode" else "TTFT"
    return (
        f"even {first.tokens_per_gpu} token(s) per GPU take "
        f"{(first.step_time_us or 0.0) / 1e3:.2f} ms per step, over the {name} target "
        f"{target_ms:g} ms. To fix: relax the target, use faster GPUs, or keep the "
        "expert-parallel group inside one NVLink domain (cross-node all-to-all adds latency "
        "to every MoE layer)",
    )


# ------------------------------------------------------------------------- long context


@dataclass(frozen=True)
class ModelShare:
    """A plan's attention and KV cache on the GPUs of one catalog model.

    Attributes:
        gpu_model: catalog model.
        gpus: how many GPUs of that model.
        attention_share_each: mean attention share of one such GPU (fraction of the step's
            tokens).
        kv_gib_each: largest KV cache on one such GPU, GiB.
        free_gib_each: least memory one such GPU has for KV (usable minus weights, experts
            and activations), GiB.
        max_context: longest context these GPUs hold at the plan's shares, tokens; None
            when they serve no attention.
    """

    gpu_model: str
    gpus: int
    attention_share_each: float
    kv_gib_each: float
    free_gib_each: float
    max_context: int | None


def plan_context_capacity(plan: Plan) -> tuple[int | None, str, tuple[ModelShare, ...]]:
    """Longest context a plan holds at its attention shares, the GPU that binds, and the
    per-model breakdown.

    A GPU's KV cache is proportional to the context (decode: ``tokens * context`` tokens of
    KV; prefill: ``max(tokens, context)``, so the same ratio holds once the context exceeds
    the tokens), hence ``max_context_g = context * free_g / kv_g``.
    """
    ctx = int(plan.workload.get("context_len", 0) or 0)
    per_gpu: list[tuple[str, str, float, float, float, int | None]] = []
    for g in plan.gpus:
        mem = g.memory_bytes
        kv = float(mem.get("kv_cache", 0.0))
        free = float(mem.get("usable", 0.0)) - sum(
            float(mem.get(k, 0.0)) for k in ("weights", "experts", "activations")
        )
        cap = math.floor(ctx * max(free, 0.0) / kv) if kv > 0 and ctx > 0 else None
        per_gpu.append((g.gpu, g.model, g.attention_share, kv, free, cap))
    limited = [(cap, gid) for gid, _, _, _, _, cap in per_gpu if cap is not None]
    best, binding = min(limited) if limited else (None, "")
    shares: list[ModelShare] = []
    for model in dict.fromkeys(m for _, m, *_ in per_gpu):
        rows = [r for r in per_gpu if r[1] == model]
        caps = [r[5] for r in rows if r[5] is not None]
        shares.append(
            ModelShare(
                model,
                len(rows),
                sum(r[2] for r in rows) / len(rows),
                max(r[3] for r in rows) / GIB,
                min(r[4] for r in rows) / GIB,
                min(caps) if caps else None,
            )
        )
    return best, binding, tuple(shares)


@dataclass(frozen=True)
class ContextPoint:
    """One policy at one context.

    Attributes:
        policy: placement policy.
        context_len: tokens of context per sequence.
        ok: the plan fits memory.
        reason: why not (first memory problem); empty when it fits.
        step_time_us: predicted step time; None without a plan.
        tokens_per_s: predicted throughput; 0 when it does not fit.
        shares: attention share and KV per GPU model.
        max_context_at_shares: longest context the plan holds without re-planning, tokens.
        binding_gpu: the GPU whose KV capacity sets ``max_context_at_shares``.
    """

    policy: str
    context_len: int
    ok: bool
    reason: str
    step_time_us: float | None
    tokens_per_s: float
    shares: tuple[ModelShare, ...]
    max_context_at_shares: int | None
    binding_gpu: str


@dataclass(frozen=True)
class PolicyContext:
    """A policy's long-context report.

    Attributes:
        policy: placement policy.
        longest_context: longest context (to the search granularity) at which the policy
            finds a plan that fits, tokens; None when none of the contexts tried fits.
        binding_gpu: the GPU whose KV capacity binds at ``longest_context``.
        points: every context solved, ascending.
    """

    policy: str
    longest_context: int | None
    binding_gpu: str
    points: tuple[ContextPoint, ...]

    def at(self, context_len: int) -> ContextPoint | None:
        """The point solved at ``context_len``, if any."""
        return next((p for p in self.points if p.context_len == context_len), None)


@dataclass(frozen=True)
class ContextAdvice:
    """Long-context report of several policies at one batch.

    Attributes:
        tokens_per_gpu: batch, tokens per GPU per step (decode: sequences per GPU).
        contexts: the grid of contexts, tokens.
        policies: one report per policy, in the order asked.
    """

    tokens_per_gpu: int
    contexts: tuple[int, ...]
    policies: tuple[PolicyContext, ...]


def _context_point(dep: Deployment, policy: str, tokens: int, ctx: int) -> ContextPoint:
    out = try_solve(dep.request(tokens, context_len=ctx, policy=policy))
    if out.result is None:
        return ContextPoint(policy, ctx, False, out.reason, None, 0.0, (), None, "")
    plan = out.result.plan
    cap, binding, shares = plan_context_capacity(plan)
    s = plan.summary
    return ContextPoint(
        policy,
        ctx,
        out.ok,
        out.reason,
        s.step_time_us,
        s.tokens_per_s if out.ok else 0.0,
        shares,
        cap,
        binding,
    )


def advise_context(
    dep: Deployment,
    tokens_per_gpu: int,
    *,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    policies: Sequence[str] = ("uniform", "greedy", "ilp"),
    granularity: int = 1024,
    refine: bool = True,
) -> ContextAdvice:
    """For each policy, solve every context of the grid at a fixed batch and find the
    longest context it holds (bisection between the last context that fits and the first
    that does not, to ``granularity`` tokens).

    Raises:
        InputError: empty or non-positive contexts, unknown policy, bad batch.
    """
    grid = tuple(sorted(set(contexts)))
    if not grid or grid[0] <= 0:
        raise InputError(f"must be positive token counts, got {list(contexts)!r}", field="contexts")
    if tokens_per_gpu <= 0:
        raise InputError(f"must be >= 1, got {tokens_per_gpu}", field="tokens")
    if granularity <= 0:
        raise InputError(f"must be >= 1, got {granularity}", field="granularity")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise InputError(f"unknown policies {unknown}; choose from {POLICIES}", field="policies")
    reports: list[PolicyContext] = []
    for policy in policies:
        done: dict[int, ContextPoint] = {}

        def at(
            ctx: int, policy: str = policy, done: dict[int, ContextPoint] = done
        ) -> ContextPoint:
            if ctx not in done:
                done[ctx] = _context_point(dep, policy, tokens_per_gpu, ctx)
            return done[ctx]

        for ctx in grid:
            at(ctx)
        oks = [c for c in grid if done[c].ok]
        good = max(oks) if oks else 0
        bad = min((c for c in grid if c > good and not done[c].ok), default=None)
        if refine and bad is not None:
            good, bad = _bisect(at, good, bad, granularity)
        longest = good if good > 0 else None
        binding = done[good].binding_gpu if good in done else ""
        points = tuple(done[c] for c in sorted(done))
        reports.append(PolicyContext(policy, longest, binding, points))
    return ContextAdvice(tokens_per_gpu, grid, tuple(reports))


def _bisect(
    at: Callable[[int], ContextPoint], good: int, bad: int, granularity: int
) -> tuple[int, int]:
    """Largest context in (good, bad) that fits, on multiples of ``granularity``."""
    while bad - good > granularity:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good:
            break
        if at(mid).ok:
            good = mid
        else:
            bad = mid
    return good, bad
