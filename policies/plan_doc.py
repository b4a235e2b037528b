"""Reading a plan document (:meth:`policies.plan.Plan.to_dict`'s JSON, from a file or a
store row): :func:`plan_from_dict` for a whole plan, :func:`gpu_plan_from_dict` for one GPU
of a plan or of a node's assignment.

Re-exported by :mod:`policies.plan`, the plans' front door; import from there.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any

from policies.errors import InputError
from policies.keys import check_keys
from policies.limits import (
    MAX_ABS_INTEGER,
    MAX_EXPERTS,
    MAX_FLEET_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_LAYER_EXPERTS,
    MAX_LAYERS,
    MAX_VERSION,
    bounded_int,
    key_path,
)
from policies.plan_types import (
    PLAN_SCHEMA_VERSION,
    ExpertSlot,
    GpuPlan,
    Plan,
    PlanEngine,
    PlanSummary,
    RuntimeHints,
)


def _f(d: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in d:
        raise InputError(f"missing field {key!r}", field=path)
    return d[key]


# ----------------------------------------------------------------- reading a plan document
# A plan document comes from a file or a store row, so every field and nesting level is
# checked before anything is sized by it (the limits of policies.limits, as for a model
# config): a count sizes a table, a string where a number belongs fails late, a GPU whose
# layers disagree with the plan's indexes past its end.


#: What a list of the document may be (JSON and YAML give lists; Plan.to_dict keeps tuples).
_SEQ = (list, tuple)


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise InputError(f"must be a string, got {v!r:.60}", field=path)
    return v


def _num(v: Any, path: str) -> float:
    """A finite number (an integer is one; a boolean is not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"must be a number, got {v!r:.60}", field=path)
    x = float(v) if not isinstance(v, int) or abs(v) <= MAX_ABS_INTEGER else math.inf
    if not math.isfinite(x):
        raise InputError(f"must be a finite number, got {v!r:.60}", field=path)
    return x


def _int(v: Any, path: str) -> int:
    return bounded_int(v, path, minimum=-MAX_ABS_INTEGER, maximum=MAX_ABS_INTEGER)


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise InputError(f"must be true or false, got {v!r:.60}", field=path)
    return v


_SCALARS = {"str": _str, "float": _num, "int": _int, "bool": _bool}


def _typed(cls: type, doc: Any, path: str) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` from the mapping ``doc``, each checked against its
    annotation (``str``, ``int``, ``float``, ``bool``, optionally ``| None``); fields with a
    default may be left out; unknown keys are refused.

    Raises:
        InputError: naming the field.
    """
    if not isinstance(doc, Mapping):
        raise InputError(f"must be an object, got {doc!r:.60}", field=path)
    known = fields(cls)
    check_keys(doc, {f.name for f in known}, path)
    out: dict[str, Any] = {}
    for f in known:
        where = f"{path}.{f.name}"
        if f.name not in doc:
            if f.default is MISSING and f.default_factory is MISSING:
                raise InputError(f"missing field {f.name!r}", field=path)
            continue
        v = doc[f.name]
        kind = str(f.type)
        if kind.endswith(" | None"):
            if v is None:
                out[f.name] = None
                continue
            kind = kind.removesuffix(" | None")
        out[f.name] = _SCALARS[kind](v, where)
    return out


def _slots(layers: Any, path: str, num_experts: int) -> tuple[tuple[ExpertSlot, ...], ...]:
    """A GPU's ``experts``: per MoE layer, ``[expert, share]`` pairs with experts below
    ``num_experts`` and finite shares."""
    if not isinstance(layers, _SEQ):
        raise InputError(f"must be a list of MoE layers, got {layers!r:.60}", field=path)
    out = []
    for li, layer in enumerate(layers):
        if not isinstance(layer, _SEQ) or len(layer) > MAX_EXPERTS:
            raise InputError(
                f"must be a list of at most {MAX_EXPERTS:,} [expert, share] slots, got "
                f"{f'{len(layer):,} slots' if isinstance(layer, _SEQ) else repr(layer)[:60]}",
                field=f"{path}[{li}]",
            )
        row = []
        for si, slot in enumerate(layer):
            if not isinstance(slot, _SEQ) or len(slot) != 2:
                raise InputError(
                    f"must be an [expert, share] pair, got {slot!r:.60}",
                    field=f"{path}[{li}][{si}]",
                )
            e, share = slot
            if type(e) is not int or not 0 <= e < num_experts:
                raise InputError(
                    f"expert must be an integer from 0 to {num_experts - 1:,} (the plan's "
                    f"num_experts - 1), got {e!r:.60}",
                    field=f"{path}[{li}][{si}]",
                )
            row.append(ExpertSlot(e, _num(share, f"{path}[{li}][{si}] share")))
        out.append(tuple(row))
    return tuple(out)


def gpu_plan_from_dict(
    g: Any, path: str, *, num_experts: int = MAX_EXPERTS, moe_layers: int | None = None
) -> GpuPlan:
    """The one decoder of a :class:`GpuPlan` (:func:`gpu_plan_to_dict`'s form), used for
    whole plans and for node assignments alike.

    ``predicted_busy_us`` and ``memory_bytes`` may be omitted (0 and empty: assignments
    written before they were sent), and ``attention_tp`` and ``dp_group`` (1 and None: plans
    from before tensor-parallel attention); every other field is required. Every field is
    checked (type, range; see :mod:`policies.limits`).

    Args:
        num_experts: experts per MoE layer of the plan (slots name experts below it).
        moe_layers: MoE layers of the plan (the GPU must list exactly that many); None:
            any number up to :data:`~policies.limits.MAX_LAYERS`.

    Raises:
        InputError: ``field`` is ``path`` plus the missing or malformed key.
    """
    if not isinstance(g, Mapping):
        raise InputError(
            f"missing fields: a GPU entry is a JSON object with gpu, node, model and the rest "
            f"(malformed: got {type(g).__name__} {g!r:.40})",
            field=path,
        )
    hints = RuntimeHints(**_typed(RuntimeHints, _f(g, "hints", path), f"{path}.hints"))
    heads = g.get("attention_heads")
    if heads is not None:
        heads = bounded_int(heads, f"{path}.attention_heads", minimum=0, maximum=1 << 24)
    tp = bounded_int(g.get("attention_tp", 1), f"{path}.attention_tp", maximum=MAX_GPUS_PER_NODE)
    group = g.get("dp_group")
    if group is not None:
        group = bounded_int(group, f"{path}.dp_group", minimum=0, maximum=MAX_FLEET_GPUS)
    memory = g.get("memory_bytes", {})
    if not isinstance(memory, Mapping):
        raise InputError(f"must be an object, got {memory!r:.60}", field=f"{path}.memory_bytes")
    layers = _f(g, "experts", path)
    count = len(layers) if isinstance(layers, _SEQ) else 0
    if (moe_layers is not None and count != moe_layers) or count > MAX_LAYERS:
        want = (
            f"{moe_layers} (the plan's MoE layers)"
            if moe_layers is not None
            else f"at most {MAX_LAYERS}"
        )
        raise InputError(f"lists {count} MoE layers, must be {want}", field=f"{path}.experts")
    return GpuPlan(
        gpu=_str(_f(g, "gpu", path), f"{path}.gpu"),
        node=_str(_f(g, "node", path), f"{path}.node"),
        model=_str(_f(g, "model", path), f"{path}.model"),
        attention_share=_num(_f(g, "attention_share", path), f"{path}.attention_share"),
        attention_heads=heads,
        dp_weight=_num(_f(g, "dp_weight", path), f"{path}.dp_weight"),
        experts=_slots(layers, f"{path}.experts", num_experts),
        hints=hints,
        predicted_busy_us=_num(g.get("predicted_busy_us", 0.0), f"{path}.predicted_busy_us"),
        memory_bytes={
            _str(k, f"{path}.memory_bytes"): _num(v, key_path(f"{path}.memory_bytes", k))
            for k, v in memory.items()
        },
        attention_tp=tp,
        dp_group=group,
    )


def _strings(v: Any, path: str) -> tuple[str, ...]:
    if not isinstance(v, _SEQ):
        raise InputError(f"must be a list of strings, got {v!r:.60}", field=path)
    return tuple(_str(x, f"{path}[{i}]") for i, x in enumerate(v))


def _gpus_field(d: Mapping[str, Any]) -> Sequence[Any]:
    """The plan's ``gpus`` list, each entry's shape checked before the counts that size it."""
    gpus = _f(d, "gpus", "plan")
    if not isinstance(gpus, _SEQ) or not 0 < len(gpus) <= MAX_FLEET_GPUS:
        raise InputError(
            f"must be a list of 1 to {MAX_FLEET_GPUS:,} GPU entries, got "
            f"{f'{len(gpus):,}' if isinstance(gpus, _SEQ) else repr(gpus)[:60]}",
            field="gpus",
        )
    for i, g in enumerate(gpus):  # the shape of each entry before the counts that size it
        if not isinstance(g, Mapping):
            gpu_plan_from_dict(g, f"gpus[{i}]")
    return gpus


def _layers_and_experts(d: Mapping[str, Any]) -> tuple[int, tuple[int, ...], int]:
    """``(num_layers, moe_layers, num_experts)`` of a plan document, within the limits."""
    num_layers = bounded_int(_f(d, "num_layers", "plan"), "num_layers", maximum=MAX_LAYERS)
    moe = _f(d, "moe_layers", "plan")
    if not isinstance(moe, _SEQ) or len(moe) > num_layers:
        raise InputError(
            f"must be a list of at most num_layers ({num_layers}) layer indexes, got "
            f"{f'{len(moe):,} entries' if isinstance(moe, _SEQ) else repr(moe)[:60]}",
            field="moe_layers",
        )
    moe_layers = tuple(
        bounded_int(x, f"moe_layers[{i}]", minimum=0, maximum=num_layers - 1)
        for i, x in enumerate(moe)
    )
    if len(set(moe_layers)) != len(moe_layers):
        raise InputError("lists a layer twice", field="moe_layers")
    num_experts = bounded_int(
        _f(d, "num_experts", "plan"), "num_experts", minimum=0, maximum=MAX_EXPERTS
    )
    if len(moe_layers) * num_experts > MAX_LAYER_EXPERTS:
        raise InputError(
            f"{len(moe_layers)} MoE layers x {num_experts} experts = "
            f"{len(moe_layers) * num_experts:,} (layer, expert) pairs, over the limit of "
            f"{MAX_LAYER_EXPERTS:,}",
            field="num_experts",
        )
    return num_layers, moe_layers, num_experts


def _workload_field(d: Mapping[str, Any]) -> dict[str, Any]:
    """The plan's ``workload``: names to strings, numbers or null."""
    workload = _f(d, "workload", "plan")
    if not isinstance(workload, Mapping) or not all(
        isinstance(k, str) and (v is None or isinstance(v, (str, int, float)))
        for k, v in workload.items()
    ):
        raise InputError(
            f"must be an object of names to strings or numbers, got {workload!r:.100}",
            field="workload",
        )
    return dict(workload)


def plan_from_dict(d: Any) -> Plan:
    """Rebuild a :class:`Plan` from :meth:`Plan.to_dict` output, checking every field and
    nesting level (types, ranges, the limits of :mod:`policies.limits`: at most
    :data:`~policies.limits.MAX_EXPERTS` experts and :data:`~policies.limits.MAX_LAYERS`
    layers, every GPU listing every MoE layer, slots naming experts of the plan).

    Raises:
        InputError: not a plan document, or a field is missing or malformed (naming it).
    """
    if not isinstance(d, Mapping):
        raise InputError("a plan must be a JSON object", field="plan")
    if d.get("schema_version") != PLAN_SCHEMA_VERSION:
        raise InputError(
            f"unsupported plan schema_version {d.get('schema_version')!r:.60}; this mixfleet "
            f"reads {PLAN_SCHEMA_VERSION}. To fix: re-solve with this version",
            field="schema_version",
        )
    check_keys(d, {*(f.name for f in fields(Plan)), "schema_version"}, "", what="plan field")
    gpus = _gpus_field(d)
    num_layers, moe_layers, num_experts = _layers_and_experts(d)
    slots = d.get("slots_per_gpu")
    if slots is not None:
        slots = bounded_int(slots, "slots_per_gpu", maximum=MAX_EXPERTS)
    gpu_keys = {f.name for f in fields(GpuPlan)}
    parts = []
    for i, g in enumerate(gpus):
        if isinstance(g, Mapping):
            check_keys(g, gpu_keys, f"gpus[{i}]", what="GPU field")
        parts.append(
            gpu_plan_from_dict(g, f"gpus[{i}]", num_experts=num_experts, moe_layers=len(moe_layers))
        )
    workload = _workload_field(d)
    return Plan(
        id=_str(_f(d, "id", "plan"), "id"),
        version=bounded_int(_f(d, "version", "plan"), "version", minimum=0, maximum=MAX_VERSION),
        fleet=_str(_f(d, "fleet", "plan"), "fleet"),
        model=_str(_f(d, "model", "plan"), "model"),
        workload=workload,
        num_layers=num_layers,
        moe_layers=moe_layers,
        num_experts=num_experts,
        num_redundant=bounded_int(
            _f(d, "num_redundant", "plan"), "num_redundant", minimum=0, maximum=MAX_LAYER_EXPERTS
        ),
        slots_per_gpu=slots,
        gpus=tuple(parts),
        summary=PlanSummary(**_typed(PlanSummary, _f(d, "summary", "plan"), "summary")),
        violations=_strings(d.get("violations", []), "violations"),
        notes=_strings(d.get("notes", []), "notes"),
        engine=PlanEngine(**_typed(PlanEngine, d.get("engine", {}), "engine")),
    )
