"""Workload: inference phase, batch shape and per-layer expert load.

Expert load is a matrix ``[num_moe_layers][num_experts]`` of non-negative weights (token
counts from an engine's recorder, or synthetic); only each row's proportions matter.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policies.defaults import KV_DTYPES as KV_DTYPES  # one default: policies.defaults
from policies.defaults import PHASES as PHASES
from policies.errors import InputError
from policies.model.architecture import ModelSpec


@dataclass(frozen=True)
class Workload:
    """What the fleet serves in one step.

    Attributes:
        phase: ``prefill`` or ``decode``.
        tokens_per_gpu: tokens per step per GPU on average; the step's total batch is
            ``tokens_per_gpu * num_gpus`` and the plan decides how it is split. In decode one
            token is one sequence.
        context_len: tokens of context each sequence holds (KV cache length).
        expert_load: ``[num_moe_layers][num_experts]`` load weights (token counts).
        kv_cache_dtype: ``bf16`` or ``fp8``.
        load_source: where the load came from (for reports).
    """

    phase: str
    tokens_per_gpu: int
    context_len: int
    expert_load: tuple[tuple[float, ...], ...]
    kv_cache_dtype: str = "bf16"
    load_source: str = "uniform"

    @property
    def decode(self) -> bool:
        return self.phase == "decode"

    def load_fractions(self, layer: int) -> list[float]:
        """Row ``layer`` of the load normalised to sum 1 (uniform when all zero)."""
        row = self.expert_load[layer]
        total = sum(row)
        if total <= 0:
            return [1.0 / len(row)] * len(row)
        return [x / total for x in row]


def make_workload(
    model: ModelSpec,
    *,
    phase: str,
    tokens_per_gpu: int,
    context_len: int,
    load: Sequence[Sequence[float]] | None = None,
    kv_cache_dtype: str = "bf16",
    load_source: str = "uniform",
) -> Workload:
    """Validate and build a :class:`Workload` for ``model``.

    Raises:
        InputError: bad phase, non-positive sizes, load of the wrong shape or with negative,
            NaN or infinite entries.
    """
    if phase not in PHASES:
        raise InputError(f"must be one of {PHASES}, got {phase!r}", field="phase")
    if (
        isinstance(tokens_per_gpu, bool)
        or not isinstance(tokens_per_gpu, int)
        or tokens_per_gpu <= 0
    ):
        raise InputError(f"must be a positive integer, got {tokens_per_gpu!r}", field="tokens")
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len <= 0:
        raise InputError(f"must be a positive integer, got {context_len!r}", field="context")
    if kv_cache_dtype not in KV_DTYPES:
        raise InputError(
            f"must be one of {KV_DTYPES}, got {kv_cache_dtype!r}", field="kv_cache_dtype"
        )
    if load is None:
        rows = tuple(tuple(1.0 for _ in range(model.num_experts)) for _ in model.moe_layers)
    else:
        rows = _check_load(load, model)
    return Workload(phase, tokens_per_gpu, context_len, rows, kv_cache_dtype, load_source)


def _check_load(load: Sequence[Sequence[float]], model: ModelSpec) -> tuple[tuple[float, ...], ...]:
    n_moe, n_exp = model.num_moe_layers, model.num_experts
    if len(load) == model.num_layers and model.num_layers != n_moe:
        load = [load[i] for i in model.moe_layers]  # dense layers included: keep MoE rows
    if len(load) != n_moe:
        raise InputError(
            f"has {len(load)} layers; {model.name} has {n_moe} MoE layers "
            f"({model.num_layers} in all). To fix: give one row per MoE layer or per layer",
            field="load",
        )
    out: list[tuple[float, ...]] = []
    for i, row in enumerate(load):
        if len(row) != n_exp:
            raise InputError(
                f"row {i} has {len(row)} experts; {model.name} has {n_exp}", field="load"
            )
        vals: list[float] = []
        for j, v in enumerate(row):
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or math.isnan(v)
                or math.isinf(v)
                or v < 0
            ):
                raise InputError(
                    f"entry [{i}][{j}] must be a finite number >= 0, got {v!r}", field="load"
                )
            vals.append(float(v))
        out.append(tuple(vals))
    return tuple(out)


def load_from_json(doc: Any, model: ModelSpec) -> list[list[float]]:
    """Read an expert-load document already parsed from JSON.

    Accepts SGLang's expert-distribution recorder dump ``{"logical_count": [...]}`` with
    shape ``[steps, layers, experts]`` (summed over steps) or ``[layers, experts]``, and a
    plain ``[layers][experts]`` list. Rows may cover all layers or only the MoE layers.

    Raises:
        InputError: unrecognised shape.
    """
    data = doc.get("logical_count") if isinstance(doc, dict) else doc
    if data is None:
        raise InputError(
            "JSON object has no 'logical_count'. To fix: give an SGLang expert-distribution "
            "dump or a plain [layers][experts] list",
            field="load",
        )
    if not isinstance(data, list) or not data or not isinstance(data[0], list):
        raise InputError("must be a 2-D or 3-D list of numbers", field="load")
    if data[0] and isinstance(data[0][0], list):  # [steps, layers, experts]
        if not all(isinstance(st, list) and all(isinstance(r, list) for r in st) for st in data):
            raise InputError("must be a [steps][layers][experts] list of numbers", field="load")
        steps = data
        n_layers = len(steps[0])
        summed = [[0.0] * len(steps[0][0]) for _ in range(n_layers)]
        for s, step in enumerate(steps):
            if len(step) != n_layers:
                raise InputError(
                    f"step {s} has {len(step)} layers, step 0 has {n_layers}", field="load"
                )
            for i, row in enumerate(step):
                if len(row) != len(summed[i]):
                    raise InputError(f"step {s} layer {i} has {len(row)} experts", field="load")
                for j, v in enumerate(row):
                    if isinstance(v, bool) or not isinstance(v, int | float):
                        raise InputError(
                            f"entry [{s}][{i}][{j}] is not a number: {v!r}", field="load"
                        )
                    summed[i][j] += float(v)
        return summed
    if not all(isinstance(row, list) for row in data):
        raise InputError("must be a [layers][experts] list of numbers", field="load")
    return [list(row) for row in data]


_SYNTH_RE = re.compile(r"^synthetic:zipf:(?P<s>[0-9.]+)(:seed=(?P<seed>\d+))?$")


def synthetic_zipf(model: ModelSpec, spec: str) -> list[list[float]]:
    """Seeded skewed load ``synthetic:zipf:S[:seed=N]``.

    Each MoE layer gets weights ``1 / rank**S`` over a random permutation of its experts
    (a different permutation per layer), scaled to 10,000 tokens per layer.

    Raises:
        InputError: malformed spec or exponent outside [0, 5].
    """
    m = _SYNTH_RE.match(spec.strip())
    if not m:
        raise InputError(
            f"cannot parse {spec!r}. To fix: write synthetic:zipf:S:seed=N, e.g. "
            "synthetic:zipf:1.0:seed=7",
            field="load",
        )
    s = float(m.group("s"))
    if not 0 <= s <= 5:
        raise InputError(f"zipf exponent must be in [0, 5], got {s}", field="load")
    rng = random.Random(int(m.group("seed") or 0))
    rows: list[list[float]] = []
    n = model.num_experts
    base = [1.0 / (r + 1) ** s for r in range(n)]
    scale = 10_000.0 / sum(base)
    for _ in model.moe_layers:
        perm = list(range(n))
        rng.shuffle(perm)
        row = [0.0] * n
        for rank, e in enumerate(perm):
            row[e] = base[rank] * scale
        rows.append(row)
    return rows


def imbalance(loads: Sequence[float]) -> float:
    """(max - mean) / mean of per-GPU loads; 0 for a perfect balance."""
    mean = sum(loads) / len(loads)
    return (max(loads) - mean) / mean if mean > 0 else 0.0
