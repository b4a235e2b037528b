"""NVML discovery replayed from recordings of a real 2x H200 host, and on a real GPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from support.nvml_replay import ReplayNvml

from agents.discovery.base import DiscoveryError
from agents.discovery.nvml import NvmlDiscovery
from agents.discovery.nvml_recording import (
    K_BUS_WIDTH,
    K_CORES,
    K_FABRIC,
    K_LINK_REMOTE,
    K_NUMA,
    K_REMAPPED,
    normalize_bus_id,
)
from policies.hardware.inventory import inventory_from_dict, inventory_to_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvml"


def _recording(name: str = "h200x2.json") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return doc


def _discover(recording: dict[str, Any], **kw: Any) -> Any:
    backend = NvmlDiscovery(node_name="h200-node", nvml=ReplayNvml(recording, **kw))
    return backend, backend.discover()


def test_h200x2_inventory_matches_the_hardware() -> None:
    backend, inv = _discover(_recording())
    assert inv.node == "h200-node"
    assert inv.discovered_by == ("nvml",)
    assert len(inv.gpus) == 2
    for g in inv.gpus:
        assert g.name == "NVIDIA H200"
        assert g.catalog_model == "H200-SXM-141GB"
        assert g.architecture == "hopper"
        assert g.compute_capability == "9.0"
        assert g.sms == 132  # 16896 cores / 128 per SM
        assert g.memory_bytes == 150_754_820_096  # "141 GB", 140.4 GiB
        assert g.hbm_bandwidth_gbytes_per_s == pytest.approx(
            6016 / 8 * 3201 * 2 / 1000
        )  # 4.81 TB/s
        assert g.hbm_bandwidth_gbytes_per_s == pytest.approx(4814.3, abs=0.1)
        assert g.sm_clock_mhz == 1980
        assert g.power_limit_w == 700.0
        assert (g.pcie_generation, g.pcie_width) == (5, 16)
        assert len(g.nvlinks) == 18
        assert all(x.active and x.generation == 4 and x.to_switch for x in g.nvlinks)
        assert g.nvlink_bidir_gbytes_per_s == 900.0  # 18 links x 25 GB/s x 2 directions
        assert g.nvlink_domain == "h200-node"
    assert [g.pci_bus_id for g in inv.gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert inv.gpus[0].uuid != inv.gpus[1].uuid
    assert backend.notes == []
    node = inv.to_node()
    assert node.nvlink is not None
    assert (node.nvlink.domain, node.nvlink.per_gpu_bidir_gbytes_per_s) == ("h200-node", 900.0)
    assert node.gpus[0].spec.sms == 132


def test_not_supported_calls_leave_figures_unknown() -> None:
    rec = _recording()
    assert rec["gpus"][0][K_NUMA] == {"error": "NVMLError_NotSupported"}  # as recorded
    nvml = ReplayNvml(rec)
    backend = NvmlDiscovery(node_name="n", nvml=nvml)
    inv = backend.discover()
    # ECC, retired pages, remapped rows and fabric info are not in the recording: the
    # replay raises NotSupported for them, as such a driver would.
    h = inv.gpus[0].health
    assert (h.ecc_uncorrected_volatile, h.retired_pages, h.remapped_rows_pending) == (
        None,
        None,
        None,
    )
    assert h.healthy
    assert (
        nvml.calls[
            "nvmlDeviceGetTotalEccErrors(" + "NVML_MEMORY_ERROR_TYPE_UNCORRECTED,NVML_VOLATILE_ECC)"
        ]
        == 2
    )
    assert backend.recording["gpus"][0][K_REMAPPED] == {"error": "NVMLError_NotSupported"}


def test_missing_figures_fall_back_to_the_catalog_with_a_note() -> None:
    rec = _recording()
    for g in rec["gpus"]:
        g[K_BUS_WIDTH] = {"error": "NVMLError_NotSupported"}
        g[K_CORES] = {"error": "NVMLError_FunctionNotFound"}  # an older driver
    backend, inv = _discover(rec)
    assert inv.gpus[0].hbm_bandwidth_gbytes_per_s == 4800.0  # catalog
    assert inv.gpus[0].sms == 132  # catalog
    assert any("HBM bandwidth from catalog" in n for n in backend.notes)
    assert any("SM count from catalog" in n for n in backend.notes)


def test_function_missing_from_the_binding_is_function_not_found() -> None:
    class OldBinding(ReplayNvml):
        def __getattribute__(self, name: str) -> Any:
            if name == "nvmlDeviceGetGpuFabricInfoV":
                raise AttributeError(name)
            return super().__getattribute__(name)

    backend = NvmlDiscovery(node_name="n", nvml=OldBinding(_recording()))
    backend.discover()
    assert backend.recording["gpus"][0][K_FABRIC] == {"error": "NVMLError_FunctionNotFound"}


def test_library_not_found_is_a_discovery_error_with_a_fix() -> None:
    backend = NvmlDiscovery(nvml=ReplayNvml(_recording(), init_error="NVMLError_LibraryNotFound"))
    with pytest.raises(DiscoveryError, match="To fix: install the NVIDIA driver") as err:
        backend.discover()
    assert "NVMLError_LibraryNotFound" in str(err.value)
    assert err.value.__cause__ is not None


def test_no_permission_is_a_discovery_error() -> None:
    backend = NvmlDiscovery(nvml=ReplayNvml(_recording(), init_error="NVMLError_NoPermission"))
    with pytest.raises(DiscoveryError, match="NoPermission"):
        backend.discover()


def test_fabric_clique_makes_a_multi_node_domain() -> None:
    rec = _recording()
    for g in rec["gpus"]:
        g[K_FABRIC] = {
            "clusterUuid": "6a1c33f2-0000-4000-8000-00000000abcd",
            "cliqueId": 7,
            "state": 3,
            "status": 0,
        }
    _, inv = _discover(rec)
    assert {g.nvlink_domain for g in inv.gpus} == {"6a1c33f2-0000-4000-8000-00000000abcd/7"}
    rec["gpus"][1][K_FABRIC] = {"error": "NVMLError_NotSupported"}
    _, inv = _discover(rec)
    assert inv.gpus[1].nvlink_domain == "h200-node"  # falls back to the node's NVSwitch domain


def test_direct_nvlink_peers_share_a_domain_and_pcie_gpus_have_none() -> None:
    rec = _recording()
    third = copy.deepcopy(rec["gpus"][1])
    third["index"] = 2
    third["nvmlDeviceGetPciInfo.busId"] = "00000000:00:08.0"
    third["nvmlDeviceGetUUID"] = "GPU-third"
    third["nvlinks"] = []  # a PCIe-only GPU
    rec["gpus"].append(third)
    bus = ["00000000:00:07.0", "00000000:00:06.0"]
    for i in (0, 1):
        for link in rec["gpus"][i]["nvlinks"]:
            link[K_LINK_REMOTE] = bus[i]  # point-to-point links to the other GPU
    _, inv = _discover(rec)
    assert [g.nvlink_domain for g in inv.gpus] == ["h200-node", "h200-node", None]
    assert not any(x.to_switch for x in inv.gpus[0].nvlinks)
    assert inv.to_node().nvlink is None  # not every GPU of the node is in the domain


def test_remapped_rows_pending_makes_a_gpu_unhealthy() -> None:
    rec = _recording()
    rec["gpus"][1][K_REMAPPED] = [0, 1, 1, 0]
    _, inv = _discover(rec)
    assert inv.gpus[0].health.healthy
    assert not inv.gpus[1].health.healthy
    assert [g.index for g in inv.healthy_gpus()] == [0]


def test_recording_round_trips_and_inventory_serialises() -> None:
    backend, inv = _discover(_recording())
    _, again = _discover(backend.recording)
    assert again == inv
    assert inventory_from_dict(json.loads(json.dumps(inventory_to_dict(inv)))) == inv


def test_bus_ids_are_normalised() -> None:
    assert normalize_bus_id("0000:07:00.0") == "00000000:07:00.0"
    assert normalize_bus_id(b"00000000:00:06.0") == "00000000:00:06.0"
    assert normalize_bus_id("ffffffff:ff:ff.0") == "FFFFFFFF:FF:FF.0"


def test_real_h200x2_discovery_record_replays_to_what_it_reported() -> None:
    """tests/fixtures/nvml/h200x2-discovered.json: what discovery reported on the real
    2x H200 host (inventory) and every NVML answer it got (recording)."""
    doc = _recording("h200x2-discovered.json")
    _, inv = _discover(doc["recording"])
    # recorded before inventories carried an address (discovery leaves it empty)
    assert inventory_to_dict(inv) == {**doc["inventory"], "address": ""}
    assert len(inv.gpus) == 2
    assert all(g.sms == 132 and g.nvlink_domain == "h200-node" for g in inv.gpus)
    assert all(sum(x.active and x.generation == 4 for x in g.nvlinks) == 18 for g in inv.gpus)


def _has_nvidia_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = int(pynvml.nvmlDeviceGetCount())
        pynvml.nvmlShutdown()
        return n > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_nvidia_gpu(), reason="no NVIDIA GPU or driver on this machine")
def test_real_nvml_discovery() -> None:
    inv = NvmlDiscovery(node_name="gpu-node").discover()
    assert inv.gpus
    for g in inv.gpus:
        assert g.uuid.startswith("GPU-") or g.uuid.startswith("MIG-")
        assert g.memory_bytes > 0
        assert g.sms > 0
        assert g.hbm_bandwidth_gbytes_per_s > 0
