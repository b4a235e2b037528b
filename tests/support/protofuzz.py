"""Hostile gRPC requests: Hypothesis strategies for every request message of the controller's
services.

The strategies are built from the message descriptors (proto/mixfleet/v1), so a field added
to a .proto is fuzzed without a change here. Each request is drawn either

* at random: every field unset or a value of its type, with the edge values of that type
  (int32/int64/uint64 bounds, NaN, infinities, -0.0, empty and long strings, bytes that are
  not UTF-8, JSON nested 100,000 deep, numbers beyond any wire type), or
* as a valid request of :class:`~support.fuzztarget.FuzzTarget` (a registered node, a
  deployment with a plan) with one to three of its fields replaced the same way, which
  reaches the checks behind the first ones.

Field names steer the strings and bytes: ``policy`` draws known policies as well as junk,
``*_json`` draws hostile and valid JSON documents, and so on (:data:`VOCABULARY`).

The controller they are sent to: :mod:`support.fuzztarget`. Used by tests/hostile and
bench/hostile.py.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st
from mixfleet.v1 import agent_pb2, engine_pb2, plan_pb2

from policies.hardware.fleet import parse_fleet
from policies.hardware.inventory import NodeInventory, inventory_from_node

MODULES = (agent_pb2, plan_pb2, engine_pb2)


def methods() -> list[MethodDescriptor]:
    """Every RPC of AgentService, PlanService and EngineService."""
    return [
        m for mod in MODULES for s in mod.DESCRIPTOR.services_by_name.values() for m in s.methods
    ]


def rpc_name(m: MethodDescriptor) -> str:
    """``Service/Method`` of an RPC."""
    return f"{m.containing_service.name}/{m.name}"


# --------------------------------------------------------------------------- documents


def small_fleet_doc(nodes: int = 3, gpus_per_node: int = 2) -> dict[str, Any]:
    """A Fleet document of ``nodes`` NVLink nodes (H100, H200, A100 in turn), one NIC each."""
    models = ["H100-SXM5-80GB", "H200-SXM-141GB", "A100-SXM4-80GB"]
    return {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "Fleet",
        "spec": {
            "nodes": [
                {
                    "name": f"n{i}",
                    "labels": {"rack": f"r{i % 2}"},
                    "gpus": [{"model": models[i % 3], "count": gpus_per_node}],
                    "nvlink": {"domain": f"n{i}", "per_gpu_bidir_gbytes_per_s": 900},
                    "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
                }
                for i in range(nodes)
            ]
        },
    }


def small_inventories() -> list[NodeInventory]:
    """Simulated inventories of :func:`small_fleet_doc`."""
    return [inventory_from_node(n) for n in parse_fleet(small_fleet_doc()).nodes]


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


MIXTRAL_CONFIG = {
    "model_type": "mixtral",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}

#: Bytes that every JSON field gets: broken, deep, huge, non-finite and wrong-typed.
HOSTILE_BYTES: tuple[bytes, ...] = (
    b"",
    b"\xff\xfe\x00\x01",
    b"{",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    b"1" * 5_000,
    b"NaN",
    b"[1e400]",
    b'"text"',
    b"null",
    b"[]",
    b"{}",
    _json({"model_type": "mixtral", "num_hidden_layers": 10**8, "num_local_experts": 10**6}),
    _json({**MIXTRAL_CONFIG, "num_hidden_layers": 2**31}),
    _json({**MIXTRAL_CONFIG, "num_local_experts": 4096, "num_hidden_layers": 1024}),
    _json({**MIXTRAL_CONFIG, "num_experts_per_tok": 9}),
    _json({**MIXTRAL_CONFIG, "head_dim": 0.5}),
    _json({**MIXTRAL_CONFIG, "model_type": "qwen3_moe", "mlp_only_layers": 5}),
    _json([[1.0] * 8] * 32),
    _json([[-1.0] * 8] * 32),
    _json([[1.0] * 3] * 2),
    _json({"logical_count": [[[1] * 8] * 32]}),
    _json({"logical_count": 7}),
    _json([[1, "x"]]),
)
#: Valid documents per JSON field, so that a mutation elsewhere is reached.
VALID_BYTES: dict[str, tuple[bytes, ...]] = {
    "fleet_json": (
        _json(small_fleet_doc()),
        _json(small_fleet_doc(1, 10**9)),
        _json(small_fleet_doc(20_000, 8)),
        _json({"spec": {"nodes": [{"name": "a", "gpus": [{"model": "H100", "count": 2**64}]}]}}),
        _json({"spec": {"nodes": [{"name": "a", "gpus": [{"model": "H100", "%s%n": 1}]}]}}),
    ),
    "model_config_json": (_json(MIXTRAL_CONFIG),),
    "load_json": (_json([[1.0] * 8] * 32),),
}

#: Strings per field name: the values that mean something, then junk.
VOCABULARY: dict[str, tuple[str, ...]] = {
    "node": ("n0", "n1", "ghost"),
    "name": ("mx", "fz", "n0", "ghost", "UPPER", "a" * 64),
    "deployment": ("mx", "fz", "ghost"),
    "model": ("mixtral-8x7b", "deepseek-v3", "qwen3-235b-a22b", "llama-3-8b", "nope"),
    "policy": ("greedy", "uniform", "eplb", "ilp", "simplex"),
    "policies": ("greedy", "uniform", "eplb", "ilp", "x"),
    "form": ("engine", "native", "other"),
    "phase": ("decode", "prefill", "both"),
    "kv_cache_dtype": ("bf16", "fp8", "int4"),
    "load": ("uniform", "measured", "synthetic:zipf:1.2:seed=3", "synthetic:zipf:-1", "zipf"),
    "layout": ("best", "group", "replicas", "x"),
    "preference": ("fastest", "max-batch", "x"),
    "format": ("sglang", "vllm", "trtllm", "x"),
    "a2a_backend": ("auto", "deepep", "none", "x"),
    "dispatch": ("auto", "static", "dynamic", "x"),
    "dp_balance": ("router", "engine", "x"),
    "additions": ("H100-SXM5-80GB", "B200", "x"),
    "model_name": ("H100-SXM5-80GB", "x"),
    "catalog_model": ("H100-SXM5-80GB", "A100-SXM4-80GB", "x"),
}
HOSTILE_TEXT = ("", " ", "%s%n", "../../etc/passwd", "\x00", "é\u202e", "a" * 5_000, "x.y[0]")

INT_EDGES = {
    32: (0, 1, -1, 2, 8, (1 << 31) - 1, -(1 << 31)),
    64: (0, 1, -1, (1 << 63) - 1, -(1 << 63), 1 << 40),
}
UINT_EDGES = {32: (0, 1, (1 << 32) - 1), 64: (0, 1, 7, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)}
FLOAT_EDGES = (0.0, -0.0, 0.5, 1.0, 60.0, -1.0, 1e308, 5e-324, math.nan, math.inf, -math.inf)

_T = FieldDescriptor
#: Descriptors as the installed protobuf runtime gives them (upb or Python classes).
Field = Any
Desc = Any
_INTS = {
    _T.TYPE_INT32: ("int", 32),
    _T.TYPE_SINT32: ("int", 32),
    _T.TYPE_SFIXED32: ("int", 32),
    _T.TYPE_INT64: ("int", 64),
    _T.TYPE_SINT64: ("int", 64),
    _T.TYPE_SFIXED64: ("int", 64),
    _T.TYPE_UINT32: ("uint", 32),
    _T.TYPE_FIXED32: ("uint", 32),
    _T.TYPE_UINT64: ("uint", 64),
    _T.TYPE_FIXED64: ("uint", 64),
}


# --------------------------------------------------------------------------- strategies


def scalar(field: Field) -> st.SearchStrategy[Any]:
    """Values of one non-message field: edge values of its type and random ones."""
    t = field.type
    if t in _INTS:
        sign, bits = _INTS[t]
        if sign == "int":
            lo, hi, edges = -(1 << (bits - 1)), (1 << (bits - 1)) - 1, INT_EDGES[bits]
        else:
            lo, hi, edges = 0, (1 << bits) - 1, UINT_EDGES[bits]
        return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(0, 300))
    if t in (_T.TYPE_DOUBLE, _T.TYPE_FLOAT):
        floats = st.floats(width=32 if t == _T.TYPE_FLOAT else 64)
        return st.one_of(st.sampled_from(FLOAT_EDGES), floats, st.floats(0.0, 1e4))
    if t == _T.TYPE_BOOL:
        return st.booleans()
    if t == _T.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-3, 40))
    if t == _T.TYPE_STRING:
        words = VOCABULARY.get(field.name, ())
        return st.one_of(
            *([st.sampled_from(words)] if words else []),
            st.sampled_from(HOSTILE_TEXT),
            st.text(max_size=24),
        )
    if t == _T.TYPE_BYTES:
        valid = VALID_BYTES.get(field.name, HOSTILE_BYTES[:1])
        return st.one_of(
            st.sampled_from(valid),
            json_mutations(json.loads(valid[0])) if field.name in VALID_BYTES else st.nothing(),
            st.sampled_from(HOSTILE_BYTES),
            st.binary(max_size=48),
        )
    raise AssertionError(f"no strategy for field type {t} ({field.full_name})")


#: JSON values a mutated document gets in place of one of its values.
JSON_EDGES: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    1,
    0.5,
    1e308,
    -1e308,
    (1 << 31),
    (1 << 63),
    (1 << 64) + 1,
    10**30,
    "",
    "x",
    "%s%n",
    [],
    {},
    [[]],
    {"a": {"b": {}}},
)


def _json_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths (keys and list indices) of every value in ``doc`` (lists: first 3 items)."""
    items = (
        doc.items()
        if isinstance(doc, dict)
        else enumerate(doc[:3])
        if isinstance(doc, list)
        else ()
    )
    for key, value in items:
        yield (*prefix, key)
        yield from _json_paths(value, (*prefix, key))


def json_mutations(doc: Any) -> st.SearchStrategy[bytes]:
    """``doc`` (a valid document) with one or two of its values replaced by
    :data:`JSON_EDGES` or random JSON scalars, encoded."""
    paths = list(_json_paths(doc))
    value = st.one_of(
        st.sampled_from(JSON_EDGES), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)
    )

    @st.composite
    def draw(data: st.DrawFn) -> bytes:
        out = json.loads(json.dumps(doc))
        for path in data(st.lists(st.sampled_from(paths), min_size=1, max_size=2)):
            holder = out
            try:
                for key in path[:-1]:
                    holder = holder[key]
                holder[path[-1]] = data(value)
            except (KeyError, IndexError, TypeError):  # an earlier change removed the path
                continue
        return json.dumps(out).encode()

    return draw()


def message_class(desc: Desc) -> type[Message]:
    """The generated class of a message descriptor."""
    return message_factory.GetMessageClass(desc)


def _is_map(field: Field) -> bool:
    t = field.message_type
    return t is not None and t.GetOptions().map_entry


def _field_value(field: Field, depth: int) -> st.SearchStrategy[Any]:
    """A value for ``field``: a list for a repeated field, a dict for a map."""
    if _is_map(field):
        key = scalar(field.message_type.fields_by_name["key"])
        value_field = field.message_type.fields_by_name["value"]
        return st.dictionaries(key, _single(value_field, depth), max_size=3)
    if field.is_repeated:
        return st.lists(_single(field, depth), max_size=4)
    return _single(field, depth)


def _single(field: Field, depth: int) -> st.SearchStrategy[Any]:
    if field.type == _T.TYPE_MESSAGE:
        return message(field.message_type, depth + 1)
    return scalar(field)


@functools.cache
def message(desc: Desc, depth: int = 0) -> st.SearchStrategy[Message]:
    """Random messages of ``desc``: each field unset or drawn (sub-messages 3 levels deep)."""
    cls = message_class(desc)
    if depth > 3:
        return st.just(cls())
    fields = {f.name: st.one_of(st.none(), _deferred(f, depth)) for f in desc.fields}
    return st.fixed_dictionaries(fields).map(lambda values: _build(cls, values))


def _deferred(field: Field, depth: int) -> st.SearchStrategy[Any]:
    """:func:`_field_value`, built when first drawn (messages nest into each other)."""
    return st.deferred(lambda: _field_value(field, depth))


def _build(cls: type[Message], values: dict[str, Any]) -> Message:
    msg = cls()
    for name, value in values.items():
        if value is not None:
            _assign(msg, msg.DESCRIPTOR.fields_by_name[name], value)
    return msg


def _assign(msg: Message, field: Field, value: Any) -> None:
    """Set ``field`` of ``msg`` to ``value`` (a list for repeated, a dict for maps)."""
    target: Any = getattr(msg, field.name)
    if _is_map(field):
        target.clear()
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        del target[:]
        if field.type == _T.TYPE_MESSAGE:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif field.type == _T.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def leaf_paths(
    desc: Desc, prefix: tuple[str, ...] = (), depth: int = 0
) -> Iterator[tuple[str, ...]]:
    """Paths of the fields of ``desc`` (sub-messages entered 2 levels deep)."""
    for f in desc.fields:
        path = (*prefix, f.name)
        yield path
        if f.type == _T.TYPE_MESSAGE and not _is_map(f) and not f.is_repeated and depth < 2:
            yield from leaf_paths(f.message_type, path, depth + 1)


def mutated(base: Message) -> st.SearchStrategy[Message]:
    """``base`` with one to three of its fields (at any depth) replaced by drawn values."""
    paths = list(leaf_paths(base.DESCRIPTOR))

    @st.composite
    def draw(data: st.DrawFn) -> Message:
        msg = type(base)()
        msg.CopyFrom(base)
        for path in data(st.lists(st.sampled_from(paths), min_size=1, max_size=3, unique=True)):
            holder: Any = msg
            for name in path[:-1]:
                holder = getattr(holder, name)
            field = holder.DESCRIPTOR.fields_by_name[path[-1]]
            _assign(holder, field, data(_field_value(field, 1)))
        return msg

    return draw()


def requests(m: MethodDescriptor, bases: dict[str, Message]) -> st.SearchStrategy[Message]:
    """Requests of one RPC: random, or a valid base with fields replaced (module docstring)."""
    random_ = message(m.input_type)
    base = bases.get(m.input_type.name)
    if base is None:
        return random_.map(bounded_solves)
    return st.one_of(random_, mutated(base), mutated(base)).map(bounded_solves)


#: RPCs that solve many times per request (batch sizes, contexts, tiers, node subsets).
MULTI_SOLVE = frozenset(
    {"AdviseTiersRequest", "AdviseBatchRequest", "AdviseContextRequest", "MinCostRequest"}
)


def bounded_solves(msg: Message) -> Message:
    """``msg`` with its solves bounded in time, every other field left as drawn:

    * where one ILP runs, its time limit is held to 1 s (0 would mean the 60 s default);
      refused values (negative, NaN, infinite) stay;
    * the RPCs of :data:`MULTI_SOLVE` solve with greedy instead of the ILP (each of their
      ILP solves starts a process pool: 10 s and more on 2 busy cores).
    """
    name = msg.DESCRIPTOR.name
    if name in MULTI_SOLVE:
        if name == "AdviseContextRequest":
            listed: Any = msg.policies  # type: ignore[attr-defined]
            chosen = [("greedy" if p == "ilp" else p) for p in listed] or ["greedy", "uniform"]
            del listed[:]
            listed.extend(chosen)
        for spec in _specs(msg):
            if spec.policy in ("", "ilp"):
                spec.policy = "greedy"
        return msg
    for spec in _specs(msg):
        v = spec.solver_time_limit_s
        if spec.policy in ("", "ilp") and (v == 0 or (math.isfinite(v) and v > 1)):
            spec.solver_time_limit_s = 1.0
    return msg


def _specs(msg: Message) -> list[Any]:
    return [
        getattr(msg, f.name)
        for f in msg.DESCRIPTOR.fields
        if f.message_type is not None
        and f.message_type.name == "DeploymentSpec"
        and not f.is_repeated
        and msg.HasField(f.name)
    ]


def request_batches(m: MethodDescriptor, bases: dict[str, Message]) -> st.SearchStrategy[Any]:
    """What one call of ``m`` sends: a request, or 1-3 of them for a client stream."""
    one = requests(m, bases)
    if m.client_streaming:
        return st.lists(one, min_size=1, max_size=3)
    return one
