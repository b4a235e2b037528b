# ReplayNvml mirrors pynvml's names (nvmlDeviceGetName, c_nvmlGpuFabricInfoV_t, ...).
# ruff: noqa: N801, N802, N815
"""NVML discovery: what the NVIDIA driver says about this node's GPUs.

:class:`NvmlDiscovery` asks NVML (package ``nvidia-ml-py``, module ``pynvml``) for every
figure the planner needs and turns the answers into a :class:`NodeInventory`:

* identity: name, UUID, PCI bus id, architecture, CUDA compute capability;
* memory size; peak HBM bandwidth = bus width / 8 x max memory clock x 2 (double data
  rate), in GB/s: 6016 bit / 8 x 3201 MHz x 2 = 4814 GB/s on an H200;
* SMs = CUDA cores / FP32 cores per SM of the compute capability (H200: 16896 / 128 = 132),
  cross-checked with the GPU catalog (``nvmlDeviceGetAttributes`` only answers for MIG
  handles);
* maximum SM clock (MHz), power limit (W), maximum PCIe generation and width;
* NVLinks: state, version (an NVML enum, mapped to the NVLink generation), remote PCI bus
  id (``FFFFFFFF:FF:FF.0`` is an NVSwitch) and per-link speed where the driver gives it;
* the NVLink domain: GPUs joined by NVLink inside the node (directly or through an NVSwitch)
  share the node's domain; GPUs whose fabric info (``nvmlDeviceGetGpuFabricInfoV``) names a
  cluster UUID and clique id share that multi-node domain (NVL72);
* health: uncorrected volatile ECC errors, retired pages, remapped rows and, when
  ``watch_xid`` is set, XID events since the previous call.

Every NVML call may raise ``NVMLError_NotSupported`` (the GPU lacks the feature),
``NVMLError_FunctionNotFound`` (the driver is older than the binding) or, at ``nvmlInit``,
``NVMLError_LibraryNotFound`` (no driver). The first two leave the figure unknown (a
catalog figure or None takes its place); the last becomes a :class:`DiscoveryError` that
says how to fix it.

The NVML module is injectable: :class:`ReplayNvml` replays a recording such as
``tests/fixtures/nvml/h200x2.json`` (values and errors per call) so tests run without a GPU,
and :func:`record_node` writes such a recording from the real driver.
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import uuid as uuidlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agents.discovery.base import DiscoveryError, recording_main
from policies.catalog import lookup
from policies.errors import InputError
from policies.inventory import (
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
_ERR_INVALID_ARGUMENT = 2
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_DRIVER_NOT_LOADED = 9
_ERR_TIMEOUT = 10
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERROR_NAMES = {
    1: "NVMLError_Uninitialized",
    _ERR_INVALID_ARGUMENT: "NVMLError_InvalidArgument",
    _ERR_NOT_SUPPORTED: "NVMLError_NotSupported",
    _ERR_NO_PERMISSION: "NVMLError_NoPermission",
    6: "NVMLError_NotFound",
    _ERR_DRIVER_NOT_LOADED: "NVMLError_DriverNotLoaded",
    _ERR_TIMEOUT: "NVMLError_Timeout",
    _ERR_LIBRARY_NOT_FOUND: "NVMLError_LibraryNotFound",
    _ERR_FUNCTION_NOT_FOUND: "NVMLError_FunctionNotFound",
    15: "NVMLError_GPUIsLost",
    999: "NVMLError_Unknown",
}
_ERROR_CODES = {name: code for code, name in _ERROR_NAMES.items()}

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

_FI_DEV_NVLINK_GET_SPEED = 164  # nvml.h: NVLink speed in MB/s, scope = link
_FABRIC_STATE_COMPLETED = 3


@dataclass(frozen=True)
class Failed:
    """An NVML call that raised: ``error`` is the pynvml class name
    (``NVMLError_NotSupported``)."""

    error: str


_NOT_SUPPORTED = Failed("NVMLError_NotSupported")


def _error_name(exc: BaseException) -> str:
    """pynvml error class name of an exception raised by an NVML call."""
    if isinstance(exc, AttributeError):  # the binding lacks the function: an old pynvml
        return "NVMLError_FunctionNotFound"
    value = getattr(exc, "value", None)
    if isinstance(value, int) and value in _ERROR_NAMES:
        return _ERROR_NAMES[value]
    name = type(exc).__name__
    return name if name.startswith("NVMLError") else f"NVMLError_{name}"


def normalize_bus_id(bus_id: str | bytes) -> str:
    """PCI bus id as ``DDDDDDDD:BB:DD.F`` upper case (NVML prints 4- or 8-digit domains)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    text = text.strip().upper()
    parts = text.split(":")
    if len(parts) == 3:
        return f"{parts[0].rjust(8, '0')[-8:]}:{parts[1]}:{parts[2]}"
    return text


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _num(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class _Probe:
    """Calls NVML, turning errors into :class:`Failed` and keeping a recording."""

    nvml: Any
    record: dict[str, Any] = field(default_factory=dict)

    def call(self, key: str, fn: Callable[[], Any], into: dict[str, Any] | None = None) -> Any:
        target = self.record if into is None else into
        try:
            value = fn()
        except Exception as exc:  # every NVML call can fail; the caller decides what it means
            if not _is_nvml_error(self.nvml, exc):
                raise
            target[key] = {"error": _error_name(exc)}
            return Failed(_error_name(exc))
        target[key] = value
        return value


def _is_nvml_error(nvml: Any, exc: BaseException) -> bool:
    base = getattr(nvml, "NVMLError", None)
    if isinstance(exc, AttributeError):
        return True
    return isinstance(base, type) and isinstance(exc, base)


# --------------------------------------------------------------------------- discovery


@dataclass
class NvmlDiscovery:
    """Discovery backend over NVML.

    Attributes:
        node_name: node name reported (DNS-1123); the host name (lower case) when empty.
        nvml: the ``pynvml`` module or a stand-in with the same functions (tests inject a
            :class:`ReplayNvml`); imported on first use when None.
        watch_xid: register for XID critical-error events on the first call and report the
            XIDs seen since the previous call in each GPU's health.
        labels: node labels to report.
        notes: remarks from the last :meth:`discover` (figures taken from the catalog,
            mismatches between NVML and the catalog).
        recording: every NVML answer of the last :meth:`discover`, in the fixture format.
    """

    node_name: str = ""
    nvml: Any = None
    watch_xid: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    recording: dict[str, Any] = field(default_factory=dict)
    name: str = "nvml"
    _event_set: Any = None

    def _module(self) -> Any:
        if self.nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise DiscoveryError(
                    "the Python NVML binding is not installed. To fix: pip install nvidia-ml-py "
                    "(it is a dependency of mixfleet), or use --discovery static"
                ) from exc
            self.nvml = pynvml
        return self.nvml

    def _init(self, nvml: Any) -> None:
        try:
            nvml.nvmlInit()
        except Exception as exc:
            if not _is_nvml_error(nvml, exc):
                raise
            name = _error_name(exc)
            if name in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"):
                raise DiscoveryError(
                    f"NVML could not start ({name}): the NVIDIA driver library "
                    "libnvidia-ml.so.1 is not loadable on this host. To fix: install the NVIDIA "
                    "driver; in a container run with the NVIDIA container runtime (Kubernetes: "
                    "runtimeClassName: nvidia, or the NVIDIA device plugin) so the library is "
                    "mounted; on a host without NVIDIA GPUs use --discovery static"
                ) from exc
            if name == "NVMLError_NoPermission":
                raise DiscoveryError(
                    "NVML refused access (NVMLError_NoPermission). To fix: run the agent as a "
                    "user allowed to open /dev/nvidia*, or in a privileged container"
                ) from exc
            raise DiscoveryError(f"NVML could not start: {name}") from exc

    def discover(self) -> NodeInventory:
        """Describe the node now.

        Raises:
            DiscoveryError: NVML cannot run here (no binding, no driver, no permission).
        """
        nvml = self._module()
        self._init(nvml)
        try:
            return self._discover(nvml)
        finally:
            if not self.watch_xid:
                try:
                    nvml.nvmlShutdown()
                except Exception as exc:
                    if not _is_nvml_error(nvml, exc):
                        raise

    def _discover(self, nvml: Any) -> NodeInventory:
        self.notes = []
        probe = _Probe(nvml)
        node = self.node_name or socket.gethostname().split(".")[0].lower()
        count = probe.call("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount)
        if isinstance(count, Failed):
            raise DiscoveryError(f"NVML cannot count the GPUs ({count.error})")
        handles = []
        for i in range(count):
            h = probe.call(
                f"nvmlDeviceGetHandleByIndex({i})",
                partial(nvml.nvmlDeviceGetHandleByIndex, i),
                {},
            )
            if isinstance(h, Failed):
                raise DiscoveryError(
                    f"NVML cannot open GPU {i} ({h.error}). To fix: check `nvidia-smi`; a GPU "
                    "that fell off the bus needs a node drain and reset by an administrator"
                )
            handles.append(h)
        raw_gpus: list[dict[str, Any]] = []
        for index, h in enumerate(handles):
            raw: dict[str, Any] = {"index": index}
            _probe_gpu(probe, nvml, h, raw)
            raw_gpus.append(raw)
        pairs: list[dict[str, Any]] = []
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                pair: dict[str, Any] = {"i": i, "j": j}
                hi, hj = handles[i], handles[j]
                probe.call(K_TOPO, partial(nvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj), pair)
                pairs.append(pair)
        xids = self._poll_xid(nvml, handles)
        self.recording = {"gpus": raw_gpus, "pairs": pairs}
        return inventory_from_recording(
            self.recording,
            node=node,
            labels=self.labels,
            xid_errors=xids,
            notes=self.notes,
        )

    def _poll_xid(self, nvml: Any, handles: Sequence[Any]) -> dict[int, tuple[int, ...]]:
        """XIDs seen per GPU index since the previous call (empty unless ``watch_xid``)."""
        if not self.watch_xid:
            return {}
        seen: dict[int, list[int]] = {}
        try:
            if self._event_set is None:
                self._event_set = nvml.nvmlEventSetCreate()
                for h in handles:
                    nvml.nvmlDeviceRegisterEvents(
                        h, nvml.nvmlEventTypeXidCriticalError, self._event_set
                    )
                return {}
            index_of = {_text(nvml.nvmlDeviceGetUUID(h)): i for i, h in enumerate(handles)}
            while True:
                try:
                    data = nvml.nvmlEventSetWait_v2(self._event_set, 0)
                except Exception as exc:
                    if _is_nvml_error(nvml, exc) and _error_name(exc) == "NVMLError_Timeout":
                        break
                    raise
                gpu = index_of.get(_text(nvml.nvmlDeviceGetUUID(data.device)), -1)
                seen.setdefault(gpu, []).append(int(data.eventData))
        except Exception as exc:
            if not _is_nvml_error(nvml, exc):
                raise
            self.notes.append(f"XID events unavailable ({_error_name(exc)})")
            self.watch_xid = False
        return {k: tuple(v) for k, v in seen.items()}


def _probe_gpu(probe: _Probe, nvml: Any, h: Any, raw: dict[str, Any]) -> None:
    """Ask NVML everything about one GPU, answers (or errors) into ``raw``."""
    c = probe.call
    c(K_NAME, lambda: _text(nvml.nvmlDeviceGetName(h)), raw)
    c(K_UUID, lambda: _text(nvml.nvmlDeviceGetUUID(h)), raw)
    c(K_ARCH, lambda: int(nvml.nvmlDeviceGetArchitecture(h)), raw)
    c(K_CC, lambda: list(nvml.nvmlDeviceGetCudaComputeCapability(h)), raw)
    c(K_MEM, lambda: int(nvml.nvmlDeviceGetMemoryInfo(h).total), raw)
    c(K_BUS_WIDTH, lambda: int(nvml.nvmlDeviceGetMemoryBusWidth(h)), raw)
    c(K_MEM_CLOCK, lambda: int(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_MEM)), raw)
    c(K_SM_CLOCK, lambda: int(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)), raw)
    c(K_CORES, lambda: int(nvml.nvmlDeviceGetNumGpuCores(h)), raw)
    c(K_POWER, lambda: int(nvml.nvmlDeviceGetPowerManagementLimit(h)), raw)
    c(K_BUS_ID, lambda: normalize_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId), raw)
    c(K_NUMA, lambda: int(nvml.nvmlDeviceGetNumaNodeId(h)), raw)
    c(K_MIG, lambda: list(nvml.nvmlDeviceGetMigMode(h)), raw)
    c(K_PCIE_GEN, lambda: int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)), raw)
    c(K_PCIE_WIDTH, lambda: int(nvml.nvmlDeviceGetMaxPcieLinkWidth(h)), raw)
    c(
        K_ECC,
        lambda: int(
            nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            )
        ),
        raw,
    )
    c(
        K_RETIRED,
        lambda: len(
            nvml.nvmlDeviceGetRetiredPages(h, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        ),
        raw,
    )
    c(K_REMAPPED, lambda: [int(x) for x in nvml.nvmlDeviceGetRemappedRows(h)], raw)
    c(K_FABRIC, lambda: _fabric_info(nvml, h), raw)
    links: list[dict[str, Any]] = []
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
    for link in range(max_links):
        entry: dict[str, Any] = {"link": link}
        state = c(K_LINK_STATE, partial(_as_int, nvml.nvmlDeviceGetNvLinkState, h, link), entry)
        if isinstance(state, Failed):
            if state.error in ("NVMLError_InvalidArgument", "NVMLError_NotSupported"):
                break  # past the GPU's last link, or a GPU without NVLink
            links.append(entry)  # a link NVML cannot read: keep the error in the recording
            continue
        c(K_LINK_VERSION, partial(_as_int, nvml.nvmlDeviceGetNvLinkVersion, h, link), entry)
        c(K_LINK_REMOTE, partial(_remote_bus_id, nvml, h, link), entry)
        c(K_LINK_SPEED, partial(_link_speed_mbps, nvml, h, link), entry)
        links.append(entry)
    raw["nvlinks"] = links


def _as_int(fn: Callable[..., Any], *args: Any) -> int:
    return int(fn(*args))


def _remote_bus_id(nvml: Any, h: Any, link: int) -> str:
    return normalize_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)


def _link_speed_mbps(nvml: Any, h: Any, link: int) -> int:
    """NVLink speed of one link in MB/s (field NVML_FI_DEV_NVLINK_GET_SPEED, scope = link)."""
    field_id = int(getattr(nvml, "NVML_FI_DEV_NVLINK_GET_SPEED", _FI_DEV_NVLINK_GET_SPEED))
    values = nvml.nvmlDeviceGetFieldValues(h, [(field_id, link)])
    v = values[0]
    if int(v.nvmlReturn) != 0:
        raise nvml.NVMLError(int(v.nvmlReturn))
    return int(v.value.uiVal)


def _fabric_info(nvml: Any, h: Any) -> dict[str, Any]:
    """Multi-node NVLink fabric membership: cluster UUID, clique id, state, status."""
    info = nvml.c_nvmlGpuFabricInfoV_t()
    info.version = nvml.nvmlGpuFabricInfo_v2
    nvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    return {
        "clusterUuid": str(uuidlib.UUID(bytes=bytes(info.clusterUuid))),
        "cliqueId": int(info.cliqueId),
        "state": int(info.state),
        "status": int(info.status),
    }


# --------------------------------------------------------------- recording -> inventory


def _value(raw: Mapping[str, Any], key: str) -> Any:
    """The recorded answer, or :class:`Failed` for an error or an unrecorded call."""
    if key not in raw:
        return _NOT_SUPPORTED
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
        hbm_gbps = bus_width / 8 * mem_clock * 1e6 * 2 / 1e9
    else:
        hbm_gbps = spec.hbm_bandwidth_gbps if spec else 0.0
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
        hbm_bandwidth_gbps=hbm_gbps,
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
            and fabric.get("state") == _FABRIC_STATE_COMPLETED
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


# ------------------------------------------------------------------------ replay, record


class _ReplayError(Exception):
    """Base of the replayed ``NVMLError`` classes; ``value`` is the NVML return code."""

    value: int

    def __init__(self, value: int = 999) -> None:
        super().__init__(_ERROR_NAMES.get(value, f"NVML error {value}"))
        self.value = value


def _error_class(name: str) -> type[_ReplayError]:
    code = _ERROR_CODES.get(name, 999)

    def init(self: _ReplayError, value: int = code) -> None:
        _ReplayError.__init__(self, value)

    return type(name, (_ReplayError,), {"__init__": init})


class _Obj:
    """Attribute bag standing for the ctypes structures pynvml returns."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class ReplayNvml:
    """A stand-in for the ``pynvml`` module that answers from a recording.

    ``recording`` is the fixture format (``tests/fixtures/nvml/h200x2.json``): per GPU the
    value each call returned or ``{"error": "NVMLError_..."}``. A call the recording lacks
    raises ``unrecorded`` (``NVMLError_NotSupported`` by default), as a driver that does
    not support it would. ``init_error`` makes ``nvmlInit`` raise that error (e.g.
    ``NVMLError_LibraryNotFound``: no driver). ``calls`` counts calls per function name.
    """

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    NVML_FI_DEV_NVLINK_GET_SPEED = _FI_DEV_NVLINK_GET_SPEED
    nvmlEventTypeXidCriticalError = 8
    nvmlGpuFabricInfo_v2 = 0x02000024

    def __init__(
        self,
        recording: Mapping[str, Any],
        *,
        unrecorded: str = "NVMLError_NotSupported",
        init_error: str | None = None,
        max_links: int = 36,
    ) -> None:
        self._gpus: list[Mapping[str, Any]] = list(recording.get("gpus", []))
        self._pairs = {(int(p["i"]), int(p["j"])): p for p in recording.get("pairs", [])}
        self._unrecorded = unrecorded
        self._init_error = init_error
        self.NVML_NVLINK_MAX_LINKS = max_links
        self.calls: dict[str, int] = {}
        self.NVMLError: type[_ReplayError] = _ReplayError
        for name in _ERROR_CODES:
            setattr(self, name, _error_class(name))

    class c_nvmlGpuFabricInfoV_t(ctypes.Structure):
        _fields_ = (
            ("version", ctypes.c_uint),
            ("clusterUuid", ctypes.c_ubyte * 16),
            ("status", ctypes.c_uint),
            ("cliqueId", ctypes.c_uint),
            ("state", ctypes.c_uint),
            ("healthMask", ctypes.c_uint),
        )

    def _raise(self, name: str) -> None:
        cls = getattr(self, name, None)
        if not isinstance(cls, type):
            cls = _error_class(name)
        raise cls()

    def _get(self, handle: int, key: str, *, link: int | None = None) -> Any:
        self.calls[key] = self.calls.get(key, 0) + 1
        raw: Mapping[str, Any] = self._gpus[handle]
        if link is not None:
            links = raw.get("nvlinks", [])
            entry = next((x for x in links if int(x["link"]) == link), None)
            if entry is None:
                self._raise("NVMLError_InvalidArgument" if links else self._unrecorded)
            raw = entry or {}
        if key not in raw:
            self._raise(self._unrecorded)
        v = raw[key]
        if isinstance(v, Mapping) and set(v) == {"error"}:
            self._raise(str(v["error"]))
        return v

    # -- lifecycle
    def nvmlInit(self) -> None:
        if self._init_error:
            self._raise(self._init_error)

    def nvmlShutdown(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self._gpus):
            self._raise("NVMLError_InvalidArgument")
        return index

    # -- identity, memory, clocks
    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self._get(h, K_NAME))

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return str(self._get(h, K_UUID))

    def nvmlDeviceGetArchitecture(self, h: int) -> int:
        return int(self._get(h, K_ARCH))

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        v = self._get(h, K_CC)
        return int(v[0]), int(v[1])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Obj:
        return _Obj(total=int(self._get(h, K_MEM)))

    def nvmlDeviceGetMemoryBusWidth(self, h: int) -> int:
        return int(self._get(h, K_BUS_WIDTH))

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:
        return int(self._get(h, K_MEM_CLOCK if clock == self.NVML_CLOCK_MEM else K_SM_CLOCK))

    def nvmlDeviceGetNumGpuCores(self, h: int) -> int:
        return int(self._get(h, K_CORES))

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return int(self._get(h, K_POWER))

    def nvmlDeviceGetPciInfo(self, h: int) -> _Obj:
        return _Obj(busId=str(self._get(h, K_BUS_ID)))

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        return int(self._get(h, K_NUMA))

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        return list(self._get(h, K_MIG))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return int(self._get(h, K_PCIE_GEN))

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return int(self._get(h, K_PCIE_WIDTH))

    # -- health
    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:
        return int(self._get(h, K_ECC))

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        return [0] * int(self._get(h, K_RETIRED))

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        v = self._get(h, K_REMAPPED)
        return int(v[0]), int(v[1]), int(v[2]), int(v[3])

    def nvmlDeviceGetGpuFabricInfoV(self, h: int, ref: Any) -> int:
        v = self._get(h, K_FABRIC)
        info = ref._obj
        info.clusterUuid[:] = list(uuidlib.UUID(str(v["clusterUuid"])).bytes)
        info.cliqueId = int(v["cliqueId"])
        info.state = int(v["state"])
        info.status = int(v.get("status", 0))
        return 0

    def nvmlEventSetCreate(self) -> object:
        self._raise(self._unrecorded)
        return object()

    # -- NVLink and topology
    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        return int(self._get(h, K_LINK_STATE, link=link))

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:
        return int(self._get(h, K_LINK_VERSION, link=link))

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> _Obj:
        return _Obj(busId=str(self._get(h, K_LINK_REMOTE, link=link)))

    def nvmlDeviceGetFieldValues(self, h: int, field_ids: Sequence[Any]) -> list[_Obj]:
        out = []
        for fid in field_ids:
            link = fid[1] if isinstance(fid, tuple) else 0
            v = self._get(h, K_LINK_SPEED, link=link)
            out.append(_Obj(nvmlReturn=0, value=_Obj(uiVal=int(v))))
        return out

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        key = (min(a, b), max(a, b))
        self.calls[K_TOPO] = self.calls.get(K_TOPO, 0) + 1
        pair = self._pairs.get(key)
        if pair is None or K_TOPO not in pair:
            self._raise(self._unrecorded)
        v = pair[K_TOPO] if pair is not None else None
        if isinstance(v, Mapping):
            self._raise(str(v["error"]))
        return int(v) if v is not None else 0


def record_node(nvml: Any = None, *, node_name: str = "") -> dict[str, Any]:
    """Discover the node and return ``{"inventory": ..., "recording": ..., "notes": ...}``:
    the inventory as JSON-ready data and every NVML answer in the fixture format.

    Raises:
        DiscoveryError: NVML cannot run here.
    """
    backend = NvmlDiscovery(node_name=node_name, nvml=nvml)
    inv = backend.discover()
    return {
        "inventory": inventory_to_dict(inv),
        "recording": backend.recording,
        "notes": list(backend.notes),
    }


def inventory_to_dict(inv: NodeInventory) -> dict[str, Any]:
    """A node inventory as JSON-ready data."""
    import json
    from dataclasses import asdict

    doc: dict[str, Any] = json.loads(json.dumps(asdict(inv)))  # tuples become lists
    return doc


def inventory_from_dict(d: Mapping[str, Any]) -> NodeInventory:
    """Inverse of :func:`inventory_to_dict`.

    Raises:
        InputError: a field is missing or malformed.
    """
    try:
        gpus = []
        for g in d["gpus"]:
            fields = dict(g)
            fields["nvlinks"] = tuple(NvLinkInfo(**x) for x in g.get("nvlinks", ()))
            health = dict(g.get("health", {}))
            health["xid_errors"] = tuple(health.get("xid_errors", ()))
            fields["health"] = GpuHealth(**health)
            fields["measured"] = dict(g.get("measured", {}))
            gpus.append(GpuInventory(**fields))
        return NodeInventory(
            node=str(d["node"]),
            gpus=tuple(gpus),
            labels=dict(d.get("labels", {})),
            agent_version=str(d.get("agent_version", "")),
            simulated=bool(d.get("simulated", False)),
            discovered_by=tuple(d.get("discovered_by", ())),
        )
    except (KeyError, TypeError) as exc:
        raise InputError(f"malformed inventory: {exc}", field="inventory") from exc


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agents.discovery.nvml [--node NAME] [--out FILE]``: print or write what
    NVML discovery reports (inventory plus the raw NVML answers)."""
    return recording_main(argv, main.__doc__ or "", record_node)


if __name__ == "__main__":
    raise SystemExit(main())
