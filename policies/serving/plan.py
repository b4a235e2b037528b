"""A serving plan: the engine instances that serve one deployment's traffic, grouped in
pools, and the router's share of the traffic for each pool.

A pool is either **aggregated** (``instances``: N identical instances doing prefill and
decode with chunked prefill) or **disaggregated** (``prefill`` and ``decode`` instance
groups, and the KV path between them). The serving simulator
(:mod:`policies.serving.simulate`) runs requests through it; the fleet planner writes one
per deployment.

Document form (JSON or YAML; ``examples/serving/``)::

    pools:
      - name: h200-agg
        share: 2                    # router weight (relative; shares need not sum to 1)
        instances: {count: 1, usdPerHour: 36.0, batchLimit: 64, chunkTokens: 8192,
                    curve: {...StepCurve document...}}
      - name: b200-pd
        share: 3
        prefill: {count: 1, usdPerHour: 48, chunkTokens: 16384, curve: {...}}
        decode: {count: 2, usdPerHour: 48, batchLimit: 256, curve: {...}}
        kvPath: {gbytesPerS: 50, latencyUs: 20}

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.errors import InputError
from policies.keys import check_keys
from policies.serving.curves import StepCurve, check_curve

DEFAULT_CHUNK_TOKENS = 8192
"""Chunked-prefill budget of an aggregated step, or prompt-token budget of one prefill
forward, tokens (SGLang's and vLLM's usual default)."""
MAX_INSTANCES = 1 << 20
"""Most instances of one group."""
MAX_POOLS = 4096
"""Most pools of one plan."""


@dataclass(frozen=True)
class InstanceGroup:
    """``count`` identical engine instances.

    Attributes:
        count: instances, >= 1.
        curve: the step times of one instance.
        batch_limit: most sequences one instance runs at once; 0 = ``curve.max_batch``.
        chunk_tokens: aggregated: most prompt tokens one step prefills (chunked prefill);
            prefill role: prompt-token budget of one batched prefill forward (a longer
            prompt runs alone). Tokens.
        usd_per_hour: price of one instance (all of its GPUs), USD per hour.
        label: what it runs on, for reports (``"2x H200 node, TP8 EP16"``).
    """

    count: int
    curve: StepCurve
    batch_limit: int = 0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    usd_per_hour: float = 0.0
    label: str = ""

    def slots(self) -> int:
        """Sequences one instance runs at once (``batch_limit`` or the curve's limit)."""
        return self.batch_limit or self.curve.max_batch


@dataclass(frozen=True)
class KvPath:
    """The path a request's KV cache takes from a prefill to a decode instance.

    Attributes:
        gbytes_per_s: bandwidth of the path out of one prefill instance, gigabytes (1e9
            bytes) per second; that instance's transfers share it, one after the other.
        latency_us: fixed cost of one transfer (setup, first byte), us; transfers overlap
            it.
    """

    gbytes_per_s: float
    latency_us: float = 0.0

    def transfer_us(self, nbytes: float) -> float:
        """Time to move ``nbytes`` bytes on an idle path, us: ``latency_us +``
        :meth:`send_us`."""
        return self.latency_us + self.send_us(nbytes)

    def send_us(self, nbytes: float) -> float:
        """Time ``nbytes`` bytes hold the path, us: ``nbytes / bandwidth``."""
        return nbytes / (self.gbytes_per_s * 1e3)


@dataclass(frozen=True)
class Pool:
    """One pool of a serving plan: aggregated instances, or prefill and decode instances.

    Attributes:
        name: pool name (unique in the plan).
        share: the router's weight for this pool (> 0; relative to the other pools').
        instances: the aggregated instances (None for a disaggregated pool).
        prefill: the prefill instances of a disaggregated pool.
        decode: the decode instances of a disaggregated pool.
        kv_path: the KV path from ``prefill`` to ``decode``.
    """

    name: str
    share: float
    instances: InstanceGroup | None = None
    prefill: InstanceGroup | None = None
    decode: InstanceGroup | None = None
    kv_path: KvPath | None = None

    @property
    def disaggregated(self) -> bool:
        """Whether prefill and decode run on different instances."""
        return self.instances is None

    def groups(self) -> tuple[InstanceGroup, ...]:
        """The pool's instance groups (one aggregated, or prefill then decode)."""
        if self.instances is not None:
            return (self.instances,)
        assert self.prefill is not None and self.decode is not None
        return (self.prefill, self.decode)

    def usd_per_hour(self) -> float:
        """Price of every instance of the pool, USD per hour."""
        return sum(g.count * g.usd_per_hour for g in self.groups())


@dataclass(frozen=True)
class ServingPlan:
    """The pools that serve one deployment.

    Attributes:
        pools: at least one; the router sends each pool its share of the requests.
    """

    pools: tuple[Pool, ...]

    def usd_per_hour(self) -> float:
        """Price of every instance of the plan, USD per hour."""
        return sum(p.usd_per_hour() for p in self.pools)

    def shares(self) -> tuple[float, ...]:
        """Each pool's fraction of the requests (shares normalised to sum to 1)."""
        total = sum(p.share for p in self.pools)
        return tuple(p.share / total for p in self.pools)


# ---------------------------------------------------------------------- validation


def _whole(v: Any, path: str, *, low: int, high: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise InputError(f"must be a whole number in [{low}, {high}], got {v!r}", field=path)
    return v


def _positive(v: Any, path: str, *, zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise InputError(f"must be a finite number, got {v!r}", field=path)
    if v < 0 or (v == 0 and not zero):
        raise InputError(f"must be {'>=' if zero else '>'} 0, got {v!r}", field=path)
    return float(v)


def check_group(group: InstanceGroup, path: str) -> None:
    """Validate an instance group.

    Raises:
        InputError: naming the field.
    """
    if not isinstance(group, InstanceGroup):
        raise InputError(f"must be an instance group, got {group!r}", field=path)
    _whole(group.count, f"{path}.count", low=1, high=MAX_INSTANCES)
    check_curve(group.curve, f"{path}.curve")
    _whole(group.batch_limit, f"{path}.batchLimit", low=0, high=1 << 24)
    _whole(group.chunk_tokens, f"{path}.chunkTokens", low=1, high=1 << 24)
    _positive(group.usd_per_hour, f"{path}.usdPerHour", zero=True)
    if group.slots() > group.curve.capacity_tokens():
        raise InputError(
            f"batch of {group.slots()} sequences cannot fit in {group.curve.capacity_tokens()} "
            "KV tokens. To fix: lower batchLimit or raise curve.kvCapacityTokens",
            field=f"{path}.batchLimit",
        )


def check_plan(plan: ServingPlan, path: str = "plan") -> None:
    """Validate a serving plan: at least one pool, unique names, shares > 0, each pool
    either aggregated or a prefill/decode pair with a KV path.

    Raises:
        InputError: naming the field (``plan.pools[1].kvPath.gbytesPerS`` ...).
    """
    if not isinstance(plan, ServingPlan) or not plan.pools:
        raise InputError("needs at least one pool", field=f"{path}.pools")
    if len(plan.pools) > MAX_POOLS:
        raise InputError(f"at most {MAX_POOLS} pools, got {len(plan.pools)}", field=f"{path}.pools")
    seen: set[str] = set()
    for i, pool in enumerate(plan.pools):
        at = f"{path}.pools[{i}]"
        if not isinstance(pool, Pool):
            raise InputError(f"must be a pool, got {pool!r}", field=at)
        if not isinstance(pool.name, str) or not pool.name:
            raise InputError("must be a non-empty string", field=f"{at}.name")
        if pool.name in seen:
            raise InputError(f"pool name {pool.name!r} appears twice", field=f"{at}.name")
        seen.add(pool.name)
        _positive(pool.share, f"{at}.share")
        pd = (pool.prefill, pool.decode, pool.kv_path)
        if pool.instances is not None:
            if any(x is not None for x in pd):
                raise InputError(
                    "gives both instances (aggregated) and prefill/decode/kvPath. To fix: "
                    "keep one of the two forms",
                    field=f"{at}.instances",
                )
            check_group(pool.instances, f"{at}.instances")
            continue
        for key, value in zip(("prefill", "decode", "kvPath"), pd, strict=True):
            if value is None:
                raise InputError(
                    "missing. To fix: give instances (aggregated) or prefill, decode and kvPath",
                    field=f"{at}.{key}",
                )
        assert pool.prefill is not None and pool.decode is not None and pool.kv_path is not None
        check_group(pool.prefill, f"{at}.prefill")
        check_group(pool.decode, f"{at}.decode")
        _positive(pool.kv_path.gbytes_per_s, f"{at}.kvPath.gbytesPerS")
        _positive(pool.kv_path.latency_us, f"{at}.kvPath.latencyUs", zero=True)


# ---------------------------------------------------------------------- documents

_PLAN_KEYS = ("pools",)
_POOL_KEYS = ("name", "share", "instances", "prefill", "decode", "kvPath")
_GROUP_KEYS = ("count", "curve", "batchLimit", "chunkTokens", "usdPerHour", "label")
_PATH_KEYS = ("gbytesPerS", "latencyUs")


def _mapping(doc: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise InputError(f"must be a mapping, got {type(doc).__name__}", field=path)
    return doc


def group_from_doc(doc: Any, path: str) -> InstanceGroup:
    """An instance group of its document.

    Raises:
        InputError: naming the field.
    """
    doc = _mapping(doc, path)
    check_keys(doc, _GROUP_KEYS, path)
    for key in ("count", "curve"):
        if key not in doc:
            raise InputError("missing", field=f"{path}.{key}")
    label = doc.get("label", "")
    if not isinstance(label, str):
        raise InputError(f"must be a string, got {label!r}", field=f"{path}.label")
    group = InstanceGroup(
        count=doc["count"],
        curve=StepCurve.from_doc(doc["curve"], f"{path}.curve"),
        batch_limit=doc.get("batchLimit", 0),
        chunk_tokens=doc.get("chunkTokens", DEFAULT_CHUNK_TOKENS),
        usd_per_hour=doc.get("usdPerHour", 0.0),
        label=label,
    )
    check_group(group, path)
    return group


def group_to_doc(group: InstanceGroup) -> dict[str, Any]:
    """The document of an instance group (inverse of :func:`group_from_doc`)."""
    doc: dict[str, Any] = {"count": group.count}
    if group.label:
        doc["label"] = group.label
    if group.batch_limit:
        doc["batchLimit"] = group.batch_limit
    doc["chunkTokens"] = group.chunk_tokens
    doc["usdPerHour"] = group.usd_per_hour
    doc["curve"] = group.curve.to_doc()
    return doc


def plan_from_doc(doc: Any, path: str = "plan") -> ServingPlan:
    """A validated serving plan of its document (the module docstring shows the form).

    Raises:
        InputError: naming the field.
    """
    doc = _mapping(doc, path)
    check_keys(doc, _PLAN_KEYS, path)
    raw = doc.get("pools")
    if not isinstance(raw, list) or not raw:
        raise InputError("must be a non-empty list of pools", field=f"{path}.pools")
    pools = []
    for i, p in enumerate(raw):
        at = f"{path}.pools[{i}]"
        p = _mapping(p, at)
        check_keys(p, _POOL_KEYS, at)
        kv = None
        if p.get("kvPath") is not None:
            k = _mapping(p["kvPath"], f"{at}.kvPath")
            check_keys(k, _PATH_KEYS, f"{at}.kvPath")
            if "gbytesPerS" not in k:
                raise InputError("missing", field=f"{at}.kvPath.gbytesPerS")
            kv = KvPath(gbytes_per_s=k["gbytesPerS"], latency_us=k.get("latencyUs", 0.0))

        def group(key: str, p: Mapping[str, Any] = p, at: str = at) -> InstanceGroup | None:
            return None if p.get(key) is None else group_from_doc(p[key], f"{at}.{key}")

        pools.append(
            Pool(
                name=p.get("name", ""),
                share=p.get("share", 1.0),
                instances=group("instances"),
                prefill=group("prefill"),
                decode=group("decode"),
                kv_path=kv,
            )
        )
    plan = ServingPlan(pools=tuple(pools))
    check_plan(plan, path)
    return plan


def plan_to_doc(plan: ServingPlan) -> dict[str, Any]:
    """The document of a serving plan (inverse of :func:`plan_from_doc`)."""
    pools = []
    for p in plan.pools:
        doc: dict[str, Any] = {"name": p.name, "share": p.share}
        if p.instances is not None:
            doc["instances"] = group_to_doc(p.instances)
        else:
            assert p.prefill is not None and p.decode is not None and p.kv_path is not None
            doc["prefill"] = group_to_doc(p.prefill)
            doc["decode"] = group_to_doc(p.decode)
            doc["kvPath"] = {
                "gbytesPerS": p.kv_path.gbytes_per_s,
                "latencyUs": p.kv_path.latency_us,
            }
        pools.append(doc)
    return {"pools": pools}
