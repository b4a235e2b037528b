"""AMD SMI discovery: what the ROCm driver says about this node's AMD GPUs (MI300X...).

:class:`AmdSmiDiscovery` asks AMD SMI's Python binding (module ``amdsmi``, an OPTIONAL
dependency: it ships with ROCm and must match the installed ROCm; imported on first use)
for the figures the planner needs and returns the same :class:`NodeInventory` as NVML
discovery:

* identity: market name (``AMD Instinct MI300X``, looked up in the GPU catalog), UUID, PCI
  BDF, gfx target (``gfx942`` -> architecture ``cdna3``), compute units (``sms``);
* memory: VRAM total in bytes (``amdsmi_get_gpu_memory_total(h, VRAM)``);
* peak HBM bandwidth: ``vram_max_bandwidth`` of ``amdsmi_get_gpu_vram_info`` in GB/s
  (ROCm 6.4 and newer); older libraries do not report it and the catalog figure is used;
* maximum GFX clock (MHz), power cap (reported in microwatts), PCIe generation and width;
* Infinity Fabric (xGMI): for every pair of GPUs ``amdsmi_topo_get_link_type`` tells XGMI or
  PCIe and the hop count; each direct (1-hop) xGMI peer is one link, reported as an
  :class:`NvLinkInfo` of generation :data:`policies.hardware.inventory.XGMI_MI300_GENERATION` (64 GB/s
  per direction), so ``GpuInventory.nvlink_bidir_gbytes_per_s`` is 7 x 128 = 896 GB/s on an 8x MI300X
  platform. GPUs of one xGMI hive (``amdsmi_get_xgmi_info``'s ``xgmi_hive_id``) share an
  NVLink-domain id (the node name; ``<node>-xgmi<k>`` when a node has several hives);
  without a hive id, GPUs joined by direct xGMI links form the domain;
* health: uncorrectable ECC errors (``amdsmi_get_gpu_total_ecc_count``) and retired
  ("bad") pages (``amdsmi_get_gpu_bad_page_info``).

Every call may raise ``AmdSmiLibraryException`` (not supported on this GPU or driver): the
figure stays unknown and the catalog fills in, with a note. ``amdsmi_init`` failing (no
amdgpu driver, no access to /dev/kfd) is a :class:`DiscoveryError` that says how to fix it.

The module is injectable: :class:`~support.amdsmi_replay.ReplayAmdSmi` answers from a recording in the format of
``tests/fixtures/amdsmi/mi300x8-modelled.json`` so tests run without AMD hardware, and
``python -m agents.discovery.amdsmi --out FILE`` writes such a recording on a real host.
No AMD host was available when this backend was written: that fixture is MODELLED on AMD's
published MI300X figures (304 CUs, 192 GB HBM3 at 5.3 TB/s, 8192-bit bus, 2100 MHz peak
engine clock, 750 W, PCIe 5.0 x16, 7 xGMI links per GPU in a fully connected 8-GPU hive),
not recorded; replace it with a recording from a real node when one is available.
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import partial
from typing import Any

from agents.discovery.base import DiscoveryError, recording_main
from agents.discovery.nvml_recording import normalize_bus_id
from policies.errors import InputError
from policies.hardware.catalog import GpuSpec, lookup
from policies.hardware.inventory import (
    XGMI_MI300_GENERATION,
    GpuHealth,
    GpuInventory,
    NodeInventory,
    NvLinkInfo,
)

#: gfx targets to architectures.
AMD_ARCHITECTURES = {
    "gfx940": "cdna3",
    "gfx941": "cdna3",
    "gfx942": "cdna3",
    "gfx90a": "cdna2",
    "gfx908": "cdna1",
}
#: PCIe transfer rate (MT/s) per lane to PCIe generation.
PCIE_GENERATION_BY_MTS = {2500: 1, 5000: 2, 8000: 3, 16000: 4, 32000: 5, 64000: 6}
#: Value AMD SMI puts in a 32-bit field it cannot fill.
_NOT_SUPPORTED_U32 = 0xFFFFFFFF

# Keys of a recording (the format of tests/fixtures/amdsmi/mi300x8-modelled.json).
K_ASIC = "amdsmi_get_gpu_asic_info"
K_UUID = "amdsmi_get_gpu_device_uuid"
K_BDF = "amdsmi_get_gpu_device_bdf"
K_MEM = "amdsmi_get_gpu_memory_total(VRAM)"
K_VRAM = "amdsmi_get_gpu_vram_info"
K_CLOCK = "amdsmi_get_clock_info(GFX)"
K_POWER = "amdsmi_get_power_cap_info"
K_PCIE = "amdsmi_get_pcie_info"
K_XGMI = "amdsmi_get_xgmi_info"
K_ECC = "amdsmi_get_gpu_total_ecc_count"
K_BAD_PAGES = "amdsmi_get_gpu_bad_page_info"
K_LINK = "amdsmi_topo_get_link_type"


@dataclass(frozen=True)
class Failed:
    """A call that raised: ``error`` names the exception (``AMDSMI_STATUS_NOT_SUPPORTED``)."""

    error: str


def _error_name(m: Any, exc: BaseException) -> str:
    code = None
    getter = getattr(exc, "get_error_code", None)
    if callable(getter):
        code = getter()
    code = code if code is not None else getattr(exc, "err_code", None)
    names = getattr(m, "STATUS_NAMES", {})
    if isinstance(code, int):
        return str(names.get(code, f"AMDSMI_STATUS_{code}"))
    return type(exc).__name__


def _is_amdsmi_error(m: Any, exc: BaseException) -> bool:
    base = getattr(m, "AmdSmiException", None)
    if isinstance(exc, AttributeError):  # an older binding without the function
        return True
    return isinstance(base, type) and isinstance(exc, base)


@dataclass
class _Probe:
    """Calls AMD SMI, turning its errors into :class:`Failed` and keeping a recording."""

    m: Any

    def call(self, key: str, fn: Callable[[], Any], into: dict[str, Any]) -> Any:
        try:
            value = fn()
        except Exception as exc:  # every AMD SMI call can fail; the caller decides
            if not _is_amdsmi_error(self.m, exc):
                raise
            into[key] = {"error": _error_name(self.m, exc)}
            return Failed(_error_name(self.m, exc))
        into[key] = value
        return value


def _link_type_name(m: Any, value: Any) -> str:
    """``XGMI``, ``PCIE`` or the raw value as text, whatever enum the binding returns."""
    if isinstance(value, Mapping):
        value = value.get("type")
    name = getattr(value, "name", None)
    if isinstance(name, str):
        upper = name.upper()
        return "XGMI" if "XGMI" in upper else "PCIE" if "PCI" in upper else upper
    for enum_name in ("AmdSmiLinkType", "AmdSmiIoLinkType"):
        enum = getattr(m, enum_name, None)
        for member in getattr(enum, "__members__", {}).values():
            if isinstance(value, int) and int(member) == value:
                return _link_type_name(m, member)
    return str(value)


# --------------------------------------------------------------------------- discovery


@dataclass
class AmdSmiDiscovery:
    """Discovery backend over AMD SMI.

    Attributes:
        node_name: node name reported (DNS-1123); the host name (lower case) when empty.
        amdsmi: the ``amdsmi`` module or a stand-in with the same functions (tests inject
            a :class:`~support.amdsmi_replay.ReplayAmdSmi`); imported on first use
            when None.
        labels: node labels to report.
        notes: remarks from the last :meth:`discover` (catalog fallbacks, mismatches).
        recording: every answer of the last :meth:`discover`, in the fixture format.
    """

    node_name: str = ""
    amdsmi: Any = None
    labels: Mapping[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    recording: dict[str, Any] = field(default_factory=dict)
    name: str = "amdsmi"

    def _module(self) -> Any:
        if self.amdsmi is None:
            try:
                self.amdsmi = importlib.import_module("amdsmi")
            except ImportError as exc:
                raise DiscoveryError(
                    "the AMD SMI Python binding (module amdsmi) is not installed. To fix: "
                    "install the amdsmi package of your ROCm release (pip install "
                    "/opt/rocm/share/amd_smi, or pip install amdsmi==<ROCm version>), or use "
                    "--discovery static"
                ) from exc
        return self.amdsmi

    def discover(self) -> NodeInventory:
        """Describe the node now.

        Raises:
            DiscoveryError: AMD SMI cannot run here (no binding, no driver, no access).
        """
        m = self._module()
        try:
            flags = getattr(getattr(m, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
            m.amdsmi_init() if flags is None else m.amdsmi_init(flags)
        except Exception as exc:
            if not _is_amdsmi_error(m, exc):
                raise
            raise DiscoveryError(
                f"AMD SMI could not start ({_error_name(m, exc)}): the amdgpu driver is not "
                "loaded or /dev/kfd and /dev/dri are not accessible. To fix: load the amdgpu "
                "driver (ROCm); in a container pass --device /dev/kfd --device /dev/dri "
                "(Kubernetes: the AMD GPU device plugin); on a host without AMD GPUs use "
                "--discovery nvml or static"
            ) from exc
        try:
            return self._discover(m)
        finally:
            try:
                m.amdsmi_shut_down()
            except Exception as exc:
                if not _is_amdsmi_error(m, exc):
                    raise

    def _discover(self, m: Any) -> NodeInventory:
        self.notes = []
        node = self.node_name or socket.gethostname().split(".")[0].lower()
        try:
            handles = list(m.amdsmi_get_processor_handles())
        except Exception as exc:
            if not _is_amdsmi_error(m, exc):
                raise
            raise DiscoveryError(f"AMD SMI cannot list the GPUs ({_error_name(m, exc)})") from exc
        probe = _Probe(m)
        raw_gpus: list[dict[str, Any]] = []
        for index, h in enumerate(handles):
            raw: dict[str, Any] = {"index": index}
            _probe_gpu(probe, m, h, raw)
            raw_gpus.append(raw)
        pairs: list[dict[str, Any]] = []
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                pair: dict[str, Any] = {"i": i, "j": j}
                got = probe.call(
                    K_LINK, partial(m.amdsmi_topo_get_link_type, handles[i], handles[j]), pair
                )
                if not isinstance(got, Failed):
                    hops = got.get("hops") if isinstance(got, Mapping) else None
                    pair[K_LINK] = {"type": _link_type_name(m, got), "hops": hops}
                pairs.append(pair)
        self.recording = {"gpus": raw_gpus, "pairs": pairs}
        return inventory_from_recording(
            self.recording, node=node, labels=self.labels, notes=self.notes
        )


def _plain(value: Any) -> Any:
    """Recorded form of an answer: mappings and sequences copied, enums by name."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, IntEnum):
        return value.name
    return value


def _probe_gpu(probe: _Probe, m: Any, h: Any, raw: dict[str, Any]) -> None:
    """Ask AMD SMI everything about one GPU, answers (or errors) into ``raw``."""
    vram = getattr(getattr(m, "AmdSmiMemoryType", None), "VRAM", 0)
    gfx = getattr(getattr(m, "AmdSmiClkType", None), "GFX", 0)
    c = probe.call
    c(K_ASIC, lambda: _plain(m.amdsmi_get_gpu_asic_info(h)), raw)
    c(K_UUID, lambda: str(m.amdsmi_get_gpu_device_uuid(h)), raw)
    c(K_BDF, lambda: normalize_bus_id(str(m.amdsmi_get_gpu_device_bdf(h))), raw)
    c(K_MEM, lambda: int(m.amdsmi_get_gpu_memory_total(h, vram)), raw)
    c(K_VRAM, lambda: _plain(m.amdsmi_get_gpu_vram_info(h)), raw)
    c(K_CLOCK, lambda: _plain(m.amdsmi_get_clock_info(h, gfx)), raw)
    c(K_POWER, lambda: _plain(m.amdsmi_get_power_cap_info(h)), raw)
    c(K_PCIE, lambda: _plain(m.amdsmi_get_pcie_info(h)), raw)
    c(K_XGMI, lambda: _plain(m.amdsmi_get_xgmi_info(h)), raw)
    c(K_ECC, lambda: _plain(m.amdsmi_get_gpu_total_ecc_count(h)), raw)
    c(K_BAD_PAGES, lambda: len(m.amdsmi_get_gpu_bad_page_info(h)), raw)


# --------------------------------------------------------------- recording -> inventory


def _value(raw: Mapping[str, Any], key: str) -> Any:
    """The recorded answer, or :class:`Failed` for an error or an unrecorded call."""
    if key not in raw:
        return Failed("AMDSMI_STATUS_NOT_SUPPORTED")
    v = raw[key]
    if isinstance(v, Mapping) and set(v) == {"error"}:
        return Failed(str(v["error"]))
    return v


def _field(raw: Mapping[str, Any], key: str, *names: str) -> Any:
    """A field of a recorded mapping (first of ``names`` present), None when absent."""
    v = _value(raw, key)
    if not isinstance(v, Mapping):
        return None
    for n in names:
        if n in v:
            return v[n]
    return None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return None if value in (_NOT_SUPPORTED_U32, 0xFFFFFFFFFFFFFFFF) or value < 0 else value


def inventory_from_recording(
    recording: Mapping[str, Any],
    *,
    node: str,
    labels: Mapping[str, str] | None = None,
    notes: list[str] | None = None,
) -> NodeInventory:
    """Build the node inventory from AMD SMI answers (a live probe or a recording).

    Args:
        recording: ``{"gpus": [{<call>: value | {"error": name}}], "pairs": [{"i", "j",
            "amdsmi_topo_get_link_type": {"type": "XGMI", "hops": 1}}]}``.
        node: node name.
        labels: node labels.
        notes: list that receives remarks (catalog fallbacks, mismatches).
    """
    notes = notes if notes is not None else []
    raw_gpus: list[Mapping[str, Any]] = list(recording.get("gpus", []))
    bdfs = {int(r["index"]): _value(r, K_BDF) for r in raw_gpus}
    peers: dict[int, list[int]] = {int(r["index"]): [] for r in raw_gpus}
    for pair in recording.get("pairs", []):
        link = _value(pair, K_LINK)
        if (
            isinstance(link, Mapping)
            and link.get("type") == "XGMI"
            and link.get("hops") in (1, None)
        ):
            i, j = int(pair["i"]), int(pair["j"])
            peers[i].append(j)
            peers[j].append(i)
    partial_gpus = [_gpu_from_raw(r, peers, bdfs, notes) for r in raw_gpus]
    domains = _xgmi_domains(node, raw_gpus, peers)
    gpus = tuple(
        GpuInventory(
            **{
                **{k: getattr(g, k) for k in GpuInventory.__dataclass_fields__},
                "nvlink_domain": domains.get(g.index),
            }
        )
        for g in partial_gpus
    )
    return NodeInventory(node=node, gpus=gpus, labels=dict(labels or {}), discovered_by=("amdsmi",))


def _catalog(name: str, index: int, notes: list[str]) -> GpuSpec | None:
    try:
        return lookup(name)
    except InputError:
        notes.append(f"gpu{index}: {name!r} is not in the GPU catalog; planning needs figures")
        return None


def _gpu_from_raw(
    raw: Mapping[str, Any],
    peers: Mapping[int, Sequence[int]],
    bdfs: Mapping[int, Any],
    notes: list[str],
) -> GpuInventory:
    index = int(raw["index"])
    market = _field(raw, K_ASIC, "market_name")
    name = str(market) if market else f"unknown-amd-gpu-{index}"
    spec = _catalog(name, index, notes)
    gfx = _field(raw, K_ASIC, "target_graphics_version")
    gfx_text = gfx if isinstance(gfx, str) and gfx.startswith("gfx") else ""
    architecture = AMD_ARCHITECTURES.get(gfx_text, "") or (spec.architecture if spec else "")
    cc = gfx_text or (spec.compute_capability if spec else "")
    cus = _int(_field(raw, K_ASIC, "num_compute_units", "num_of_compute_units"))
    if cus is None:
        cus = spec.sms if spec else 0
        notes.append(f"gpu{index}: compute-unit count from catalog ({cus})")
    elif spec is not None and cus != spec.sms:
        notes.append(f"gpu{index}: AMD SMI gives {cus} CUs, catalog {spec.sms}; using {cus}")
    memory = _int(_value(raw, K_MEM))
    if memory is None:
        mb = _int(_field(raw, K_VRAM, "vram_size"))
        memory = mb * 2**20 if mb else (int(spec.memory_gib * 2**30) if spec else 0)
    bandwidth = _field(raw, K_VRAM, "vram_max_bandwidth")
    if (
        isinstance(bandwidth, int | float)
        and not isinstance(bandwidth, bool)
        and 0 < bandwidth < 1e6
    ):
        hbm = float(bandwidth)
    else:
        hbm = spec.hbm_bandwidth_gbytes_per_s if spec else 0.0
        notes.append(f"gpu{index}: VRAM bandwidth not reported; HBM bandwidth from catalog")
    power_uw = _int(_field(raw, K_POWER, "power_cap"))
    pcie = _field(raw, K_PCIE, "pcie_static")
    width = gen = 0
    if isinstance(pcie, Mapping):
        width = _int(pcie.get("max_pcie_width")) or 0
        gen = _int(pcie.get("pcie_interface_version")) or PCIE_GENERATION_BY_MTS.get(
            _int(pcie.get("max_pcie_speed")) or 0, 0
        )
    uuid = _value(raw, K_UUID)
    bdf = _value(raw, K_BDF)
    links = tuple(
        NvLinkInfo(
            link=k,
            active=True,
            generation=XGMI_MI300_GENERATION,
            remote_bus_id=b if isinstance(b := bdfs.get(peer), str) else "",
        )
        for k, peer in enumerate(sorted(peers.get(index, ())))
    )
    ecc = _int(_field(raw, K_ECC, "uncorrectable_count"))
    bad = _int(_value(raw, K_BAD_PAGES))
    return GpuInventory(
        index=index,
        uuid=uuid if isinstance(uuid, str) and uuid else f"GPU-unknown-{index}",
        name=name,
        catalog_model=spec.model if spec else "",
        architecture=architecture,
        compute_capability=cc,
        sms=cus,
        memory_bytes=memory,
        hbm_bandwidth_gbytes_per_s=hbm,
        sm_clock_mhz=_int(_field(raw, K_CLOCK, "max_clk")) or 0,
        power_limit_w=power_uw / 1e6 if power_uw else 0.0,
        pci_bus_id=bdf if isinstance(bdf, str) else "",
        pcie_generation=gen,
        pcie_width=width,
        nvlinks=links,
        health=GpuHealth(ecc_uncorrected_volatile=ecc, retired_pages=bad),
    )


def _xgmi_domains(
    node: str, raw_gpus: Sequence[Mapping[str, Any]], peers: Mapping[int, Sequence[int]]
) -> dict[int, str]:
    """Domain id per GPU index: its xGMI hive, else its component of direct xGMI links;
    GPUs without xGMI get none."""
    group: dict[int, object] = {}
    for r in raw_gpus:
        i = int(r["index"])
        hive = _int(_field(r, K_XGMI, "xgmi_hive_id"))
        if hive:
            group[i] = ("hive", hive)
    parent = {i: i for i in peers}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, js in peers.items():
        for j in js:
            parent[find(i)] = find(j)
    for i, js in peers.items():
        if i not in group and js:
            group[i] = ("links", find(i))
    keys = list(dict.fromkeys(group[i] for i in sorted(group)))
    return {i: node if len(keys) == 1 else f"{node}-xgmi{keys.index(k)}" for i, k in group.items()}


def record_node(amdsmi: Any = None, *, node_name: str = "") -> dict[str, Any]:
    """Discover the node; returns ``{"inventory", "recording", "notes"}`` (the recording in
    the fixture format).

    Raises:
        DiscoveryError: AMD SMI cannot run here.
    """
    from policies.hardware.inventory import inventory_to_dict

    backend = AmdSmiDiscovery(node_name=node_name, amdsmi=amdsmi)
    inv = backend.discover()
    return {
        "inventory": inventory_to_dict(inv),
        "recording": backend.recording,
        "notes": list(backend.notes),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agents.discovery.amdsmi [--node NAME] [--out FILE]``: print or write what
    AMD SMI discovery reports (inventory plus the raw answers, a test fixture)."""
    return recording_main(argv, main.__doc__ or "", record_node)


if __name__ == "__main__":
    raise SystemExit(main())
