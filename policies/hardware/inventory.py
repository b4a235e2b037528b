"""What a node agent reports: its GPUs, links, NICs and health.

Discovery backends (NVML, sysfs, a static Fleet file) fill a :class:`NodeInventory`; the
controller turns it into the planning core's :class:`policies.hardware.fleet.Node` with
:meth:`NodeInventory.to_node`, so a reported node and a node from a Fleet file are planned
the same way.

Units: bytes for memory, GB/s for HBM and NVLink (NVLink bidirectional per GPU, like
datasheets), Gb/s for NIC ports, MHz for clocks, W for power.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from policies.errors import InputError
from policies.hardware.catalog import GpuSpec, lookup
from policies.hardware.fleet import Gpu, GpuId, NicGroup, Node, NvLinkDomain
from policies.keys import check_keys
from policies.limits import (
    MAX_GPUS_PER_NODE,
    NIC_GBITS_RANGE,
    check_figure,
    check_host_address,
    check_node_name,
    check_reported_gpu,
    key_path,
    measured_range,
)

#: AMD Infinity Fabric (xGMI) links are reported as :class:`NvLinkInfo` with this generation
#: code, outside NVLink's 1-5: the MI300X's xGMI, 64 GB/s per direction per link (7 links,
#: 896 GB/s per GPU bidirectional in AMD's published figures). See agents/discovery/amdsmi.py.
XGMI_MI300_GENERATION = 103
#: Per-direction bandwidth of one NVLink by NVLink generation, GB/s (NVIDIA NVLink specs).
NVLINK_GBS_PER_LINK_PER_DIRECTION = {
    1: 20.0,
    2: 25.0,
    3: 25.0,
    4: 25.0,
    5: 50.0,
    XGMI_MI300_GENERATION: 64.0,
}
#: nvmlDeviceGetNvLinkVersion returns an enum, not the generation (6 == NVLink 4.0).
NVML_NVLINK_VERSION_TO_GENERATION = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5}
AGENT_VERSION = "0.1.0"


@dataclass(frozen=True)
class NvLinkInfo:
    """One NVLink of a GPU.

    Attributes:
        link: link index.
        active: link state is up.
        generation: NVLink generation (4 on Hopper).
        remote_bus_id: PCI bus id at the far end; ``FFFFFFFF:FF:FF.0`` means an NVSwitch.
    """

    link: int
    active: bool
    generation: int
    remote_bus_id: str

    @property
    def to_switch(self) -> bool:
        return self.remote_bus_id.upper().startswith("FFFFFFFF")


@dataclass(frozen=True)
class GpuHealth:
    """Health signals of a GPU; None where the GPU does not support the counter.

    Attributes:
        ecc_uncorrected_volatile: uncorrected ECC errors since the driver loaded.
        retired_pages: pages retired for double-bit errors (pre-Ampere) .
        remapped_rows_pending: a row remap awaits a GPU reset (Ampere and newer).
        remapped_rows_failed: row remapping failed: the GPU needs service.
        xid_errors: XID codes seen since the last report.
    """

    ecc_uncorrected_volatile: int | None = None
    retired_pages: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    xid_errors: tuple[int, ...] = ()

    #: XIDs that mean the GPU cannot be trusted until reset (48 DBE, 63/64 remap, 74 NVLink,
    #: 79 fallen off the bus, 92/94/95 ECC, 119/120 GSP).
    FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})

    @property
    def healthy(self) -> bool:
        """False when a signal says work placed on this GPU may fail."""
        if self.remapped_rows_failed or self.remapped_rows_pending:
            return False
        if self.ecc_uncorrected_volatile:
            return False
        return not any(x in self.FATAL_XIDS for x in self.xid_errors)


@dataclass(frozen=True)
class GpuInventory:
    """One GPU as discovered.

    Attributes:
        index: device index on the node.
        uuid: hardware UUID.
        name: name as the driver reports it (``NVIDIA H200``).
        catalog_model: mixfleet catalog entry (``H200-SXM-141GB``); empty when unknown.
        architecture: ``ampere`` | ``ada`` | ``hopper`` | ``blackwell`` | ``cdna3`` | ...
        compute_capability: ``"9.0"`` (CUDA) or gfx target.
        sms: streaming multiprocessors.
        memory_bytes: device memory.
        hbm_bandwidth_gbytes_per_s: peak memory bandwidth (bus width x memory clock x 2), GB/s.
        sm_clock_mhz: maximum SM clock.
        power_limit_w: power management limit.
        pci_bus_id: PCI bus id.
        pcie_generation, pcie_width: maximum PCIe link.
        nvlinks: NVLinks (empty for PCIe-only GPUs).
        nvlink_domain: NVLink domain id (node name behind one NVSwitch, fabric clique for
            multi-node NVLink), None when the GPU has no active NVLink.
        measured: calibrated figures (keys of :class:`policies.estimate.costmodel.MeasuredFigures`).
        health: health signals.
    """

    index: int
    uuid: str
    name: str
    catalog_model: str
    architecture: str
    compute_capability: str
    sms: int
    memory_bytes: int
    hbm_bandwidth_gbytes_per_s: float
    sm_clock_mhz: int = 0
    power_limit_w: float = 0.0
    pci_bus_id: str = ""
    pcie_generation: int = 0
    pcie_width: int = 0
    nvlinks: tuple[NvLinkInfo, ...] = ()
    nvlink_domain: str | None = None
    measured: Mapping[str, float] = field(default_factory=dict)
    health: GpuHealth = field(default_factory=GpuHealth)

    @property
    def nvlink_bidir_gbytes_per_s(self) -> float:
        """Bidirectional NVLink bandwidth over the active links, GB/s."""
        return sum(
            2 * NVLINK_GBS_PER_LINK_PER_DIRECTION.get(link.generation, 25.0)
            for link in self.nvlinks
            if link.active
        )


@dataclass(frozen=True)
class NicInventory:
    """One RDMA port.

    Attributes:
        device: RDMA device (``mlx5_0``).
        port: port number.
        rate_per_direction_gbits_per_s: port rate, Gb/s per direction.
        state: ``ACTIVE`` etc.
        link_layer: ``infiniband`` or ``ethernet`` (RoCE).
        fabric: fabric (segment) name, from configuration; ``default`` when not set.
        numa_node: NUMA node of the NIC's PCI function, -1 when unknown.
    """

    device: str
    port: int
    rate_per_direction_gbits_per_s: float
    state: str
    link_layer: str
    fabric: str = "default"
    numa_node: int = -1

    @property
    def active(self) -> bool:
        return self.state.upper().endswith("ACTIVE")


@dataclass(frozen=True)
class NodeInventory:
    """A node as its agent reports it.

    Attributes:
        node: node name.
        gpus: GPUs in index order.
        nics: RDMA ports.
        labels: node labels (``tier``, ``rack``...).
        agent_version: reporting agent's version.
        simulated: True for agents run by ``--simulate-fleet`` (no real hardware).
        discovered_by: backend names, e.g. ``("nvml", "sysfs")``.
        address: host name or IP address at which the node's engines serve
            (``mixfleet-agent --advertise-address``); ``""`` = the node name.
    """

    node: str
    gpus: tuple[GpuInventory, ...]
    nics: tuple[NicInventory, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    agent_version: str = AGENT_VERSION
    simulated: bool = False
    discovered_by: tuple[str, ...] = ()
    address: str = ""

    def healthy_gpus(self) -> tuple[GpuInventory, ...]:
        return tuple(g for g in self.gpus if g.health.healthy)

    def to_node(self, *, healthy_only: bool = True) -> Node:
        """The planning core's view of this node: catalog specs with discovered figures
        (memory, HBM bandwidth, SMs) and measured efficiencies taking precedence.

        Raises:
            InputError: a GPU matches no catalog entry and reports no usable figures.
        """
        gpus: list[Gpu] = []
        for g in self.healthy_gpus() if healthy_only else self.gpus:
            spec = gpu_spec(g, field_path=f"{self.node}.gpus[{g.index}]")
            gpus.append(Gpu(GpuId(f"{self.node}/gpu{g.index}"), self.node, g.index, spec, g.uuid))
        nvlink = None
        domains = {g.nvlink_domain for g in self.gpus if g.nvlink_domain}
        if len(domains) == 1 and all(g.nvlink_domain for g in self.gpus):
            per_gpu = min(g.nvlink_bidir_gbytes_per_s for g in self.gpus)
            if per_gpu > 0:
                nvlink = NvLinkDomain(domains.pop(), per_gpu)
        by_fabric: dict[tuple[str, float, str], int] = {}
        for nic in self.nics:
            if nic.active and nic.rate_per_direction_gbits_per_s > 0:
                key = (nic.fabric, nic.rate_per_direction_gbits_per_s, nic.link_layer)
                by_fabric[key] = by_fabric.get(key, 0) + 1
        nics = tuple(
            NicGroup(count, rate, fabric, layer)
            for (fabric, rate, layer), count in sorted(by_fabric.items())
        )
        return Node(self.node, tuple(gpus), nvlink, nics, dict(self.labels))


def gpu_spec(g: GpuInventory, *, field_path: str = "") -> GpuSpec:
    """Catalog spec of a discovered GPU, with discovered memory, bandwidth and SMs.

    Raises:
        InputError: unknown GPU (the message lists the closest catalog entries).
    """
    spec = lookup(g.catalog_model or g.name, field_path=field_path)
    overrides: dict[str, Any] = {}
    if g.memory_bytes > 0:
        overrides["memory_gib"] = g.memory_bytes / 2**30
    if g.hbm_bandwidth_gbytes_per_s > 0:
        overrides["hbm_bandwidth_gbytes_per_s"] = g.hbm_bandwidth_gbytes_per_s
    if g.sms > 0:
        overrides["sms"] = g.sms
    return replace(spec.with_overrides(overrides, field_path=field_path), model=spec.model)


def inventory_from_node(node: Node, *, simulated: bool = True) -> NodeInventory:
    """An inventory for a node declared in a Fleet file (static discovery, simulation)."""
    gpus = []
    for g in node.gpus:
        links: tuple[NvLinkInfo, ...] = ()
        if node.nvlink is not None:
            n_links = max(1, round(node.nvlink.per_gpu_bidir_gbytes_per_s / 50.0))
            links = tuple(NvLinkInfo(i, True, 4, "FFFFFFFF:FF:FF.0") for i in range(n_links))
        gpus.append(
            GpuInventory(
                index=g.index,
                uuid=g.uuid or f"GPU-sim-{node.name}-{g.index}",
                name=g.spec.model,
                catalog_model=g.spec.model,
                architecture=g.spec.architecture,
                compute_capability=g.spec.compute_capability,
                sms=g.spec.sms,
                memory_bytes=int(g.spec.memory_gib * 2**30),
                hbm_bandwidth_gbytes_per_s=g.spec.hbm_bandwidth_gbytes_per_s,
                nvlinks=links,
                nvlink_domain=node.nvlink.domain if node.nvlink else None,
            )
        )
    nics = tuple(
        NicInventory(
            f"sim_{grp.fabric}_{k}",
            1,
            grp.per_direction_gbits_per_s,
            "4: ACTIVE",
            grp.link_layer,
            grp.fabric,
        )
        for grp in node.nics
        for k in range(grp.count)
    )
    return NodeInventory(
        node.name,
        tuple(gpus),
        nics,
        dict(node.labels),
        simulated=simulated,
        discovered_by=("static",),
    )


def check_inventory(inv: NodeInventory) -> None:
    """Validate a reported inventory (RPC input).

    Raises:
        InputError: naming the field: empty node name, NaN/negative figures, duplicate
            GPU UUIDs or indices.
    """
    import math

    if not inv.node:
        raise InputError("node name is empty", field="inventory.node")
    check_node_name(inv.node, "inventory.node")
    if inv.address:
        check_host_address(inv.address, "inventory.address")
    if len(inv.gpus) > MAX_GPUS_PER_NODE:
        raise InputError(
            f"reports {len(inv.gpus):,} GPUs, over the limit of {MAX_GPUS_PER_NODE:,} per node",
            field="inventory.gpus",
        )
    seen_uuid: dict[str, int] = {}
    seen_idx: set[int] = set()
    for k, g in enumerate(inv.gpus):
        path = f"inventory.gpus[{k}]"
        if g.index in seen_idx:
            raise InputError(f"duplicate GPU index {g.index}", field=f"{path}.index")
        seen_idx.add(g.index)
        if not g.uuid:
            raise InputError("GPU uuid is empty", field=f"{path}.uuid")
        if g.uuid in seen_uuid:
            raise InputError(
                f"duplicate GPU uuid {g.uuid!r} (also gpus[{seen_uuid[g.uuid]}])",
                field=f"{path}.uuid",
            )
        seen_uuid[g.uuid] = k
        for name in ("hbm_bandwidth_gbytes_per_s", "power_limit_w"):
            v = getattr(g, name)
            if math.isnan(v) or math.isinf(v) or v < 0:
                raise InputError(f"must be a finite number >= 0, got {v}", field=f"{path}.{name}")
        if g.memory_bytes < 0 or g.sms < 0:
            raise InputError("memory_bytes and sms must be >= 0", field=path)
        check_reported_gpu(
            g.memory_bytes, g.hbm_bandwidth_gbytes_per_s, g.sms, g.power_limit_w, path
        )
        for key, v in g.measured.items():  # NaN, infinities and v <= 0 are out of range too
            check_figure(v, *measured_range(key), key_path(f"{path}.measured", key), zero=False)
    for k, nic in enumerate(inv.nics):
        rate_path = f"inventory.nics[{k}].rate_per_direction_gbits_per_s"
        check_figure(nic.rate_per_direction_gbits_per_s, *NIC_GBITS_RANGE, rate_path)


# --------------------------------------------------------------------------- JSON codec
#
# The one JSON form of a NodeInventory (``mixfleet-agent discover`` output, the
# ``calibrate --inventory`` file, benchmark records): the dataclass field names as keys,
# tuples as lists, every field written. Reading rejects unknown keys and names the field
# path of anything malformed. Keys written before the unit rename are read as their new
# names (see LEGACY_INVENTORY_KEYS).

#: Pre-rename keys accepted by :func:`inventory_from_dict`: old key -> new key.
LEGACY_INVENTORY_KEYS = {
    "hbm_bandwidth_gbps": "hbm_bandwidth_gbytes_per_s",
    "rate_gbps": "rate_per_direction_gbits_per_s",
}


def inventory_to_dict(inv: NodeInventory) -> dict[str, Any]:
    """A node inventory as JSON-ready data (every field; the inverse of
    :func:`inventory_from_dict`)."""
    return {
        "node": inv.node,
        "gpus": [_gpu_to_dict(g) for g in inv.gpus],
        "nics": [
            {
                "device": n.device,
                "port": n.port,
                "rate_per_direction_gbits_per_s": n.rate_per_direction_gbits_per_s,
                "state": n.state,
                "link_layer": n.link_layer,
                "fabric": n.fabric,
                "numa_node": n.numa_node,
            }
            for n in inv.nics
        ],
        "labels": dict(inv.labels),
        "agent_version": inv.agent_version,
        "simulated": inv.simulated,
        "discovered_by": list(inv.discovered_by),
        "address": inv.address,
    }


def _gpu_to_dict(g: GpuInventory) -> dict[str, Any]:
    h = g.health
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "catalog_model": g.catalog_model,
        "architecture": g.architecture,
        "compute_capability": g.compute_capability,
        "sms": g.sms,
        "memory_bytes": g.memory_bytes,
        "hbm_bandwidth_gbytes_per_s": g.hbm_bandwidth_gbytes_per_s,
        "sm_clock_mhz": g.sm_clock_mhz,
        "power_limit_w": g.power_limit_w,
        "pci_bus_id": g.pci_bus_id,
        "pcie_generation": g.pcie_generation,
        "pcie_width": g.pcie_width,
        "nvlinks": [
            {
                "link": x.link,
                "active": x.active,
                "generation": x.generation,
                "remote_bus_id": x.remote_bus_id,
            }
            for x in g.nvlinks
        ],
        "nvlink_domain": g.nvlink_domain,
        "measured": dict(g.measured),
        "health": {
            "ecc_uncorrected_volatile": h.ecc_uncorrected_volatile,
            "retired_pages": h.retired_pages,
            "remapped_rows_pending": h.remapped_rows_pending,
            "remapped_rows_failed": h.remapped_rows_failed,
            "xid_errors": list(h.xid_errors),
        },
    }


class _Reader:
    """Typed reads from one JSON object, with its field path for error messages."""

    def __init__(self, doc: Any, path: str, known: set[str]) -> None:
        if not isinstance(doc, Mapping):
            raise InputError(f"must be an object, got {type(doc).__name__}", field=path)
        self.doc = {LEGACY_INVENTORY_KEYS.get(str(k), str(k)): v for k, v in doc.items()}
        self.path = path
        check_keys(self.doc, known, path, what="key")

    def _get(self, key: str, default: Any) -> Any:
        if key not in self.doc:
            if default is _REQUIRED:
                raise InputError(f"missing required field {key!r}", field=f"{self.path}.{key}")
            return default
        return self.doc[key]

    def _fail(self, key: str, what: str, value: Any) -> InputError:
        return InputError(f"must be {what}, got {value!r}", field=f"{self.path}.{key}")

    def str_(self, key: str, default: Any = None) -> str:
        v = self._get(key, _REQUIRED if default is None else default)
        if not isinstance(v, str):
            raise self._fail(key, "a string", v)
        return v

    def int_(self, key: str, default: Any = None) -> int:
        v = self._get(key, _REQUIRED if default is None else default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(key, "an integer", v)
        return v

    def float_(self, key: str, default: Any = None) -> float:
        v = self._get(key, _REQUIRED if default is None else default)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self._fail(key, "a number", v)
        return float(v)

    def bool_(self, key: str, default: Any = None) -> bool:
        v = self._get(key, _REQUIRED if default is None else default)
        if not isinstance(v, bool):
            raise self._fail(key, "true or false", v)
        return v

    def optional(self, key: str, kind: type) -> Any:
        v = self.doc.get(key)
        if v is None:
            return None
        if isinstance(v, bool) != (kind is bool) or not isinstance(v, kind):
            raise self._fail(key, f"{kind.__name__} or null", v)
        return v

    def list_(self, key: str) -> list[Any]:
        v = self._get(key, [])
        if not isinstance(v, list | tuple):
            raise self._fail(key, "a list", v)
        return list(v)

    def mapping(self, key: str) -> Mapping[str, Any]:
        v = self._get(key, {})
        if not isinstance(v, Mapping):
            raise self._fail(key, "an object", v)
        return v


_REQUIRED = object()
_NODE_KEYS = set(NodeInventory.__dataclass_fields__)
_GPU_KEYS = set(GpuInventory.__dataclass_fields__)
_NIC_KEYS = set(NicInventory.__dataclass_fields__)
_NVLINK_KEYS = set(NvLinkInfo.__dataclass_fields__)
_HEALTH_KEYS = set(GpuHealth.__dataclass_fields__)


def inventory_from_dict(doc: Any, path: str = "inventory") -> NodeInventory:
    """Read :func:`inventory_to_dict`'s form back (every field; defaults where omitted).

    Raises:
        InputError: naming the field path (``inventory.gpus[0].nvlinks[1].generation``):
            unknown key, missing required field, or a value of the wrong type.
    """
    r = _Reader(doc, path, _NODE_KEYS)
    labels = r.mapping("labels")
    nics = []
    for k, raw in enumerate(r.list_("nics")):
        n = _Reader(raw, f"{path}.nics[{k}]", _NIC_KEYS)
        nics.append(
            NicInventory(
                device=n.str_("device"),
                port=n.int_("port"),
                rate_per_direction_gbits_per_s=n.float_("rate_per_direction_gbits_per_s"),
                state=n.str_("state"),
                link_layer=n.str_("link_layer"),
                fabric=n.str_("fabric", "default"),
                numa_node=n.int_("numa_node", -1),
            )
        )
    return NodeInventory(
        node=r.str_("node"),
        gpus=tuple(_gpu_from_dict(g, f"{path}.gpus[{k}]") for k, g in enumerate(r.list_("gpus"))),
        nics=tuple(nics),
        labels={str(k): _str_value(v, key_path(f"{path}.labels", k)) for k, v in labels.items()},
        agent_version=r.str_("agent_version", AGENT_VERSION),
        simulated=r.bool_("simulated", False),
        discovered_by=tuple(
            _str_value(v, f"{path}.discovered_by[{k}]")
            for k, v in enumerate(r.list_("discovered_by"))
        ),
        address=r.str_("address", ""),
    )


def _str_value(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise InputError(f"must be a string, got {v!r}", field=path)
    return v


def _gpu_from_dict(doc: Any, path: str) -> GpuInventory:
    g = _Reader(doc, path, _GPU_KEYS)
    links = []
    for k, raw in enumerate(g.list_("nvlinks")):
        x = _Reader(raw, f"{path}.nvlinks[{k}]", _NVLINK_KEYS)
        links.append(
            NvLinkInfo(
                x.int_("link"), x.bool_("active"), x.int_("generation"), x.str_("remote_bus_id")
            )
        )
    measured: dict[str, float] = {}
    for key, v in g.mapping("measured").items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise InputError(
                f"must be a number, got {v!r}", field=key_path(f"{path}.measured", key)
            )
        measured[str(key)] = float(v)
    h = _Reader(g.mapping("health"), f"{path}.health", _HEALTH_KEYS)
    xids = h.list_("xid_errors")
    for k, x in enumerate(xids):
        if isinstance(x, bool) or not isinstance(x, int):
            raise InputError(
                f"must be an integer, got {x!r}", field=f"{path}.health.xid_errors[{k}]"
            )
    return GpuInventory(
        index=g.int_("index"),
        uuid=g.str_("uuid"),
        name=g.str_("name"),
        catalog_model=g.str_("catalog_model"),
        architecture=g.str_("architecture"),
        compute_capability=g.str_("compute_capability"),
        sms=g.int_("sms"),
        memory_bytes=g.int_("memory_bytes"),
        hbm_bandwidth_gbytes_per_s=g.float_("hbm_bandwidth_gbytes_per_s"),
        sm_clock_mhz=g.int_("sm_clock_mhz", 0),
        power_limit_w=g.float_("power_limit_w", 0.0),
        pci_bus_id=g.str_("pci_bus_id", ""),
        pcie_generation=g.int_("pcie_generation", 0),
        pcie_width=g.int_("pcie_width", 0),
        nvlinks=tuple(links),
        nvlink_domain=g.optional("nvlink_domain", str),
        measured=measured,
        health=GpuHealth(
            ecc_uncorrected_volatile=h.optional("ecc_uncorrected_volatile", int),
            retired_pages=h.optional("retired_pages", int),
            remapped_rows_pending=h.optional("remapped_rows_pending", bool),
            remapped_rows_failed=h.optional("remapped_rows_failed", bool),
            xid_errors=tuple(xids),
        ),
    )
