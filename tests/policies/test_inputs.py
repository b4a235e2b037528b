"""Catalog, fleet, model and workload parsing: values and every error path."""

from __future__ import annotations

import math
from typing import Any

import pytest
from builders import fleet_doc, tiny_model

from policies.errors import InputError
from policies.estimate.workload import load_from_json, make_workload, synthetic_zipf
from policies.hardware.catalog import lookup
from policies.hardware.fleet import parse_fleet
from policies.model.architecture import PRESETS, from_hf_config, preset


def test_catalog_aliases_and_unknown_model_names_closest() -> None:
    assert lookup("NVIDIA H200").model == "H200-SXM-141GB"
    assert lookup("a100-sxm4-80gb").memory_gib == 80
    with pytest.raises(InputError) as err:
        lookup("H210-SXM")
    msg = str(err.value)
    assert "H200-SXM-141GB" in msg and "base:" in msg


def test_ampere_has_no_fp8_but_hopper_does() -> None:
    assert not lookup("A100-SXM4-80GB").has_fp8
    assert lookup("H100-SXM5-80GB").has_fp8


def test_fleet_overrides_and_custom_gpu() -> None:
    doc = fleet_doc([("n0", "H100-SXM5-80GB", 2, 900)])
    doc["spec"]["nodes"][0]["gpus"][0]["hbm_bandwidth_gbytes_per_s"] = 3000
    doc["spec"]["nodes"].append(
        {
            "name": "n1",
            "gpus": [{"model": "MyGPU", "base": "L40S", "bf16_tflops": 400}],
            "nics": [{"count": 1, "per_direction_gbits_per_s": 200, "fabric": "ib0"}],
        }
    )
    f = parse_fleet(doc)
    assert f.gpus[0].spec.hbm_bandwidth_gbytes_per_s == 3000
    assert f.gpus[2].spec.model == "MyGPU" and f.gpus[2].spec.bf16_tflops == 400
    assert f.gpus[2].spec.architecture == "ada"


def _bad(mutate: Any) -> str:
    doc = fleet_doc([("n0", "H100-SXM5-80GB", 2, 900), ("n1", "A100-SXM4-80GB", 2, 600)])
    mutate(doc)
    with pytest.raises(InputError) as err:
        parse_fleet(doc)
    return str(err.value)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (
            lambda d: d["spec"]["nodes"][0]["nvlink"].update(per_gpu_bidir_gbytes_per_s=math.nan),
            "spec.nodes[0].nvlink.per_gpu_bidir_gbytes_per_s",
        ),
        (
            lambda d: d["spec"]["nodes"][1]["nics"][0].update(per_direction_gbits_per_s=-1),
            "spec.nodes[1].nics[0].per_direction_gbits_per_s",
        ),
        (lambda d: d["spec"]["nodes"][1].update(name="n0"), "duplicate node name"),
        (
            lambda d: d["spec"]["nodes"][0]["gpus"][0].update(uuids=["u1", "u1"]),
            "duplicate GPU uuid",
        ),
        (lambda d: d["spec"]["nodes"][0]["gpus"][0].update(count=0), "count"),
        (lambda d: d["spec"]["nodes"][0]["gpus"][0].update(memory_gib="lots"), "must be a number"),
        (lambda d: d["spec"]["nodes"][0]["gpus"][0].update(warp_drive=1), "unknown GPU field"),
        (lambda d: d.update(apiVersion="v2"), "apiVersion"),
        (lambda d: d["spec"].update(nodes=[]), "at least one node"),
        (lambda d: d["spec"]["nodes"][0].update(name="Bad_Name"), "DNS-1123"),
        (
            lambda d: d["spec"].update(
                fabric_links=[{"between": ["ib0", "nope"], "per_direction_gbits_per_s": 100}]
            ),
            "fabric_links[0].between",
        ),
    ],
)
def test_fleet_errors_name_the_field(mutate: Any, needle: str) -> None:
    assert needle in _bad(mutate)


def test_presets_match_published_parameter_counts() -> None:
    ds = preset("deepseek-v3")
    assert ds.num_moe_layers == 58 and ds.num_experts == 256 and ds.top_k == 8
    assert 660e9 < ds.total_params < 680e9 and 35e9 < ds.active_params < 38e9
    assert 230e9 < preset("qwen3-235b-a22b").total_params < 240e9
    assert preset("gpt-oss-120b").expert_dtype == "mxfp4"
    assert not preset("llama-3.1-70b").is_moe
    assert set(PRESETS) >= {
        "deepseek-v3",
        "qwen3-235b-a22b",
        "qwen3-30b-a3b",
        "mixtral-8x7b",
        "gpt-oss-120b",
        "llama-3.1-70b",
    }


def test_model_errors() -> None:
    with pytest.raises(InputError, match="unknown model preset"):
        preset("gpt-5")
    with pytest.raises(InputError, match="unsupported model_type"):
        from_hf_config({"model_type": "bert"})
    with pytest.raises(InputError, match="lacks 'hidden_size'"):
        from_hf_config({"model_type": "llama", "num_hidden_layers": 2})


def test_synthetic_load_is_seeded_and_differs_per_layer() -> None:
    m = tiny_model(experts=16, moe_layers=3)
    a = synthetic_zipf(m, "synthetic:zipf:1.0:seed=3")
    assert a == synthetic_zipf(m, "synthetic:zipf:1.0:seed=3")
    assert a != synthetic_zipf(m, "synthetic:zipf:1.0:seed=4")
    assert a[0] != a[1]
    assert sorted(a[0]) == sorted(a[1])  # same profile, different experts
    with pytest.raises(InputError, match="synthetic:zipf:S:seed=N"):
        synthetic_zipf(m, "zipf:1")


def test_sglang_dump_sums_steps_and_drops_dense_layers() -> None:
    m = tiny_model(experts=4, moe_layers=2, dense_layers=1)
    dump = {
        "logical_count": [
            [[0, 0, 0, 0], [1, 2, 3, 4], [4, 3, 2, 1]],
            [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]],
        ]
    }
    rows = load_from_json(dump, m)
    w = make_workload(m, phase="decode", tokens_per_gpu=8, context_len=64, load=rows)
    assert w.expert_load == ((2.0, 2.0, 3.0, 4.0), (4.0, 3.0, 2.0, 2.0))


@pytest.mark.parametrize(
    ("load", "needle"),
    [
        ([[1, 2, 3, 4]], "has 1 layers"),
        ([[1, 2, 3], [1, 2, 3, 4]], "row 0 has 3 experts"),
        ([[1, 2, math.nan, 4], [1, 2, 3, 4]], "finite number"),
        ([[1, 2, -3, 4], [1, 2, 3, 4]], ">= 0"),
    ],
)
def test_load_shape_and_value_errors(load: list[list[float]], needle: str) -> None:
    m = tiny_model(experts=4, moe_layers=2)
    with pytest.raises(InputError, match=needle):
        make_workload(m, phase="decode", tokens_per_gpu=8, context_len=64, load=load)


def test_workload_errors() -> None:
    m = tiny_model()
    with pytest.raises(InputError, match="phase"):
        make_workload(m, phase="train", tokens_per_gpu=8, context_len=64)
    with pytest.raises(InputError, match="tokens"):
        make_workload(m, phase="decode", tokens_per_gpu=0, context_len=64)
