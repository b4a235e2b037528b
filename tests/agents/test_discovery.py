"""Static (Fleet file) and sysfs (RDMA NIC) discovery."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.discovery.base import DiscoveryError
from agents.discovery.static import StaticDiscovery, discover_fleet, load_fleet_file
from agents.discovery.sysfs import SysfsNicDiscovery, parse_rate_gbits_per_s, parse_roce_version
from policies.errors import InputError
from policies.hardware.inventory import NodeInventory, check_inventory

REPO = Path(__file__).resolve().parents[2]
MIXED_24 = REPO / "examples" / "fleets" / "mixed-24.yaml"


# --------------------------------------------------------------------------- static


def test_static_node_from_fleet_file_plans_like_the_file() -> None:
    fleet = load_fleet_file(MIXED_24)
    inv = StaticDiscovery.from_file(MIXED_24, "h200-0").discover()
    check_inventory(inv)
    assert inv.node == "h200-0" and not inv.simulated
    assert inv.discovered_by == ("static",)
    assert len(inv.gpus) == 8 and len(inv.nics) == 4
    node = inv.to_node()
    want = fleet.node("h200-0")
    assert [g.spec.model for g in node.gpus] == [g.spec.model for g in want.gpus]
    assert node.nvlink is not None and node.nvlink.domain == "h200-0"
    assert node.rdma_per_direction_gbits_per_s == want.rdma_per_direction_gbits_per_s == 1600
    assert node.labels == {"rack": "r2"}


def test_simulated_fleet_has_unique_gpu_uuids() -> None:
    invs = discover_fleet(load_fleet_file(MIXED_24))
    assert [i.node for i in invs] == ["a100-0", "h100-0", "h200-0"]
    assert all(i.simulated for i in invs)
    uuids = [g.uuid for i in invs for g in i.gpus]
    assert len(uuids) == len(set(uuids)) == 24


def test_static_unknown_node_and_missing_file_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="To fix: pick one of a100-0, h100-0, h200-0"):
        StaticDiscovery.from_file(MIXED_24, "b200-9")
    with pytest.raises(DiscoveryError, match="cannot read fleet file"):
        StaticDiscovery.from_file(tmp_path / "nope.yaml", "x")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: {nodes: [{name: a, gpus: [{model: Z80}]}]}\n")
    with pytest.raises(InputError) as err:
        load_fleet_file(bad)
    assert err.value.field.startswith("spec.nodes[0].gpus[0]")


# --------------------------------------------------------------------------- sysfs


def _port(
    root: Path,
    dev: str,
    port: int,
    *,
    rate: str = "400 Gb/sec (4X NDR)",
    state: str = "4: ACTIVE",
    phys: str = "5: LinkUp",
    layer: str = "InfiniBand",
    gid_types: tuple[str, ...] = (),
    numa: str | None = "1",
) -> None:
    d = root / "class" / "infiniband" / dev / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "rate").write_text(rate + "\n")
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text(phys + "\n")
    (d / "link_layer").write_text(layer + "\n")
    types = d / "gid_attrs" / "types"
    types.mkdir(parents=True)
    for i, t in enumerate(gid_types):
        (types / str(i)).write_text(t + "\n")
    if numa is not None:
        fn = int(dev.rsplit("_", 1)[-1])
        pci = root / "devices" / "pci0000:00" / f"0000:{0x17 + fn:02x}:00.0"
        pci.mkdir(parents=True, exist_ok=True)
        (pci / "numa_node").write_text(numa + "\n")
        link = root / "class" / "infiniband" / dev / "device"
        if not link.exists():
            link.symlink_to(pci)


def test_parse_rate_and_roce_strings() -> None:
    assert parse_rate_gbits_per_s("400 Gb/sec (4X NDR)") == 400.0
    assert parse_rate_gbits_per_s("2.5 Gb/sec (1X SDR)") == 2.5
    assert parse_rate_gbits_per_s("garbage") == 0.0
    assert parse_roce_version("RoCE v2") == "v2"
    assert parse_roce_version("IB/RoCE v1") == "v1"
    assert parse_roce_version("") is None


def test_sysfs_reads_ib_and_roce_ports(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", 1)
    _port(tmp_path, "mlx5_1", 1, rate="200 Gb/sec (4X HDR)", numa="0")
    _port(
        tmp_path,
        "mlx5_2",
        1,
        rate="100 Gb/sec (4X EDR)",
        layer="Ethernet",
        gid_types=("IB/RoCE v1", "RoCE v2", "RoCE v2"),
        numa=None,
    )
    d = SysfsNicDiscovery(tmp_path, fabrics={"mlx5_0": "ib0", "mlx5_1/1": "ib1"}, node_name="n0")
    ports = d.ports()
    assert [(p.device, p.port) for p in ports] == [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_2", 1)]
    ib, hdr, roce = ports
    assert (ib.rate_per_direction_gbits_per_s, ib.link_layer, ib.fabric, ib.numa_node) == (
        400.0,
        "infiniband",
        "ib0",
        1,
    )
    assert ib.pci_address == "0000:17:00.0" and ib.roce_versions == ()
    assert (hdr.rate_per_direction_gbits_per_s, hdr.fabric, hdr.numa_node) == (200.0, "ib1", 0)
    assert (roce.link_layer, roce.roce_versions, roce.fabric) == (
        "ethernet",
        ("v1", "v2"),
        "default",
    )
    assert roce.numa_node == -1 and roce.pci_address == ""
    inv = d.discover()
    check_inventory(inv)
    assert inv.gpus == () and inv.discovered_by == ("sysfs",)
    assert all(n.active for n in inv.nics)


def test_sysfs_down_ports_are_not_planned(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", 1)
    _port(tmp_path, "mlx5_0", 2, state="1: DOWN", phys="3: Disabled")
    _port(tmp_path, "mlx5_1", 1, phys="2: Polling")  # logically active, no cable
    nics = SysfsNicDiscovery(tmp_path, default_fabric="ib0").nics()
    assert [n.active for n in nics] == [True, False, False]
    assert nics[2].state.startswith("DOWN") and "Polling" in nics[2].state
    base = NodeInventory("n0", ())
    node = SysfsNicDiscovery(tmp_path, default_fabric="ib0").augment(base).to_node()
    assert node.rdma_per_direction_gbits_per_s == 400.0  # only the healthy port


def test_sysfs_without_rdma_is_empty_and_augment_keeps_inventory(tmp_path: Path) -> None:
    d = SysfsNicDiscovery(tmp_path)
    assert d.ports() == ()
    base = NodeInventory("n0", (), discovered_by=("nvml",))
    assert d.augment(base) is base


def test_sysfs_tolerates_unreadable_files(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", 1, rate="weird")
    (tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "link_layer").unlink()
    (p,) = SysfsNicDiscovery(tmp_path).ports()
    assert p.rate_per_direction_gbits_per_s == 0.0 and p.link_layer == "infiniband"
    assert SysfsNicDiscovery(tmp_path).discover().to_node().nics == ()  # rate 0: not planned


def test_sysfs_augment_adds_nics_to_gpu_inventory(tmp_path: Path) -> None:
    _port(tmp_path, "mlx5_0", 1)
    _port(tmp_path, "mlx5_1", 1)
    gpu_inv = StaticDiscovery.from_file(MIXED_24, "a100-0").discover()
    inv = SysfsNicDiscovery(tmp_path, default_fabric="ib9").augment(gpu_inv)
    assert inv.discovered_by == ("static", "sysfs")
    assert [n.device for n in inv.nics] == ["mlx5_0", "mlx5_1"]
    assert inv.to_node().fabrics == ("ib9",)
