"""The NVML recording format and the inventory read from it.

A recording keeps every NVML answer of a discovery per call (the keys ``K_*``; a call that
raised is recorded as ``{"error": "NVMLError_..."}`` and read back as :class:`Failed`),
as in ``tests/fixtures/nvml/h200x2.json``. :func:`inventory_from_recording` turns one into
a :class:`NodeInventory`: identity, HBM bandwidth and SMs (cross-checked with the GPU
catalog), NVLinks and the NVLink domains (GPUs joined directly or through an NVSwitch, or
sharing an NVL72 fabric clique), health. Live discovery (:mod:`agents.discovery.nvml`)
and the replay (:mod:`support.nvml_replay`) both speak this format.

Units: bandwidth GB/s (1e9 B/s), clocks MHz, memory bytes, power W.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.errors import InputError
from policies.hardware.catalog import lookup
from policies.hardware.inventory import (
    NVML_NVLINK_VERSION_TO_GENERATION,
    GpuHealth,
    GpuInventory,
    NodeInventory,
    NvLinkInfo,
)

#: nvmlDeviceGetArchitecture values (nvml.h ``NVML_DEVICE_ARCH_*``).
NVML_ARCHITECTURES = {
    2: "kepler",
    3: "maxwell",
    4: "pascal",
    5: "volta",
    6: "turing",
    7: "ampere",
    8: "ada",
    9: "hopper",
    10: "blackwell",
}
#: FP32 CUDA cores per SM by compute capability (GA100 has 64, the other Ampere chips 128).
CORES_PER_SM = {
    (6, 0): 64,
    (6, 1): 128,
    (7, 0): 64,
    (7, 2): 64,
    (7, 5): 64,
    (8, 0): 64,
    (8, 6): 128,
    (8, 7): 128,
    (8, 9): 128,
    (9, 0): 128,
    (10, 0): 128,
    (10, 3): 128,
    (12, 0): 128,
}
#: Remote PCI bus id NVML reports for a link that ends at an NVSwitch.
NVSWITCH_BUS_ID = "FFFFFFFF:FF:FF.0"

# NVML return codes (nvml.h) this module tells apart.
ERR_INVALID_ARGUMENT = 2
ERR_NOT_SUPPORTED = 3
ERR_NO_PERMISSION = 4
ERR_DRIVER_NOT_LOADED = 9
ERR_TIMEOUT = 10
ERR_LIBRARY_NOT_FOUND = 12
ERR_FUNCTION_NOT_FOUND = 13
ERROR_NAMES = {
    1: "NVMLError_Uninitialized",
    ERR_INVALID_ARGUMENT: "NVMLError_InvalidArgument",
    ERR_NOT_SUPPORTED: "NVMLError_NotSupported",
    ERR_NO_PERMISSION: "NVMLError_NoPermission",
    6: "NVMLError_NotFound",
    ERR_DRIVER_NOT_LOADED: "NVMLError_DriverNotLoaded",
    ERR_TIMEOUT: "NVMLError_Timeout",
    ERR_LIBRARY_NOT_FOUND: "NVMLError_LibraryNotFound",
    ERR_FUNCTION_NOT_FOUND: "NVMLError_FunctionNotFound",
    15: "NVMLError_GPUIsLost",
    999: "NVMLError_Unknown",
}
ERROR_CODES = {name: code for code, name in ERROR_NAMES.items()}

# Keys of a recording (the format of tests/fixtures/nvml/h200x2.json).
K_NAME = "nvmlDeviceGetName"
K_UUID = "nvmlDeviceGetUUID"
K_ARCH = "nvmlDeviceGetArchitecture"
K_CC = "nvmlDeviceGetCudaComputeCapability"
K_MEM = "nvmlDeviceGetMemoryInfo.total"
K_BUS_WIDTH = "nvmlDeviceGetMemoryBusWidth"
K_MEM_CLOCK = "nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)"
K_SM_CLOCK = "nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM)"
K_CORES = "nvmlDeviceGetNumGpuCores"
K_POWER = "nvmlDeviceGetPowerManagementLimit"
K_BUS_ID = "nvmlDeviceGetPciInfo.busId"
K_NUMA = "nvmlDeviceGetNumaNodeId"
K_MIG = "nvmlDeviceGetMigMode"
K_PCIE_GEN = "nvmlDeviceGetMaxPcieLinkGeneration"
K_PCIE_WIDTH = "nvmlDeviceGetMaxPcieLinkWidth"
K_ECC = "nvmlDeviceGetTotalEccErrors(NVML_MEMORY_ERROR_TYPE_UNCORRECTED,NVML_VOLATILE_ECC)"
K_RETIRED = "nvmlDeviceGetRetiredPages(NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR).count"
K_REMAPPED = "nvmlDeviceGetRemappedRows"
K_FABRIC = "nvmlDeviceGetGpuFabricInfoV"
K_LINK_STATE = "nvmlDeviceGetNvLinkState"
K_LINK_VERSION = "nvmlDeviceGetNvLinkVersion"
K_LINK_REMOTE = "nvmlDeviceGetNvLinkRemotePciInfo.busId"
K_LINK_SPEED = "nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_GET_SPEED)"
K_TOPO = "nvmlDeviceGetTopologyCommonAncestor"

FI_DEV_NVLINK_GET_SPEED = 164  # nvml.h: NVLink speed in MB/s, scope = link
FABRIC_STATE_COMPLETED = 3


@dataclass(frozen=True)
class Failed:
    """An NVML call that raised: ``error`` is the pynvml class name
    (``NVMLError_NotSupported``)."""

    error: str


NOT_SUPPORTED = Failed("NVMLError_NotSupported")


def normalize_bus_id(bus_id: str | bytes) -> str:
    """PCI bus id as ``DDDDDDDD:BB:DD.F`` upper case (NVML prints 4- or 8-digit domains)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    text = text.strip().upper()
    parts = text.split(":")
    if len(parts) == 3:
        return f"{parts[0].rjust(8, '0')[-8:]}:{parts[1]}:{parts[2]}"
    return text


def as_text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _num(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _value(raw: Mapping[str, Any], key: str) -> Any:
    """The recorded answer, or :class:`Failed` for an error or an unrecorded call."""
    if key not in raw:
        return NOT_SUPPORTED
    v = raw[key]
    if isinstance(v, Mapping) and "error" in v and len(v) == 1:
        return Failed(str(v["error"]))
    return v


def inventory_from_recording(
    recording: Mapping[str, Any],
    *,
    node: str,
    labels: Mapping[str, str] | None = None,
    xid_errors: Mapping[int, tuple[int, ...]] | None = None,
    notes: list[str] | None = None,
) -> NodeInventory:
    """Build the node inventory from NVML answers (a live probe or a recording).

    Args:
        recording: ``{"gpus": [{<call>: value | {"error": name}, "nvlinks": [...]}]}``.
        node: node name.
        labels: node labels.
        xid_errors: XIDs per GPU index since the previous report.
        notes: list that receives remarks (catalog fallbacks, mismatches).
    """
    notes = notes if notes is not None else []
    xid_errors = xid_errors or {}
    raw_gpus: list[Mapping[str, Any]] = list(recording.get("gpus", []))
    partial: list[GpuInventory] = []
    for raw in raw_gpus:
        partial.append(_gpu_from_raw(raw, notes, xid_errors.get(int(raw["index"]), ())))
    domains = _nvlink_domains(node, partial, raw_gpus)
    gpus = tuple(
        GpuInventory(**{**_fields(g), "nvlink_domain": domains.get(g.index)}) for g in partial
    )
    return NodeInventory(
        node=node,
        gpus=gpus,
        labels=dict(labels or {}),
        discovered_by=("nvml",),
    )


def _fields(g: GpuInventory) -> dict[str, Any]:
    return {name: getattr(g, name) for name in GpuInventory.__dataclass_fields__}


def _gpu_from_raw(raw: Mapping[str, Any], notes: list[str], xids: tuple[int, ...]) -> GpuInventory:
    index = int(raw["index"])
    name = _value(raw, K_NAME)
    name = name if isinstance(name, str) else f"unknown-gpu-{index}"
    spec = None
    try:
        spec = lookup(name)
    except InputError:
        notes.append(f"gpu{index}: {name!r} is not in the GPU catalog; planning needs figures")
    arch_raw = _num(_value(raw, K_ARCH))
    architecture = NVML_ARCHITECTURES.get(arch_raw, "") if arch_raw is not None else ""
    if not architecture and spec is not None:
        architecture = spec.architecture
    cc_raw = _value(raw, K_CC)
    cc: tuple[int, int] | None = None
    if isinstance(cc_raw, list | tuple) and len(cc_raw) == 2:
        cc = (int(cc_raw[0]), int(cc_raw[1]))
    compute_capability = f"{cc[0]}.{cc[1]}" if cc else (spec.compute_capability if spec else "")
    sms = _sm_count(index, _num(_value(raw, K_CORES)), cc, spec.sms if spec else None, notes)
    memory = _num(_value(raw, K_MEM)) or (int(spec.memory_gib * 2**30) if spec else 0)
    bus_width = _num(_value(raw, K_BUS_WIDTH))
    mem_clock = _num(_value(raw, K_MEM_CLOCK))
    if bus_width and mem_clock:
        hbm_gbytes_per_s = bus_width / 8 * mem_clock * 1e6 * 2 / 1e9
    else:
        hbm_gbytes_per_s = spec.hbm_bandwidth_gbytes_per_s if spec else 0.0
        notes.append(f"gpu{index}: memory bus width or clock unknown; HBM bandwidth from catalog")
    power = _num(_value(raw, K_POWER))
    uuid = _value(raw, K_UUID)
    bus_id = _value(raw, K_BUS_ID)
    return GpuInventory(
        index=index,
        uuid=uuid if isinstance(uuid, str) else f"GPU-unknown-{index}",
        name=name,
        catalog_model=spec.model if spec else "",
        architecture=architecture,
        compute_capability=compute_capability,
        sms=sms,
        memory_bytes=memory,
        hbm_bandwidth_gbytes_per_s=hbm_gbytes_per_s,
        sm_clock_mhz=_num(_value(raw, K_SM_CLOCK)) or 0,
        power_limit_w=power / 1000.0 if power else 0.0,
        pci_bus_id=bus_id if isinstance(bus_id, str) else "",
        pcie_generation=_num(_value(raw, K_PCIE_GEN)) or 0,
        pcie_width=_num(_value(raw, K_PCIE_WIDTH)) or 0,
        nvlinks=_links(raw),
        health=_health(raw, xids),
    )


def _sm_count(
    index: int,
    cores: int | None,
    cc: tuple[int, int] | None,
    catalog_sms: int | None,
    notes: list[str],
) -> int:
    """SMs from CUDA cores / cores per SM, checked against the catalog entry."""
    per_sm = CORES_PER_SM.get(cc) if cc else None
    derived = cores // per_sm if cores and per_sm and cores % per_sm == 0 else None
    if derived is None:
        if catalog_sms is None:
            notes.append(f"gpu{index}: SM count unknown (no core count, not in catalog)")
            return 0
        notes.append(f"gpu{index}: SM count from catalog ({catalog_sms})")
        return catalog_sms
    if catalog_sms is not None and derived != catalog_sms:
        notes.append(
            f"gpu{index}: NVML gives {derived} SMs ({cores} cores / {per_sm}), catalog "
            f"{catalog_sms}; using {derived}"
        )
    return derived


def _links(raw: Mapping[str, Any]) -> tuple[NvLinkInfo, ...]:
    out: list[NvLinkInfo] = []
    for entry in raw.get("nvlinks", []):
        state = _value(entry, K_LINK_STATE)
        if isinstance(state, Failed):
            continue
        version = _num(_value(entry, K_LINK_VERSION))
        generation = NVML_NVLINK_VERSION_TO_GENERATION.get(version, 0) if version else 0
        remote = _value(entry, K_LINK_REMOTE)
        out.append(
            NvLinkInfo(
                link=int(entry["link"]),
                active=state == 1,
                generation=generation,
                remote_bus_id=remote if isinstance(remote, str) else "",
            )
        )
    return tuple(out)


def _health(raw: Mapping[str, Any], xids: tuple[int, ...]) -> GpuHealth:
    ecc = _num(_value(raw, K_ECC))
    retired = _num(_value(raw, K_RETIRED))
    remapped = _value(raw, K_REMAPPED)
    pending = failed = None
    if isinstance(remapped, list | tuple) and len(remapped) == 4:
        pending, failed = bool(remapped[2]), bool(remapped[3])
    return GpuHealth(
        ecc_uncorrected_volatile=ecc,
        retired_pages=retired,
        remapped_rows_pending=pending,
        remapped_rows_failed=failed,
        xid_errors=xids,
    )


def _nvlink_domains(
    node: str, gpus: Sequence[GpuInventory], raw_gpus: Sequence[Mapping[str, Any]]
) -> dict[int, str]:
    """NVLink domain per GPU index.

    A GPU with a completed fabric registration and a non-zero cluster UUID belongs to the
    multi-node domain ``<clusterUuid>/<cliqueId>``. Otherwise GPUs joined by active NVLinks
    inside the node - directly (the remote bus id is another GPU's) or through an NVSwitch
    (``FFFFFFFF:FF:FF.0``) - form connected components: one component is named after the
    node, several get ``<node>-nvl<k>``. GPUs with no active NVLink get no domain.
    """
    out: dict[int, str] = {}
    local: list[GpuInventory] = []
    for g, raw in zip(gpus, raw_gpus, strict=True):
        fabric = _value(raw, K_FABRIC)
        if (
            isinstance(fabric, Mapping)
            and fabric.get("state") == FABRIC_STATE_COMPLETED
            and fabric.get("clusterUuid", "").replace("0", "").replace("-", "")
        ):
            out[g.index] = f"{fabric['clusterUuid']}/{fabric['cliqueId']}"
        elif any(link.active for link in g.nvlinks):
            local.append(g)
    parent = {g.index: g.index for g in local}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    by_bus = {normalize_bus_id(g.pci_bus_id): g.index for g in local if g.pci_bus_id}
    switched = [g.index for g in local if any(x.active and x.to_switch for x in g.nvlinks)]
    for a, b in itertools.pairwise(switched):
        parent[find(a)] = find(b)
    for g in local:
        for link in g.nvlinks:
            peer = by_bus.get(normalize_bus_id(link.remote_bus_id)) if link.active else None
            if peer is not None:
                parent[find(g.index)] = find(peer)
    roots = sorted({find(g.index) for g in local})
    for g in local:
        k = roots.index(find(g.index))
        out[g.index] = node if len(roots) == 1 else f"{node}-nvl{k}"
    return out
