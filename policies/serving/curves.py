"""Step-time curves of one engine instance: how long a decode step and a prefill forward
take as the batch, the context and the prompt grow.

The planner fills a :class:`StepCurve` per variant from the one cost model
(:mod:`policies.estimate.costmodel`); the serving simulator (:mod:`policies.serving.simulate`) and
the planner's predictions read step times from it, so both see the same engine.

Interpolation is piecewise linear on the grids, which keeps the data's monotonicity. Below
a grid's first point the first value holds (a forward costs at least its fixed overhead);
above its last point the last segment's slope continues (work keeps growing with the batch,
the context or the prompt); a one-point grid is constant.

Pure: no I/O.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.errors import InputError
from policies.keys import check_keys

MAX_GRID_POINTS = 4096
"""Most points of one grid axis."""


@dataclass(frozen=True)
class StepCurve:
    """Step times of one engine instance (all of its GPUs together).

    Attributes:
        batch_grid: sequences per instance in one decode step, strictly increasing (>= 1).
        context_grid: mean context per sequence in that step (KV tokens it attends to),
            tokens, strictly increasing (>= 1).
        decode_step_us: ``[batch][context]``: time of one decode step of the whole instance
            (one output token for every sequence in the batch), us.
        prefill_grid: prompt tokens in one prefill forward, strictly increasing (>= 1).
        prefill_us: time of one prefill forward of that many tokens on the instance, us.
        max_batch: most sequences the instance runs at once: the engine's running-request
            limit, which the planner sets so that ``max_batch`` sequences of
            ``context_grid[-1]`` tokens fit in the KV memory.
        kv_bytes_per_token: KV cache bytes one token takes, whole model (every layer, K and
            V, at the KV dtype), bytes; what a prefill -> decode transfer moves per token.
        kv_capacity_tokens: KV tokens the instance holds in all (whole model), tokens;
            0 = ``max_batch * context_grid[-1]``. Admission keeps the reserved tokens of
            the running sequences (prompt + output) within it.
    """

    batch_grid: tuple[int, ...]
    context_grid: tuple[int, ...]
    decode_step_us: tuple[tuple[float, ...], ...]
    prefill_grid: tuple[int, ...]
    prefill_us: tuple[float, ...]
    max_batch: int
    kv_bytes_per_token: float
    kv_capacity_tokens: int = 0

    def decode_us(self, batch: float, context: float) -> float:
        """One decode step of ``batch`` sequences with a mean ``context`` tokens each, us
        (bilinear on the grids; 0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        i, fi = _locate(self.batch_grid, batch)
        j, fj = _locate(self.context_grid, context)
        rows = self.decode_step_us
        j1 = min(j + 1, len(self.context_grid) - 1)
        lo = rows[i][j] + (rows[i][j1] - rows[i][j]) * fj
        if i + 1 >= len(self.batch_grid):
            return lo
        hi = rows[i + 1][j] + (rows[i + 1][j1] - rows[i + 1][j]) * fj
        return lo + (hi - lo) * fi

    def prefill_time_us(self, tokens: float) -> float:
        """One prefill forward of ``tokens`` prompt tokens, us (0 for none)."""
        if tokens <= 0:
            return 0.0
        i, f = _locate(self.prefill_grid, tokens)
        if i + 1 >= len(self.prefill_grid):
            return self.prefill_us[i]
        return self.prefill_us[i] + (self.prefill_us[i + 1] - self.prefill_us[i]) * f

    def mixed_step_us(self, batch: float, context: float, prefill_tokens: float) -> float:
        """One step that decodes ``batch`` sequences (mean ``context`` tokens) and
        prefills ``prefill_tokens`` prompt tokens in the same forward (chunked prefill), us.

        The two times add, less the fixed cost of one forward counted once (the weights
        are read once): ``decode_us + prefill_time_us - forward_overhead_us()``, which is
        never below either part alone on monotone curves.
        """
        if batch <= 0:
            return self.prefill_time_us(prefill_tokens)
        if prefill_tokens <= 0:
            return self.decode_us(batch, context)
        return (
            self.decode_us(batch, context)
            + self.prefill_time_us(prefill_tokens)
            - self.forward_overhead_us()
        )

    def forward_overhead_us(self) -> float:
        """Fixed cost of one forward (reading the weights), us: the smaller of the cheapest
        decode step and the cheapest prefill forward on the grids; a step that decodes and
        prefills pays it once (:meth:`mixed_step_us`)."""
        return min(self.decode_step_us[0][0], self.prefill_us[0])

    def capacity_tokens(self) -> int:
        """KV tokens the instance holds (``kv_capacity_tokens`` or its default), tokens."""
        return self.kv_capacity_tokens or self.max_batch * self.context_grid[-1]

    def kv_transfer_bytes(self, tokens: float) -> float:
        """Bytes of the KV cache of ``tokens`` tokens."""
        return tokens * self.kv_bytes_per_token

    def to_doc(self) -> dict[str, Any]:
        """The JSON document of the curve (inverse of :meth:`from_doc`)."""
        doc: dict[str, Any] = {
            "batchGrid": list(self.batch_grid),
            "contextGrid": list(self.context_grid),
            "decodeStepUs": [list(r) for r in self.decode_step_us],
            "prefillGrid": list(self.prefill_grid),
            "prefillUs": list(self.prefill_us),
            "maxBatch": self.max_batch,
            "kvBytesPerToken": self.kv_bytes_per_token,
        }
        if self.kv_capacity_tokens:
            doc["kvCapacityTokens"] = self.kv_capacity_tokens
        return doc

    @staticmethod
    def from_doc(doc: Any, path: str = "curve") -> StepCurve:
        """A validated curve of its document.

        Raises:
            InputError: naming the field (``pools[0].curve.decodeStepUs[2][1]`` ...).
        """
        if not isinstance(doc, Mapping):
            raise InputError(f"must be a mapping, got {type(doc).__name__}", field=path)
        check_keys(doc, _CURVE_KEYS, path)
        for key in _CURVE_KEYS[:-1]:
            if key not in doc:
                raise InputError("missing", field=f"{path}.{key}")
        rows = doc["decodeStepUs"]
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise InputError("must be a [batch][context] list of numbers", field=path)
        curve = StepCurve(
            batch_grid=_tuple(doc["batchGrid"], f"{path}.batchGrid"),
            context_grid=_tuple(doc["contextGrid"], f"{path}.contextGrid"),
            decode_step_us=tuple(
                _tuple(r, f"{path}.decodeStepUs[{i}]") for i, r in enumerate(rows)
            ),
            prefill_grid=_tuple(doc["prefillGrid"], f"{path}.prefillGrid"),
            prefill_us=_tuple(doc["prefillUs"], f"{path}.prefillUs"),
            max_batch=doc["maxBatch"],
            kv_bytes_per_token=doc["kvBytesPerToken"],
            kv_capacity_tokens=doc.get("kvCapacityTokens", 0),
        )
        check_curve(curve, path)
        return curve


_CURVE_KEYS = (
    "batchGrid",
    "contextGrid",
    "decodeStepUs",
    "prefillGrid",
    "prefillUs",
    "maxBatch",
    "kvBytesPerToken",
    "kvCapacityTokens",
)


def _tuple(v: Any, path: str) -> tuple[Any, ...]:
    if not isinstance(v, list | tuple):
        raise InputError(f"must be a list, got {type(v).__name__}", field=path)
    return tuple(v)


def _locate(grid: Sequence[int], x: float) -> tuple[int, float]:
    """``(i, f)``: ``x`` lies at ``grid[i] + f * (grid[i+1] - grid[i])``; ``f`` is 0 below
    the grid and runs past 1 above it (the last segment's slope); ``i`` is the last index
    for a one-point grid."""
    n = len(grid)
    if n == 1 or x <= grid[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(grid, x) - 1, n - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def _grid(v: Sequence[Any], path: str) -> None:
    if not v:
        raise InputError("must have at least one point", field=path)
    if len(v) > MAX_GRID_POINTS:
        raise InputError(f"at most {MAX_GRID_POINTS} points, got {len(v)}", field=path)
    for k, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise InputError(f"must be a whole number >= 1, got {x!r}", field=f"{path}[{k}]")
        if k and x <= v[k - 1]:
            raise InputError(
                f"must increase strictly, got {v[k - 1]!r} then {x!r}", field=f"{path}[{k}]"
            )


def _times(v: Sequence[Any], n: int, path: str) -> None:
    if len(v) != n:
        raise InputError(f"must have {n} values (one per grid point), got {len(v)}", field=path)
    for k, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x <= 0:
            raise InputError(f"must be a finite time > 0 (us), got {x!r}", field=f"{path}[{k}]")


def check_curve(curve: StepCurve, path: str = "curve") -> None:
    """Validate a curve: grids of whole numbers increasing strictly, one finite positive
    time per grid point, ``max_batch >= 1``, ``kv_bytes_per_token > 0``.

    Raises:
        InputError: naming the field.
    """
    if not isinstance(curve, StepCurve):
        raise InputError(f"must be a step curve, got {curve!r}", field=path)
    _grid(curve.batch_grid, f"{path}.batchGrid")
    _grid(curve.context_grid, f"{path}.contextGrid")
    _grid(curve.prefill_grid, f"{path}.prefillGrid")
    if len(curve.decode_step_us) != len(curve.batch_grid):
        raise InputError(
            f"must have {len(curve.batch_grid)} rows (one per batchGrid point), "
            f"got {len(curve.decode_step_us)}",
            field=f"{path}.decodeStepUs",
        )
    for i, row in enumerate(curve.decode_step_us):
        _times(row, len(curve.context_grid), f"{path}.decodeStepUs[{i}]")
    _times(curve.prefill_us, len(curve.prefill_grid), f"{path}.prefillUs")
    mb = curve.max_batch
    if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= 1 << 24:
        raise InputError(
            f"must be a whole number in [1, 2^24], got {mb!r}", field=f"{path}.maxBatch"
        )
    kv = curve.kv_bytes_per_token
    if isinstance(kv, bool) or not isinstance(kv, int | float) or not math.isfinite(kv) or kv <= 0:
        raise InputError(
            f"must be a finite number of bytes > 0, got {kv!r}", field=f"{path}.kvBytesPerToken"
        )
    cap = curve.kv_capacity_tokens
    if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= 1 << 40:
        raise InputError(
            f"must be a whole number of tokens >= 0 (0 = maxBatch x the last context), got {cap!r}",
            field=f"{path}.kvCapacityTokens",
        )
