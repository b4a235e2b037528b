# ReplayAmdSmi mirrors amdsmi's names (AmdSmiException, AmdSmiLibraryException, ...).
# ruff: noqa: N818
"""A stand-in for the ``amdsmi`` module that answers from a recording, so AMD SMI discovery
runs in tests without AMD hardware: :class:`ReplayAmdSmi` returns each recorded value and
raises ``AmdSmiLibraryException`` with the recorded status where the real call failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import Any

from agents.discovery.amdsmi import (
    K_ASIC,
    K_BAD_PAGES,
    K_BDF,
    K_CLOCK,
    K_ECC,
    K_LINK,
    K_MEM,
    K_PCIE,
    K_POWER,
    K_UUID,
    K_VRAM,
    K_XGMI,
)

_STATUS_NAMES = {
    1: "AMDSMI_STATUS_INVAL",
    2: "AMDSMI_STATUS_NOT_SUPPORTED",
    10: "AMDSMI_STATUS_NO_PERM",
    34: "AMDSMI_STATUS_DRIVER_NOT_LOADED",
}
_STATUS_CODES = {v: k for k, v in _STATUS_NAMES.items()}


class _AmdSmiException(Exception):
    """Base of the replayed exceptions (``amdsmi.AmdSmiException``)."""


class _AmdSmiLibraryException(_AmdSmiException):
    """``amdsmi.AmdSmiLibraryException``: ``get_error_code()`` is the AMD SMI status."""

    def __init__(self, err_code: int) -> None:
        super().__init__(_STATUS_NAMES.get(err_code, f"AMDSMI_STATUS_{err_code}"))
        self.err_code = err_code

    def get_error_code(self) -> int:
        return self.err_code


class _Obj:
    """Attribute bag for the binding's enum namespaces."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class ReplayAmdSmi:
    """A stand-in for the ``amdsmi`` module that answers from a recording.

    ``recording`` is the fixture format (``tests/fixtures/amdsmi/mi300x8-modelled.json``).
    A call the recording lacks raises ``AmdSmiLibraryException`` with
    ``AMDSMI_STATUS_NOT_SUPPORTED``; ``init_error`` makes ``amdsmi_init`` raise that status
    (e.g. ``AMDSMI_STATUS_DRIVER_NOT_LOADED``). ``calls`` counts calls per function.
    """

    STATUS_NAMES = _STATUS_NAMES
    AmdSmiException = _AmdSmiException
    AmdSmiLibraryException = _AmdSmiLibraryException
    AmdSmiInitFlags = _Obj(INIT_AMD_GPUS=2)
    AmdSmiMemoryType = _Obj(VRAM=0, VIS_VRAM=1, GTT=2)
    AmdSmiClkType = _Obj(SYS=0, GFX=0, DF=1, DCEF=2, SOC=3, MEM=4)

    class AmdSmiIoLinkType(IntEnum):
        UNDEFINED = 0
        PCIEXPRESS = 1
        XGMI = 2

    def __init__(self, recording: Mapping[str, Any], *, init_error: str | None = None) -> None:
        self._gpus: list[Mapping[str, Any]] = list(recording.get("gpus", []))
        self._pairs = {(int(p["i"]), int(p["j"])): p for p in recording.get("pairs", [])}
        self._init_error = init_error
        self.calls: dict[str, int] = {}
        self.initialised = False

    def _raise(self, name: str) -> None:
        raise _AmdSmiLibraryException(_STATUS_CODES.get(name, 2))

    def _get(self, h: int, key: str) -> Any:
        self.calls[key] = self.calls.get(key, 0) + 1
        if not self.initialised:
            self._raise("AMDSMI_STATUS_INVAL")
        raw = self._gpus[h]
        if key not in raw:
            self._raise("AMDSMI_STATUS_NOT_SUPPORTED")
        v = raw[key]
        if isinstance(v, Mapping) and set(v) == {"error"}:
            self._raise(str(v["error"]))
        return v

    def amdsmi_init(self, flags: int = 2) -> None:
        if self._init_error:
            self._raise(self._init_error)
        self.initialised = True

    def amdsmi_shut_down(self) -> None:
        self.initialised = False

    def amdsmi_get_processor_handles(self) -> list[int]:
        return list(range(len(self._gpus)))

    def amdsmi_get_gpu_asic_info(self, h: int) -> dict[str, Any]:
        return dict(self._get(h, K_ASIC))

    def amdsmi_get_gpu_device_uuid(self, h: int) -> str:
        return str(self._get(h, K_UUID))

    def amdsmi_get_gpu_device_bdf(self, h: int) -> str:
        return str(self._get(h, K_BDF)).lower()

    def amdsmi_get_gpu_memory_total(self, h: int, mem_type: int) -> int:
        return int(self._get(h, K_MEM))

    def amdsmi_get_gpu_vram_info(self, h: int) -> dict[str, Any]:
        return dict(self._get(h, K_VRAM))

    def amdsmi_get_clock_info(self, h: int, clk_type: int) -> dict[str, Any]:
        return dict(self._get(h, K_CLOCK))

    def amdsmi_get_power_cap_info(self, h: int) -> dict[str, Any]:
        return dict(self._get(h, K_POWER))

    def amdsmi_get_pcie_info(self, h: int) -> dict[str, Any]:
        return dict(self._get(h, K_PCIE))

    def amdsmi_get_xgmi_info(self, h: int) -> dict[str, Any]:
        return dict(self._get(h, K_XGMI))

    def amdsmi_get_gpu_total_ecc_count(self, h: int) -> dict[str, Any]:
        return dict(self._get(h, K_ECC))

    def amdsmi_get_gpu_bad_page_info(self, h: int) -> list[dict[str, Any]]:
        return [{"page_address": 0}] * int(self._get(h, K_BAD_PAGES))

    def amdsmi_topo_get_link_type(self, a: int, b: int) -> dict[str, Any]:
        self.calls[K_LINK] = self.calls.get(K_LINK, 0) + 1
        pair = self._pairs.get((min(a, b), max(a, b)))
        if pair is None or K_LINK not in pair:
            self._raise("AMDSMI_STATUS_NOT_SUPPORTED")
        assert pair is not None
        v = pair[K_LINK]
        if isinstance(v, Mapping) and set(v) == {"error"}:
            self._raise(str(v["error"]))
        kind = self.AmdSmiIoLinkType[{"PCIE": "PCIEXPRESS"}.get(v["type"], v["type"])]
        return {"hops": v.get("hops"), "type": kind}
