"""AMD SMI discovery replayed from a recording MODELLED on AMD's published MI300X figures.

No AMD host was available: tests/fixtures/amdsmi/mi300x8-modelled.json follows the
MI300X datasheet (see its ``_comment``), not a real node. The tests check the mapping
from AMD SMI's answers to the inventory the planner uses, errors included.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support.amdsmi_replay import ReplayAmdSmi

from agents.discovery.amdsmi import (
    K_LINK,
    K_VRAM,
    K_XGMI,
    AmdSmiDiscovery,
    inventory_from_recording,
)
from agents.discovery.base import DiscoveryError
from policies.hardware.fleet import Fleet
from policies.hardware.inventory import XGMI_MI300_GENERATION
from policies.hardware.topology import Channel, build_topology

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "amdsmi" / "mi300x8-modelled.json"


def _recording() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(FIXTURE.read_text())
    return doc


def _discover(recording: dict[str, Any], **kw: Any) -> tuple[AmdSmiDiscovery, Any]:
    backend = AmdSmiDiscovery(node_name="mi300x-0", amdsmi=ReplayAmdSmi(recording, **kw))
    return backend, backend.discover()


def test_mi300x_node_inventory() -> None:
    backend, inv = _discover(_recording())
    assert inv.node == "mi300x-0" and inv.discovered_by == ("amdsmi",)
    assert len(inv.gpus) == 8
    for g in inv.gpus:
        assert g.name == "AMD Instinct MI300X" and g.catalog_model == "MI300X"
        assert (g.architecture, g.compute_capability, g.sms) == ("cdna3", "gfx942", 304)
        assert g.memory_bytes == 192 * 2**30
        assert g.hbm_bandwidth_gbytes_per_s == 5300.0
        assert g.sm_clock_mhz == 2100 and g.power_limit_w == 750.0
        assert (g.pcie_generation, g.pcie_width) == (5, 16)
        assert len(g.nvlinks) == 7  # fully connected hive of 8
        assert all(x.active and x.generation == XGMI_MI300_GENERATION for x in g.nvlinks)
        assert g.nvlink_bidir_gbytes_per_s == 896.0  # 7 links x 64 GB/s x 2 directions
        assert g.nvlink_domain == "mi300x-0"
        assert g.health.healthy and g.health.retired_pages == 0
        assert g.pci_bus_id == g.pci_bus_id.upper() and g.pci_bus_id.endswith(":00.0")
    peers = {x.remote_bus_id for x in inv.gpus[0].nvlinks}
    assert peers == {g.pci_bus_id for g in inv.gpus[1:]}
    assert backend.notes == []
    # a recording of the replay is the fixture again (round trip)
    again = inventory_from_recording(backend.recording, node="mi300x-0")
    assert again == inv


def test_inventory_plans_like_a_fleet_file_node() -> None:
    _, inv = _discover(_recording())
    node = inv.to_node()
    assert node.nvlink is not None and node.nvlink.per_gpu_bidir_gbytes_per_s == 896.0
    assert {g.spec.vendor for g in node.gpus} == {"amd"}
    assert node.gpus[0].spec.memory_gib == 192.0
    topo = build_topology(Fleet("f", (node,)))
    assert topo.channel[0][7] == Channel.NVLINK


def test_older_library_without_bandwidth_falls_back_to_the_catalog() -> None:
    rec = _recording()
    for g in rec["gpus"]:
        del g[K_VRAM]["vram_max_bandwidth"]
    backend, inv = _discover(rec)
    assert inv.gpus[0].hbm_bandwidth_gbytes_per_s == 5300.0  # catalog figure
    assert any("bandwidth from catalog" in n for n in backend.notes)


def test_unsupported_calls_leave_figures_to_the_catalog() -> None:
    rec = _recording()
    for g in rec["gpus"]:
        g[K_XGMI] = {"error": "AMDSMI_STATUS_NOT_SUPPORTED"}
        del g["amdsmi_get_gpu_asic_info"]["num_compute_units"]
    rec["gpus"][3]["amdsmi_get_gpu_total_ecc_count"] = {"uncorrectable_count": 2}
    backend, inv = _discover(rec)
    assert inv.gpus[0].sms == 304 and any(
        "compute-unit count from catalog" in n for n in backend.notes
    )
    # no hive id: the direct xGMI links still make one domain
    assert {g.nvlink_domain for g in inv.gpus} == {"mi300x-0"}
    assert not inv.gpus[3].health.healthy
    assert backend.recording["gpus"][0][K_XGMI] == {"error": "AMDSMI_STATUS_NOT_SUPPORTED"}


def test_two_hives_and_a_pcie_pair() -> None:
    rec = _recording()
    for g in rec["gpus"][4:]:
        g[K_XGMI]["xgmi_hive_id"] = 12345
    for p in rec["pairs"]:
        if (p["i"] < 4) != (p["j"] < 4):
            p[K_LINK] = {"type": "PCIE", "hops": 2}
    _, inv = _discover(rec)
    assert [g.nvlink_domain for g in inv.gpus] == ["mi300x-0-xgmi0"] * 4 + ["mi300x-0-xgmi1"] * 4
    assert all(len(g.nvlinks) == 3 for g in inv.gpus)
    assert inv.to_node().nvlink is None  # two domains in one node: no single NVLink domain


def test_driver_not_loaded_says_how_to_fix_it() -> None:
    with pytest.raises(DiscoveryError) as err:
        _discover(_recording(), init_error="AMDSMI_STATUS_DRIVER_NOT_LOADED")
    text = str(err.value)
    assert "AMDSMI_STATUS_DRIVER_NOT_LOADED" in text and "To fix" in text and "/dev/kfd" in text


def test_missing_binding_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi raises ImportError
    with pytest.raises(DiscoveryError, match="To fix: install the amdsmi package"):
        AmdSmiDiscovery(node_name="n").discover()


def test_replay_counts_calls_and_shuts_down() -> None:
    fake = ReplayAmdSmi(copy.deepcopy(_recording()))
    AmdSmiDiscovery(node_name="n", amdsmi=fake).discover()
    assert fake.calls[K_LINK] == 28  # every pair once
    assert not fake.initialised
