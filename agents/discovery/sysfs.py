"""RDMA NICs from Linux sysfs, without extra libraries (the kernel's sysfs-class-infiniband ABI).

Layout read, for every device ``<dev>`` and port ``<n>``::

    <root>/class/infiniband/<dev>/ports/<n>/rate          "400 Gb/sec (4X NDR)"
    <root>/class/infiniband/<dev>/ports/<n>/state         "4: ACTIVE"
    <root>/class/infiniband/<dev>/ports/<n>/phys_state    "5: LinkUp"
    <root>/class/infiniband/<dev>/ports/<n>/link_layer    "InfiniBand" | "Ethernet" (RoCE)
    <root>/class/infiniband/<dev>/ports/<n>/gid_attrs/types/<i>   "IB/RoCE v1" | "RoCE v2"
    <root>/class/infiniband/<dev>/device -> PCI function; device/numa_node: its NUMA node

``root`` is ``/sys`` on a host; tests build a fake tree under a temporary directory.
Which fabric (network segment) a port is on cannot be read from the host: it comes from
configuration, a mapping ``device`` or ``device/port`` -> fabric name, default ``default``.

A missing ``class/infiniband`` directory means the node has no RDMA NICs: that is not an
error. Unreadable or malformed single files degrade that field (rate 0, NUMA -1) rather than
failing discovery; a port with rate 0 or not ACTIVE is not planned on.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from policies.hardware.inventory import NicInventory, NodeInventory

_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")


@dataclass(frozen=True)
class RdmaPort:
    """One RDMA port as sysfs shows it.

    Attributes:
        device: RDMA device name (``mlx5_0``).
        port: port number (from 1).
        rate_per_direction_gbits_per_s: port rate, Gb/s per direction; 0 when unreadable.
        state: logical state, e.g. ``4: ACTIVE``.
        phys_state: physical state, e.g. ``5: LinkUp``; empty when unreadable.
        link_layer: ``infiniband`` or ``ethernet`` (RoCE); lower case.
        roce_versions: RoCE versions the port's GID table offers (``v1``, ``v2``); empty for
            InfiniBand ports.
        pci_address: PCI function of the device (``0000:17:00.0``); empty when unknown.
        numa_node: NUMA node of the PCI function, -1 when unknown.
        fabric: fabric name from configuration.
    """

    device: str
    port: int
    rate_per_direction_gbits_per_s: float
    state: str
    phys_state: str
    link_layer: str
    roce_versions: tuple[str, ...]
    pci_address: str
    numa_node: int
    fabric: str

    @property
    def link_up(self) -> bool:
        """Logical state ACTIVE and (where readable) physical state LinkUp."""
        logical = self.state.upper().endswith("ACTIVE")
        physical = not self.phys_state or self.phys_state.lower().endswith("linkup")
        return logical and physical

    def to_nic(self) -> NicInventory:
        """The inventory entry; a port whose physical link is down reports state DOWN."""
        state = self.state
        if self.state.upper().endswith("ACTIVE") and not self.link_up:
            # Logically active but the cable is down: not usable, say why.
            state = f"DOWN (state {self.state}, phys_state {self.phys_state})"
        return NicInventory(
            device=self.device,
            port=self.port,
            rate_per_direction_gbits_per_s=self.rate_per_direction_gbits_per_s,
            state=state,
            link_layer=self.link_layer,
            fabric=self.fabric,
            numa_node=self.numa_node,
        )


def parse_rate_gbits_per_s(text: str) -> float:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0; ``"2.5 Gb/sec (1X SDR)"`` -> 2.5; else 0.0."""
    m = _RATE_RE.match(text)
    return float(m.group(1)) if m else 0.0


def parse_roce_version(text: str) -> str | None:
    """A ``gid_attrs/types/<i>`` value -> ``v1`` | ``v2`` | None (unset entry)."""
    t = text.strip().lower()
    if "v2" in t:
        return "v2"
    if "v1" in t:
        return "v1"
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        # Unused GID entries answer EINVAL on read; vanished devices ENOENT.
        return None


def _int_or(text: str | None, default: int) -> int:
    if text is None:
        return default
    try:
        return int(text.strip())
    except ValueError:
        return default


class SysfsNicDiscovery:
    """RDMA ports of this host from sysfs.

    Satisfies :class:`~agents.discovery.base.DiscoveryBackend` (an inventory with NICs and
    no GPUs); usually used through :meth:`augment` to add NICs to a GPU backend's inventory.

    Attributes:
        name: ``sysfs``.
        root: sysfs mount point (``/sys``).
        fabrics: ``device`` or ``device/port`` -> fabric name; ``device/port`` wins.
        default_fabric: fabric of ports the mapping does not name.
        node_name: node name for :meth:`discover` (the host name by default).
    """

    name = "sysfs"

    def __init__(
        self,
        root: str | Path = "/sys",
        *,
        fabrics: Mapping[str, str] | None = None,
        default_fabric: str = "default",
        node_name: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.fabrics = dict(fabrics or {})
        self.default_fabric = default_fabric
        self.node_name = node_name or socket.gethostname()

    def fabric_of(self, device: str, port: int) -> str:
        return self.fabrics.get(f"{device}/{port}", self.fabrics.get(device, self.default_fabric))

    def ports(self) -> tuple[RdmaPort, ...]:
        """Every RDMA port, sorted by device then port number."""
        base = self.root / "class" / "infiniband"
        if not base.is_dir():
            return ()
        found: list[RdmaPort] = []
        for dev_dir in sorted(base.iterdir(), key=lambda p: p.name):
            ports_dir = dev_dir / "ports"
            if not ports_dir.is_dir():
                continue
            numa = _int_or(_read(dev_dir / "device" / "numa_node"), -1)
            pci = ""
            if (dev_dir / "device").exists():
                pci = os.path.basename(os.path.realpath(dev_dir / "device"))
                if pci == "device":  # a plain directory (not a link), as in test trees
                    pci = ""
            numbered = [p for p in ports_dir.iterdir() if p.name.isdigit()]
            for port_dir in sorted(numbered, key=lambda p: int(p.name)):
                found.append(self._port(dev_dir.name, int(port_dir.name), port_dir, pci, numa))
        return tuple(found)

    def _port(self, device: str, port: int, d: Path, pci: str, numa: int) -> RdmaPort:
        layer = (_read(d / "link_layer") or "infiniband").lower()
        roce: set[str] = set()
        types_dir = d / "gid_attrs" / "types"
        if layer == "ethernet" and types_dir.is_dir():
            for entry in types_dir.iterdir():
                v = parse_roce_version(_read(entry) or "")
                if v:
                    roce.add(v)
        return RdmaPort(
            device=device,
            port=port,
            rate_per_direction_gbits_per_s=parse_rate_gbits_per_s(_read(d / "rate") or ""),
            state=_read(d / "state") or "",
            phys_state=_read(d / "phys_state") or "",
            link_layer=layer,
            roce_versions=tuple(sorted(roce)),
            pci_address=pci,
            numa_node=numa,
            fabric=self.fabric_of(device, port),
        )

    def nics(self) -> tuple[NicInventory, ...]:
        return tuple(p.to_nic() for p in self.ports())

    def discover(self) -> NodeInventory:
        return NodeInventory(self.node_name, (), self.nics(), discovered_by=(self.name,))

    def augment(self, inv: NodeInventory) -> NodeInventory:
        """``inv`` with its NICs replaced by the ones found here (when any were found)."""
        nics = self.nics()
        if not nics:
            return inv
        return replace(inv, nics=nics, discovered_by=(*inv.discovered_by, self.name))
