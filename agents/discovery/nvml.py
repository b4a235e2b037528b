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

The NVML module is injectable: :class:`~support.nvml_replay.ReplayNvml` replays a
recording such as ``tests/fixtures/nvml/h200x2.json`` (values and errors per call) so tests
run without a GPU, and :func:`record_node` writes such a recording from the real driver.
This module owns the live calls (:class:`NvmlDiscovery`, XID events); the recording format
and reading an inventory from it (NVLink domains included) are
:mod:`agents.discovery.nvml_recording`.
"""

from __future__ import annotations

import ctypes
import socket
import uuid as uuidlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agents.discovery.base import DiscoveryError, recording_main
from agents.discovery.nvml_recording import (
    ERROR_NAMES,
    FI_DEV_NVLINK_GET_SPEED,
    K_ARCH,
    K_BUS_ID,
    K_BUS_WIDTH,
    K_CC,
    K_CORES,
    K_ECC,
    K_FABRIC,
    K_LINK_REMOTE,
    K_LINK_SPEED,
    K_LINK_STATE,
    K_LINK_VERSION,
    K_MEM,
    K_MEM_CLOCK,
    K_MIG,
    K_NAME,
    K_NUMA,
    K_PCIE_GEN,
    K_PCIE_WIDTH,
    K_POWER,
    K_REMAPPED,
    K_RETIRED,
    K_SM_CLOCK,
    K_TOPO,
    K_UUID,
    Failed,
    as_text,
    inventory_from_recording,
    normalize_bus_id,
)
from policies.hardware.inventory import (
    NodeInventory,
    inventory_to_dict,
)


def _error_name(exc: BaseException) -> str:
    """pynvml error class name of an exception raised by an NVML call."""
    if isinstance(exc, AttributeError):  # the binding lacks the function: an old pynvml
        return "NVMLError_FunctionNotFound"
    value = getattr(exc, "value", None)
    if isinstance(value, int) and value in ERROR_NAMES:
        return ERROR_NAMES[value]
    name = type(exc).__name__
    return name if name.startswith("NVMLError") else f"NVMLError_{name}"


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
            :class:`~support.nvml_replay.ReplayNvml`); imported on first use when None.
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
            index_of = {as_text(nvml.nvmlDeviceGetUUID(h)): i for i, h in enumerate(handles)}
            while True:
                try:
                    data = nvml.nvmlEventSetWait_v2(self._event_set, 0)
                except Exception as exc:
                    if _is_nvml_error(nvml, exc) and _error_name(exc) == "NVMLError_Timeout":
                        break
                    raise
                gpu = index_of.get(as_text(nvml.nvmlDeviceGetUUID(data.device)), -1)
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
    c(K_NAME, lambda: as_text(nvml.nvmlDeviceGetName(h)), raw)
    c(K_UUID, lambda: as_text(nvml.nvmlDeviceGetUUID(h)), raw)
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
    field_id = int(getattr(nvml, "NVML_FI_DEV_NVLINK_GET_SPEED", FI_DEV_NVLINK_GET_SPEED))
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agents.discovery.nvml [--node NAME] [--out FILE]``: print or write what
    NVML discovery reports (inventory plus the raw NVML answers)."""
    return recording_main(argv, main.__doc__ or "", record_node)


if __name__ == "__main__":
    raise SystemExit(main())
