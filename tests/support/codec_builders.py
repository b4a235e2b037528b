"""Hypothesis builders for the codec round-trip tests: every dataclass field of a
NodeInventory and of a Plan gets a non-default value, and :func:`assert_every_field_set`
proves it, so a field added without codec support makes a round-trip test fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hypothesis import strategies as st

from policies.hardware.inventory import (
    GpuHealth,
    GpuInventory,
    NicInventory,
    NodeInventory,
    NvLinkInfo,
)
from policies.limits import MAX_EXPERTS, MAX_FLEET_GPUS, MAX_LAYER_EXPERTS, MAX_LAYERS
from policies.plan import ExpertSlot, GpuPlan, Plan, PlanEngine, PlanSummary, RuntimeHints

_EMPTY: tuple[Any, ...] = (None, 0, 0.0, "", (), False)

names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=8)
keys = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
small_ints = st.integers(1, 2**31 - 1)
numbers = st.floats(1e-3, 1e9, allow_nan=False, allow_infinity=False)


def assert_every_field_set(obj: Any, path: str = "") -> None:
    """Every field of ``obj`` (and of the dataclasses inside it) differs from its default;
    a required field differs from "empty" (None, 0, "", (), False, {}).

    Raises:
        AssertionError: naming the field left at its default.
    """
    if isinstance(obj, tuple | list):
        for i, x in enumerate(obj):
            assert_every_field_set(x, f"{path}[{i}]")
        return
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        where = f"{path}.{f.name}" if path else f.name
        if f.default is not dataclasses.MISSING:
            assert v != f.default, f"{where} is left at its default {f.default!r}"
        elif f.default_factory is not dataclasses.MISSING:
            assert v != f.default_factory(), f"{where} is left at its default"
        else:  # required: not "empty" either
            assert not (isinstance(v, Mapping) and not v), f"{where} is empty"
            assert v is True or v not in _EMPTY, f"{where} is empty: {v!r}"
        assert_every_field_set(v, where)


health = st.builds(
    GpuHealth,
    ecc_uncorrected_volatile=small_ints,
    retired_pages=small_ints,
    remapped_rows_pending=st.booleans(),
    remapped_rows_failed=st.booleans(),
    xid_errors=st.lists(small_ints, min_size=1, max_size=3).map(tuple),
)
nvlink = st.builds(
    NvLinkInfo, link=small_ints, active=st.just(True), generation=small_ints, remote_bus_id=names
)
gpu = st.builds(
    GpuInventory,
    index=small_ints,
    uuid=names,
    name=names,
    catalog_model=names,
    architecture=names,
    compute_capability=names,
    sms=small_ints,
    memory_bytes=st.integers(1, 2**62),
    hbm_bandwidth_gbytes_per_s=numbers,
    sm_clock_mhz=small_ints,
    power_limit_w=numbers,
    pci_bus_id=names,
    pcie_generation=small_ints,
    pcie_width=small_ints,
    nvlinks=st.lists(nvlink, min_size=1, max_size=2).map(tuple),
    nvlink_domain=names,
    measured=st.dictionaries(keys, numbers, min_size=1, max_size=3),
    health=health,
)
nic = st.builds(
    NicInventory,
    device=names,
    port=small_ints,
    rate_per_direction_gbits_per_s=numbers,
    state=names,
    link_layer=names,
    fabric=names.filter(lambda s: s != "default"),
    numa_node=st.integers(0, 2**31 - 1),
)
node_inventory = st.builds(
    NodeInventory,
    node=names,
    gpus=st.lists(gpu, min_size=1, max_size=2).map(tuple),
    nics=st.lists(nic, min_size=1, max_size=2).map(tuple),
    labels=st.dictionaries(keys, names, min_size=1, max_size=2),
    agent_version=names.filter(lambda s: s != "0.1.0"),
    simulated=st.just(True),
    discovered_by=st.lists(names, min_size=1, max_size=2).map(tuple),
    address=st.sampled_from(["10.0.0.7", "fd00::7", "gpu-7.example.net"]),
)

# Shares are multiples of 1/8: exact in the 9 decimals the plan codec keeps. Counts and
# indexes stay within the limits a plan document is read with (policies.limits).
experts_per_layer = st.integers(2, MAX_EXPERTS)


def _slot(num_experts: int) -> st.SearchStrategy[ExpertSlot]:
    return st.builds(
        ExpertSlot,
        expert=st.integers(1, num_experts - 1),
        share=st.integers(1, 8).map(lambda k: k / 8),
    )


def _layers(num_experts: int, count: int | None) -> st.SearchStrategy[Any]:
    rows = st.lists(_slot(num_experts), min_size=1, max_size=3).map(tuple)
    sizes = {"min_size": count, "max_size": count} if count else {"min_size": 1, "max_size": 2}
    return st.lists(rows, **sizes).map(tuple)  # type: ignore[arg-type]


hints = st.builds(
    RuntimeHints,
    ep_backend=names,
    deepep_mode=names,
    deepep_num_sms=small_ints,
    num_nvl_bytes=small_ints,
    num_rdma_bytes=small_ints,
    fp8_dispatch=st.just(True),
    attention_backend=names,
    decode_num_splits=small_ints,
)


def _gpu_plan(num_experts: int = MAX_EXPERTS, layers: int | None = None) -> Any:
    return st.builds(
        GpuPlan,
        gpu=names,
        node=names,
        model=names,
        attention_share=numbers,
        attention_heads=st.integers(1, 4096),
        dp_weight=numbers,
        experts=_layers(num_experts, layers),
        hints=hints,
        predicted_busy_us=numbers,
        memory_bytes=st.dictionaries(keys, numbers, min_size=1, max_size=3),
        attention_tp=st.integers(2, 8),
        dp_group=st.integers(1, MAX_FLEET_GPUS),
    )


gpu_plan = _gpu_plan()
summary = st.builds(
    PlanSummary,
    policy=names,
    form=names,
    step_time_us=numbers,
    tokens_per_s=numbers,
    lower_bound_us=numbers,
    gap=numbers,
    solve_s=numbers,
    feasible=st.just(True),
    imbalance=numbers,
    expert_moves=small_ints,
    solver=names,
    conditional_bound_us=numbers,
    bound_scope=names,
)
plan_engine = st.builds(
    PlanEngine,
    name=st.sampled_from(["sglang", "vllm", "trtllm"]),
    version=names,
    a2a_backend=st.sampled_from(["deepep", "none"]),
    dispatch=st.sampled_from(["static", "dynamic", "even"]),
    dp_balance=st.just("engine"),
    gpus_per_node=small_ints,
    why=names,
)


@st.composite
def _plan(draw: st.DrawFn) -> Plan:
    num_layers = draw(st.integers(1, MAX_LAYERS))
    moe = draw(st.lists(st.integers(0, num_layers - 1), min_size=1, max_size=3, unique=True))
    num_experts = draw(experts_per_layer)
    return draw(
        st.builds(
            Plan,
            id=names,
            version=small_ints,
            fleet=names,
            model=names,
            workload=st.dictionaries(keys, names, min_size=1, max_size=2),
            num_layers=st.just(num_layers),
            moe_layers=st.just(tuple(moe)),
            num_experts=st.just(num_experts),
            num_redundant=st.integers(1, MAX_LAYER_EXPERTS),
            slots_per_gpu=st.integers(1, MAX_EXPERTS),
            gpus=st.lists(_gpu_plan(num_experts, len(moe)), min_size=1, max_size=2).map(tuple),
            summary=summary,
            engine=plan_engine,
            violations=st.lists(names, min_size=1, max_size=2).map(tuple),
            notes=st.lists(names, min_size=1, max_size=2).map(tuple),
        )
    )


plan = _plan()
