"""The GPU catalog and the cost model's defaults against measured reference timings
(policies.estimate.reference, data from aiconfigurator-core 0.12.0): the ratios between generations
stay where the data puts them, every figure the model gets wrong by more than the tolerance
is named in the catalog with the reason (and no note outlives its reason), and peer traffic
over PCIe is priced at the measured NCCL rate, not the link's peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies.estimate.costmodel import Efficiency
from policies.estimate.reference import (
    BASELINE,
    comparison,
    model_defaults,
    pcie_collective_gbytes_per_s,
    reference_document,
    reference_figures,
    reference_models,
    reference_source,
)
from policies.hardware.catalog import REFERENCE_NOTES, lookup

ROOT = Path(__file__).resolve().parents[2]

#: Measured ratios to the H200 (reference data), pinned: a new data file that moves any of
#: them by more than 2% must come with a reviewed update here and in the catalog notes.
PINNED_RATIOS = {
    ("A100-SXM4-80GB", "attn_decode_gbytes_per_s"): 0.264,
    ("A100-SXM4-80GB", "gemm_bf16_tflops"): 0.507,
    ("A100-SXM4-80GB", "allgather_bus_gbytes_per_s"): 0.592,
    ("B200", "attn_decode_gbytes_per_s"): 1.478,
    ("B200", "gemm_bf16_tflops"): 3.102,
    ("B200", "weight_read_gbytes_per_s"): 1.350,
    ("H100-SXM5-80GB", "attn_decode_gbytes_per_s"): 0.747,
    ("H100-SXM5-80GB", "weight_read_gbytes_per_s"): 0.611,
    ("L40S", "attn_decode_gbytes_per_s"): 0.192,
    ("L40S", "weight_read_gbytes_per_s"): 0.176,
    ("L40S", "allgather_bus_gbytes_per_s"): 0.00362,
}


def test_reference_data_names_its_source_and_versions() -> None:
    doc = reference_document()
    assert "aiconfigurator-core 0.12.0" in doc["source"]
    assert set(reference_models()) == {
        "A100-SXM4-80GB",
        "H100-SXM5-80GB",
        "H200-SXM-141GB",
        "B200",
        "L40S",
    }
    for model in reference_models():
        lookup(model)  # every entry is a catalog model
        g = doc["gpus"][model]
        assert g["sglang"] and g["nccl"] and g["attention_kernel"]
        assert "SGLang" in reference_source(model) and "NCCL" in reference_source(model)
        figs = reference_figures(model)
        assert {
            "gemm_bf16_tflops",
            "attn_decode_gbytes_per_s",
            "allgather_bus_gbytes_per_s",
        } <= set(figs)
        assert all(v > 0 for v in figs.values())


@pytest.mark.parametrize(("key", "ratio"), sorted(PINNED_RATIOS.items()))
def test_measured_ratios_between_generations_do_not_drift(
    key: tuple[str, str], ratio: float
) -> None:
    model, figure = key
    got = reference_figures(model)[figure] / reference_figures(BASELINE)[figure]
    assert got == pytest.approx(ratio, rel=0.02)


def test_every_miss_is_named_in_the_catalog_and_every_note_is_a_miss() -> None:
    misses = {
        (c.model, c.figure) for m in reference_models() for c in comparison(m) if not c.within
    }
    assert misses, "the defaults are not within tolerance everywhere: some note must exist"
    assert misses == set(REFERENCE_NOTES), (
        f"unexplained: {sorted(misses - set(REFERENCE_NOTES))}; "
        f"stale notes: {sorted(set(REFERENCE_NOTES) - misses)}"
    )


def test_nvlink_collectives_are_within_tolerance_of_the_measured_curves() -> None:
    for model in ("H100-SXM5-80GB", "H200-SXM-141GB"):
        for c in comparison(model):
            if c.figure.endswith("_bus_gbytes_per_s"):
                assert abs(c.absolute_error) <= 0.15, (model, c.figure, c.absolute_error)


def test_pcie_collectives_use_the_measured_rate_not_the_link_peak() -> None:
    l40s = pcie_collective_gbytes_per_s("L40S")
    assert l40s is not None
    peak_based = lookup("L40S").pcie_per_direction_gbytes_per_s * Efficiency().pcie
    # about 20x slower than the link peak said: NCCL over PCIe without peer-to-peer
    assert 10 < peak_based / l40s < 30
    assert model_defaults("L40S")["allgather_bus_gbytes_per_s"] == l40s
    assert pcie_collective_gbytes_per_s("H200-SXM-141GB") is None  # NVLink GPU
    assert pcie_collective_gbytes_per_s("L4") is None  # no reference data


def test_l40s_node_prices_peer_traffic_at_the_measured_rate() -> None:
    from policies.estimate.costmodel import build_cost_table
    from policies.estimate.workload import make_workload
    from policies.hardware.fleet import Fleet, Gpu, GpuId, Node
    from policies.hardware.topology import Channel
    from policies.model.architecture import preset

    spec = lookup("L40S")
    gpus = tuple(Gpu(GpuId(f"n/{i}"), "n", i, spec) for i in range(8))
    fleet = Fleet("l40s", (Node("n", gpus, None, ()),))
    model = preset("qwen3-235b-a22b")
    wl = make_workload(model, phase="decode", tokens_per_gpu=32, context_len=4096)
    table = build_cost_table(fleet, model, wl)
    got = table.gpus[0].comm_bw_bytes_per_us[Channel.PCIE]
    assert got == pytest.approx(pcie_collective_gbytes_per_s("L40S") * 1e3)  # type: ignore[operator]


def test_h200_catalog_default_matches_the_h200_measured_here() -> None:
    sweep = json.loads((ROOT / "bench" / "results" / "gpu-h200-sweep.json").read_text())
    measured = sweep["ceilings"]["bf16_tflops"]
    assert model_defaults(BASELINE)["gemm_bf16_tflops"] == pytest.approx(measured, rel=0.05)
