# ReplayNvml mirrors pynvml's names (nvmlDeviceGetName, c_nvmlGpuFabricInfoV_t, ...).
# ruff: noqa: N801, N802, N815
"""A stand-in for the ``pynvml`` module that answers from a recording, so NVML discovery
runs in tests without a GPU: :class:`ReplayNvml` returns each recorded value and raises the
recorded ``NVMLError_*`` (with its NVML return code) where the real call raised.
"""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from collections.abc import Mapping, Sequence
from typing import Any

from agents.discovery.nvml_recording import (
    ERROR_CODES,
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
)


class _ReplayError(Exception):
    """Base of the replayed ``NVMLError`` classes; ``value`` is the NVML return code."""

    value: int

    def __init__(self, value: int = 999) -> None:
        super().__init__(ERROR_NAMES.get(value, f"NVML error {value}"))
        self.value = value


def _error_class(name: str) -> type[_ReplayError]:
    code = ERROR_CODES.get(name, 999)

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
    NVML_FI_DEV_NVLINK_GET_SPEED = FI_DEV_NVLINK_GET_SPEED
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
        for name in ERROR_CODES:
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
