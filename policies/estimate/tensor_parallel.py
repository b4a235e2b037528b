"""Tensor-parallel attention inside a node: DP groups of k GPUs, their cost, the choice of k.

Engines run attention as data-parallel (DP) groups, each a tensor-parallel (TP) group of k
GPUs: SGLang ``--tp N --dp M --enable-dp-attention`` (``attn_tp_size = N // M``, group j the
consecutive ranks ``j k .. j k + k - 1``), vLLM ``--data-parallel-size M
--tensor-parallel-size k``; TensorRT-LLM's attention is either TP over the whole server or DP
(``enable_attention_dp``), and its MoE load balancer needs the DP side, so with experts it
runs k = 1. Every engine runs ONE attention TP size per server; ``native`` (idealised) may
give each class of interchangeable GPUs its own.

**Cost of a group** (:func:`with_attention_tp`). A group of k identical GPUs of one node
serves a share X of the step's T tokens with its query heads split k ways; each of its GPUs
counts as serving ``x = X / k`` (so the solvers keep working on per-GPU shares and give a
group's GPUs one share). Per GPU, against pure DP at x:

* GEMM and attention-core FLOPs: the same (1/k of the weights over k times the tokens);
* attention, dense-FFN, shared-expert and embedding weights: divided by k, in memory and in
  weight-read time (the group splits them all like the attention; an engine that splits
  dense layers or the vocabulary over more GPUs holds less, one that keeps shared experts
  whole on every rank holds more);
* KV cache, in memory and in decode reads: multiplied by ``k / kv_shards``, where GQA splits
  its KV heads ``kv_shards = min(k, num_kv_heads)`` ways and replicates them beyond, and
  MLA's compressed latent is whole on every rank (``kv_shards = 1``: the KV per GPU is k
  times pure DP's, so DeepSeek-style models keep k = 1 unless only groups fit);
* two ring all-reduces per layer (after the attention output and after the FFN) of the
  group's hidden states, ``V = X T hidden * 2`` bytes (BF16): each GPU sends and receives
  ``2 (k-1)/k V`` over its node's NVLink (PCIe without), plus
  ``Efficiency.allreduce_latency_us`` each::

      A_g += 2 * allreduce_latency_us + x_g T * 8 (k-1) hidden / bw_nvlink     (bytes, B/us)

  folded into ``attn_overhead_us`` and ``attn_core_us_per_token`` so every solver sees it.

**Choice of k** (:func:`choose`). Candidate sizes are 1, 2, 4, 8 dividing the GPUs of the
class's model on each of its nodes and the query heads (and, for GQA, dividing or being a
multiple of the KV heads); engines take one size for every GPU, in blocks of consecutive
ranks that stay on one node and one model. Candidate vectors (the full product over classes
while it has at most :data:`MAX_CANDIDATES` members, else every single size plus a pass of
one-class changes from the best) are ordered fewest TP first and screened:

1. quick: fits memory (``fits`` of :mod:`policies.solve`, then the greedy shares with the
   engine-form slots) and the attention phases at the greedy shares;
2. for MoE models, when a TP candidate leads, the greedy placement of the
   :data:`FULL_SCREEN` best, scored as the engine executes it.

The kept vector is the first, in fewest-TP order, within :data:`TP_MARGIN` of the fastest
(more TP must be predicted clearly faster: a group fails as one, and the all-reduce figures
are uncalibrated). The request's policy then solves it - for MoE models together with the
data-parallel vector when that passed the screen, each with an equal part of the time
limit, and the policy's plans are compared by the same rule; dense models are cheap, so
every screened candidate is solved. While no plan is valid, later candidates are tried
(:data:`POLICY_TRIES` in all). When the screen passes nothing, the policy tries the
data-parallel and the largest vectors; with nothing that fits at all, the answer is the
largest TP's reasons (``fits``).

Pure: no I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import product

from policies.errors import InputError
from policies.estimate.costmodel import (
    GIB,
    CostSettings,
    CostTable,
    attention_core_us,
    build_cost_table,
)
from policies.estimate.evaluation import evaluate
from policies.estimate.execution import executed, runtime_of
from policies.estimate.workload import Workload
from policies.hardware.fleet import Fleet
from policies.hardware.topology import Channel
from policies.model.architecture import DTYPE_BYTES, ModelSpec
from policies.request import Infeasible, PlacementRequest, PolicyFn, RawPlacement
from policies.solvers import greedy
from policies.solvers.common import free_expert_bytes, slots_per_gpu
from policies.solvers.ilp_attention import class_of

TP_SIZES = (1, 2, 4, 8)
"""Attention TP sizes considered (engines take powers of two up to a node)."""

TP_MARGIN = 0.02
"""A vector with more TP is kept only when predicted more than this fraction faster."""

MAX_CANDIDATES = 64
"""Largest product of per-class choices enumerated in full."""

FULL_SCREEN = 3
"""Candidates scored with the full greedy placement (MoE models)."""

POLICY_TRIES = 3
"""Candidates the request's policy solves at most, best first, until one plan is valid."""

HIDDEN_BYTES = 2.0
"""Bytes per hidden-state element in the all-reduces (BF16)."""

Fits = Callable[[PlacementRequest, CostTable], Infeasible | None]


@dataclass(frozen=True)
class TpChoice:
    """The attention TP sizes chosen for a request and the policy's answer under them.

    Attributes:
        attention_tp: per GPU (fleet order) the size of its TP attention group.
        table: the cost table at those sizes.
        answer: the policy's placement, or why none exists (for a model that fits no
            candidate: the largest TP's reasons).
        solve_s: wall time of the screening and the policy's solves, seconds.
    """

    attention_tp: tuple[int, ...]
    table: CostTable
    answer: RawPlacement | Infeasible
    solve_s: float


# ------------------------------------------------------------------------------ cost


def kv_shards(model: ModelSpec, k: int) -> int:
    """Ways a TP group of k splits the KV cache: GQA KV heads up to k, MLA's latent never."""
    return 1 if model.attention == "mla" else max(1, min(k, model.num_kv_heads))


def with_attention_tp(
    table: CostTable,
    fleet: Fleet,
    model: ModelSpec,
    workload: Workload,
    settings: CostSettings,
    attention_tp: Sequence[int],
) -> CostTable:
    """``table`` (built by :func:`policies.estimate.costmodel.build_cost_table` for the same inputs)
    with GPU i in a TP attention group of ``attention_tp[i]`` GPUs (module docstring).

    Raises:
        InputError: ``attention_tp`` has the wrong length or a size below 1.
    """
    n = table.num_gpus
    if len(attention_tp) != n or any(k < 1 for k in attention_tp):
        raise InputError(
            f"needs one size >= 1 per GPU ({n}), got {tuple(attention_tp)}", field="attention_tp"
        )
    eff = settings.efficiency
    buffers = settings.comm_buffer_gib * GIB
    kv_bytes = DTYPE_BYTES[workload.kv_cache_dtype]
    gpus = list(table.gpus)
    for i, k in enumerate(attention_tp):
        if k == 1:
            continue
        c, gpu = gpus[i], fleet.gpus[i]
        meas = settings.measured.get(gpu.id)
        core = c.attn_core_us_per_token
        replication = k / kv_shards(model, k)
        if replication != 1.0:  # decode KV reads grow with the KV each GPU keeps
            core += attention_core_us(
                gpu.spec, meas, model, workload, eff, kv_bytes * replication
            ) - attention_core_us(gpu.spec, meas, model, workload, eff, kv_bytes)
        bw = c.comm_bw_bytes_per_us[Channel.NVLINK]
        allreduce_us_per_token = 2 * 2 * (k - 1) * model.hidden * HIDDEN_BYTES / bw
        gpus[i] = replace(
            c,
            attn_weight_read_us={kind: v / k for kind, v in c.attn_weight_read_us.items()},
            attn_core_us_per_token=core + allreduce_us_per_token,
            attn_overhead_us=c.attn_overhead_us + 2 * eff.allreduce_latency_us,
            fixed_bytes=(c.fixed_bytes - buffers) / k + buffers,
        )
    return replace(
        table,
        gpus=tuple(gpus),
        attention_tp=tuple(attention_tp),
        kv_shards=tuple(kv_shards(model, k) for k in attention_tp),
    )


def tp_cost_table(
    fleet: Fleet,
    model: ModelSpec,
    workload: Workload,
    settings: CostSettings | None,
    attention_tp: Sequence[int],
) -> CostTable:
    """The cost table of (fleet, model, workload) with the given TP attention sizes (to
    re-score a plan: ``[g.attention_tp for g in plan.gpus]``)."""
    s = settings or CostSettings()
    return with_attention_tp(
        build_cost_table(fleet, model, workload, s), fleet, model, workload, s, attention_tp
    )


def dp_groups(fleet: Fleet, attention_tp: Sequence[int]) -> tuple[int, ...]:
    """Per GPU (fleet order) the index of its DP attention group: GPUs of one node and one
    model join groups of ``attention_tp`` in fleet order; groups are numbered by their first
    GPU. For an engine's contiguous blocks this is SGLang's ``dp_rank = rank // k``."""
    out: list[int] = []
    open_group: dict[tuple[str, str, int], tuple[int, int]] = {}  # -> (index, members)
    count = 0
    for gpu, k in zip(fleet.gpus, attention_tp, strict=True):
        key = (gpu.node, gpu.spec.model, k)
        index, members = open_group.get(key, (-1, k))
        if members >= k:
            index, members = count, 0
            count += 1
        open_group[key] = (index, members + 1)
        out.append(index)
    return tuple(out)


# ------------------------------------------------------------------------ candidates


def _allowed(req: PlacementRequest, members: Sequence[int]) -> list[int]:
    """TP sizes a class of GPUs can take: dividing its model's GPUs on each node and the
    query heads; for GQA dividing the KV heads or a multiple of them."""
    m = req.model
    gpus = req.fleet.gpus
    per_node: dict[str, int] = {}
    for i in members:
        per_node[gpus[i].node] = per_node.get(gpus[i].node, 0) + 1
    out = []
    for k in TP_SIZES:
        if any(c % k for c in per_node.values()) or m.num_q_heads % k:
            continue
        if m.attention != "mla" and m.num_kv_heads % k and k % m.num_kv_heads:
            continue
        out.append(k)
    return out


def _contiguous(fleet: Fleet, k: int) -> bool:
    """Blocks of k consecutive ranks each stay on one node and one GPU model."""
    gpus = fleet.gpus
    if len(gpus) % k:
        return False
    return all(
        len({(g.node, g.spec.model) for g in gpus[j : j + k]}) == 1 for j in range(0, len(gpus), k)
    )


def tp_order(vec: Sequence[int]) -> tuple[float, tuple[int, ...]]:
    """Sort key: fewest TP first (sum of log2 k over GPUs), then the vector itself."""
    return sum(math.log2(k) for k in vec), tuple(vec)


def candidates(req: PlacementRequest, table: CostTable) -> list[tuple[int, ...]]:
    """Per-GPU TP vectors to screen, fewest TP first (all ones first); a single vector of
    ones when nothing else is allowed."""
    n = table.num_gpus
    classes = class_of(table, req)
    allowed = [_allowed(req, cls) for cls in classes]
    if req.engine.name != "native":
        common = sorted(set.intersection(*(set(a) for a in allowed)))
        if req.engine.name == "trtllm" and req.model.is_moe:
            common = [1]
        sizes = [k for k in common if _contiguous(req.fleet, k)]
        choices: list[tuple[int, ...]] = [(k,) * len(classes) for k in sizes]
    elif math.prod(len(a) for a in allowed) <= MAX_CANDIDATES:
        choices = list(product(*allowed))
    else:  # each size everywhere it is allowed (the one-class pass comes in choose)
        choices = [tuple(max(x for x in a if x <= k) for a in allowed) for k in TP_SIZES]
    vectors = set()
    for choice in choices:
        vec = [1] * n
        for cls, k in zip(classes, choice, strict=True):
            for i in cls:
                vec[i] = k
        vectors.add(tuple(vec))
    vectors.add((1,) * n)
    return sorted(vectors, key=tp_order)


# ------------------------------------------------------------------------- screening


def _quick_us(req: PlacementRequest, table: CostTable, fits: Fits) -> float:
    """Attention phases over the layers at the greedy shares, us; inf when the candidate
    does not fit (``fits``, or KV and engine-form slots at those shares)."""
    if fits(req, table) is not None:
        return math.inf
    share = greedy.greedy_attention(req, table)
    n, T = table.num_gpus, table.total_tokens
    need = 0.0
    if table.num_moe_layers and req.form == "engine":
        need = slots_per_gpu(table.num_experts, req.redundant_experts, n)
        need *= table.num_moe_layers * table.expert_bytes
    slack = [c.usable_bytes * 1e-9 for c in table.gpus]  # evaluate's tolerance
    if any(free_expert_bytes(table, i, share[i]) < need - slack[i] for i in range(n)):
        return math.inf
    if table.num_moe_layers and isinstance(greedy.capacities(req, table, share), Infeasible):
        return math.inf
    total = 0.0
    for kind, layers in (("dense", table.num_dense_layers), ("moe", table.num_moe_layers)):
        if layers:
            total += layers * max(table.attention_us(i, share[i] * T, kind) for i in range(n))
    return total


def _full_us(req: PlacementRequest, table: CostTable) -> float:
    """Step time of the greedy placement as the engine executes it, us (inf if invalid)."""
    raw = greedy.place(req, table)
    if isinstance(raw, Infeasible):
        return math.inf
    run = executed(req, runtime_of(req), raw)
    ev = evaluate(table, run.attention_share, run.layers)
    return ev.step_time_us if ev.feasible else math.inf


def _pick(
    order: Sequence[tuple[int, ...]], score: dict[tuple[int, ...], float]
) -> list[tuple[int, ...]]:
    """Feasible vectors best first: the first in fewest-TP order within TP_MARGIN of the
    fastest, then the rest by score."""
    feasible = [v for v in order if math.isfinite(score.get(v, math.inf))]
    if not feasible:
        return []
    fastest = min(score[v] for v in feasible)
    kept = next(v for v in feasible if score[v] <= fastest * (1 + TP_MARGIN))
    rest = sorted((v for v in feasible if v != kept), key=lambda v: (score[v], order.index(v)))
    return [kept, *rest]


def _one_class_pass(
    req: PlacementRequest, base: CostTable, start: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """From ``start``, each class alone set to each of its sizes (large native fleets)."""
    out = []
    for cls in class_of(base, req):
        for k in _allowed(req, cls):
            vec = list(start)
            for i in cls:
                vec[i] = k
            out.append(tuple(vec))
    return out


def _ranked(req: PlacementRequest, base: CostTable, fits: Fits) -> list[tuple[int, ...]]:
    """Feasible candidate vectors, the kept one first (module docstring, steps 1-2)."""
    order = candidates(req, base)
    tables = {v: _table(req, base, v) for v in order}
    quick = {v: _quick_us(req, t, fits) for v, t in tables.items()}
    sizes = [len(_allowed(req, c)) for c in class_of(base, req)]
    many = req.engine.name == "native" and math.prod(sizes) > MAX_CANDIDATES
    if many and (ranked := _pick(order, quick)):
        extra = [v for v in _one_class_pass(req, base, ranked[0]) if v not in quick]
        for v in extra:
            tables[v] = _table(req, base, v)
            quick[v] = _quick_us(req, tables[v], fits)
        order = sorted(quick, key=tp_order)
    ranked = _pick(order, quick)
    ones = (1,) * base.num_gpus
    if not base.num_moe_layers or not ranked or ranked[0] == ones:
        return ranked
    screened = ranked[:FULL_SCREEN] + ([ones] if ones in ranked[FULL_SCREEN:] else [])
    full = {v: _full_us(req, tables[v]) for v in screened}
    return _pick([v for v in order if v in full], full) or ranked


def _table(req: PlacementRequest, base: CostTable, vec: Sequence[int]) -> CostTable:
    return with_attention_tp(base, req.fleet, req.model, req.workload, req.settings, vec)


# ---------------------------------------------------------------------------- choice


def _equal_in_groups(
    raw: RawPlacement, attention_tp: Sequence[int], groups: Sequence[int]
) -> RawPlacement:
    """Every GPU of a TP group gets its group's mean share (a solver's rounding may split
    a group's share unevenly; the engine cannot)."""
    if all(k == 1 for k in attention_tp):
        return raw
    total: dict[int, float] = {}
    for g, a in zip(groups, raw.attention_share, strict=True):
        total[g] = total.get(g, 0.0) + a
    share = tuple(total[g] / k for g, k in zip(groups, attention_tp, strict=True))
    return replace(raw, attention_share=share)


def describe(fleet: Fleet, attention_tp: Sequence[int]) -> str:
    """One line naming each node's attention TP sizes, e.g. ``a100-0 TP 4 (2 DP groups)``."""
    per_node: dict[str, dict[int, int]] = {}
    for gpu, k in zip(fleet.gpus, attention_tp, strict=True):
        sizes = per_node.setdefault(gpu.node, {})
        sizes[k] = sizes.get(k, 0) + 1
    parts = [
        f"{node} TP {k} ({count // k} DP group{'s' if count // k != 1 else ''})"
        for node, sizes in per_node.items()
        for k, count in sorted(sizes.items())
        if k > 1
    ]
    rest = "; other GPUs data-parallel" if any(k == 1 for k in attention_tp) else ""
    return "attention tensor-parallel: " + ", ".join(parts) + rest


def _solved(
    req: PlacementRequest, base: CostTable, vec: tuple[int, ...], place: PolicyFn, t0: float
) -> tuple[TpChoice, float]:
    """The policy's answer at ``vec`` (group shares equalised, the TP sizes noted) and its
    executed step time, us (inf when it has no valid plan)."""
    table = _table(req, base, vec)
    answer = place(req, table)
    step = math.inf
    if isinstance(answer, RawPlacement):
        answer = _equal_in_groups(answer, vec, dp_groups(req.fleet, vec))
        if any(k > 1 for k in vec):
            answer = replace(answer, notes=(*answer.notes, describe(req.fleet, vec)))
        run = executed(req, runtime_of(req), answer)
        ev = evaluate(table, run.attention_share, run.layers)
        step = ev.step_time_us if ev.feasible else math.inf
    return TpChoice(vec, table, answer, time.perf_counter() - t0), step


def _keep_trying(solved: dict[tuple[int, ...], tuple[TpChoice, float]], left_s: float) -> bool:
    """Another candidate is worth a solve: no valid plan yet, tries and at least a second of
    the time limit left."""
    valid = any(math.isfinite(step) for _, step in solved.values())
    return not valid and len(solved) < POLICY_TRIES and left_s >= 1.0


def _previous_vector(req: PlacementRequest) -> tuple[int, ...] | None:
    """The previous plan's TP sizes when it covers exactly the request's GPUs (re-planning
    keeps them, so the groups, and the experts beside them, stay where they are)."""
    prev = req.previous
    if prev is None or [g.gpu for g in prev.gpus] != [g.id for g in req.fleet.gpus]:
        return None
    return tuple(g.attention_tp for g in prev.gpus)


def choose(req: PlacementRequest, place: PolicyFn, fits: Fits) -> TpChoice:
    """Choose the attention TP sizes and solve the request's policy under them (module
    docstring). Deterministic: the same request gives the same choice.

    Dense models are cheap to solve: the policy solves every candidate that passes the
    screen. MoE models: the policy solves the screen's choice and, when that has TP, the
    data-parallel vector too, each with an equal part of the time limit; later candidates
    only while no plan is valid."""
    t0 = time.perf_counter()
    base = build_cost_table(req.fleet, req.model, req.workload, req.settings)
    base = replace(base, exchange=runtime_of(req).exchange_in(base.decode))
    ones = (1,) * base.num_gpus
    order = candidates(req, base)
    ranked = _ranked(req, base, fits) if order != [ones] else [ones]
    if not ranked or order == [ones]:  # the policy may fit where greedy shares do not
        ranked = ranked or [ones, order[-1]]
        ranked = [v for v in dict.fromkeys(ranked) if fits(req, _table(req, base, v)) is None]
    if not ranked:  # nothing fits: the largest TP sizes' reasons
        table = _table(req, base, order[-1])
        why = fits(req, table)
        assert why is not None  # the filter above found it does not fit
        return TpChoice(order[-1], table, why, time.perf_counter() - t0)
    moe = base.num_moe_layers > 0
    contenders = list(dict.fromkeys([ranked[0], *([ones] if ones in ranked else [])]))
    if not moe:
        contenders = ranked
    kept = _previous_vector(req)
    if kept is not None and kept in ranked:  # re-planning keeps its attention groups
        contenders = [kept]
    budget_s, start = req.options.time_limit_s, time.perf_counter()
    solved: dict[tuple[int, ...], tuple[TpChoice, float]] = {}
    for vec in [*contenders, *ranked]:
        left_s = budget_s - (time.perf_counter() - start)
        if vec in solved or (len(solved) >= len(contenders) and not _keep_trying(solved, left_s)):
            continue
        part_s = budget_s / len(contenders) if len(solved) < len(contenders) else left_s
        each = replace(req, options=replace(req.options, time_limit_s=part_s)) if moe else req
        solved[vec] = _solved(each, base, vec, place, t0)
    score = {v: step for v, (_, step) in solved.items()}
    best = _pick(sorted(solved, key=tp_order), score) or [contenders[0]]
    return replace(solved[best[0]][0], solve_s=time.perf_counter() - t0)
