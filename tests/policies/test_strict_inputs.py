"""Strict inputs: unknown keys refused at every level of every document (with the full path
and the closest known key), fleets whose nodes cannot reach each other refused naming the
pair, and GPU names that fit several products refused naming the candidates."""

from __future__ import annotations

import copy
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from builders import fleet_doc, tiny_model

from apis.kube import v1alpha1
from apis.kube.schema import from_wire
from controlplane.cli import main
from controlplane.cli.files import read_fleet
from policies.advice.cost import price_table_from_dict
from policies.errors import InputError
from policies.estimate.costmodel import measured_from_dict
from policies.estimate.workload import make_workload
from policies.hardware.catalog import (
    CATALOG,
    DATASHEETS,
    AmbiguousGpuNameError,
    GpuSpec,
    ambiguous_names,
    figure_sources,
    lookup,
)
from policies.hardware.fleet import (
    FabricLink,
    Fleet,
    Node,
    check_reachable,
    parse_fleet,
    parse_node,
    unreachable_pair,
)
from policies.hardware.inventory import inventory_from_dict, inventory_from_node, inventory_to_dict
from policies.keys import check_keys, closest_key
from policies.request import PlacementRequest, check_request
from policies.spec.build import parse_deployment

REPO = Path(__file__).resolve().parents[2]


def _refused(parse: Any, doc: Any) -> InputError:
    with pytest.raises(InputError) as err:
        parse(doc)
    return err.value


# ------------------------------------------------------------------------ the one check


def test_the_closest_key_is_the_likely_meaning_or_none() -> None:
    known = ("a2aBackend", "dispatch", "dpBalance", "tokensPerGpu", "load", "loadMatrix")
    assert closest_key("a2a", known) == "a2aBackend"  # a prefix of one key
    assert closest_key("tokensPerGpux", known) == "tokensPerGpu"  # a key plus a character
    assert closest_key("tokens_per_gpu", known) == "tokensPerGpu"  # snake case
    assert closest_key("DISPATCH", known) == "dispatch"
    assert closest_key("loadMatrx", known) == "loadMatrix"
    assert closest_key("zz", known) is None and closest_key("colour", known) is None


def test_check_keys_names_the_full_path_and_lists_the_known_keys() -> None:
    check_keys({"b": 1, "a": 2}, ("a", "b"), "spec")
    with pytest.raises(InputError) as err:
        check_keys({"a": 1, "a.b": 2}, ("a", "b"), "spec.nodes[2]")
    assert err.value.field == "spec.nodes[2]['a.b']"
    assert "unknown field 'a.b'" in str(err.value) and "(known here: a, b)" in str(err.value)


# ------------------------------------------------------------------------ Fleet files


def _fleet() -> dict[str, Any]:
    doc = fleet_doc([("n0", "H100-SXM5-80GB", 2, 900), ("n1", "A100-SXM4-80GB", 2, 600)])
    doc["spec"]["fabric_links"] = []
    return doc


@pytest.mark.parametrize(
    ("mutate", "field", "near"),
    [
        (lambda d: d.update(specc={}), "specc", "spec"),
        (lambda d: d["metadata"].update(nmae="x"), "metadata.nmae", "name"),
        (lambda d: d["spec"].update(fabric_link=[]), "spec.fabric_link", "fabric_links"),
        (lambda d: d["spec"]["nodes"][1].update(nic=[]), "spec.nodes[1].nic", "nics"),
        (lambda d: d["spec"]["nodes"][0].update(label={}), "spec.nodes[0].label", "labels"),
        (
            lambda d: d["spec"]["nodes"][0]["gpus"][0].update(memory_gb=80),
            "spec.nodes[0].gpus[0].memory_gb",
            "memory_gib",
        ),
        (
            lambda d: d["spec"]["nodes"][0]["nvlink"].update(domian="x"),
            "spec.nodes[0].nvlink.domian",
            "domain",
        ),
        (
            lambda d: d["spec"]["nodes"][1]["nics"][0].update(fabirc="ib0"),
            "spec.nodes[1].nics[0].fabirc",
            "fabric",
        ),
        (
            lambda d: d["spec"]["fabric_links"].append(
                {"between": ["ib0", "ib0"], "per_direction_gbits_per_s": 1, "latency": 5}
            ),
            "spec.fabric_links[0].latency",
            "latency_us",
        ),
    ],
)
def test_every_level_of_a_fleet_refuses_unknown_keys(mutate: Any, field: str, near: str) -> None:
    doc = _fleet()
    mutate(doc)
    err = _refused(parse_fleet, doc)
    assert err.field == field
    assert f"did you mean {near!r}?" in str(err) and "To fix:" in str(err)


def test_deprecated_fleet_keys_still_parse_with_their_warning() -> None:
    doc = _fleet()
    doc["spec"]["nodes"][0]["nvlink"] = {"domain": "n0", "per_gpu_gbps": 900}
    doc["spec"]["nodes"][0]["nics"][0] = {"count": 1, "gbps": 400, "fabric": "ib0"}
    doc["spec"]["nodes"][0]["gpus"][0]["hbm_bandwidth_gbps"] = 3000
    fleet = parse_fleet(doc)
    assert fleet.nodes[0].nvlink is not None
    assert fleet.nodes[0].nvlink.per_gpu_bidir_gbytes_per_s == 900
    assert fleet.gpus[0].spec.hbm_bandwidth_gbytes_per_s == 3000
    assert len(fleet.warnings) == 3
    assert any("spec.nodes[0].nics[0].gbps: deprecated key" in w for w in fleet.warnings)
    doc["spec"]["nodes"][0]["nics"][0]["fabrc"] = "ib0"  # a typo beside an old key
    assert _refused(parse_fleet, doc).field == "spec.nodes[0].nics[0].fabrc"


# ------------------------------------------------------------------------ reachability


def _node(name: str, fabric: str | None, domain: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": name, "gpus": [{"model": "H100-SXM5-80GB", "count": 1}]}
    if fabric is not None:
        doc["nics"] = [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": fabric}]
    if domain is not None:
        doc["nvlink"] = {"domain": domain, "per_gpu_bidir_gbytes_per_s": 900}
    return doc


def _doc(nodes: list[dict[str, Any]], links: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    return {
        "spec": {
            "nodes": nodes,
            "fabric_links": [{"between": list(x), "per_direction_gbits_per_s": 800} for x in links],
        }
    }


def test_a_node_without_nics_is_refused_naming_the_pair_and_the_fix() -> None:
    err = _refused(parse_fleet, _doc([_node("a", "ib0", "a"), _node("b", None, None)]))
    msg = str(err)
    assert err.field == "spec.nodes"
    assert "nodes 'a' and 'b' cannot reach each other" in msg
    assert "b: no NICs and no NVLink" in msg and "a: fabric ib0" in msg
    assert "To fix:" in msg and "fabric_links" in msg


def test_two_fabrics_need_a_fabric_link() -> None:
    nodes = [_node("a", "ib-a", None), _node("b", "ib-b", None)]
    assert "'a' and 'b' cannot reach" in str(_refused(parse_fleet, _doc(nodes)))
    assert len(parse_fleet(_doc(nodes, (("ib-a", "ib-b"),))).nodes) == 2


def test_one_nvlink_domain_across_nodes_needs_no_nic() -> None:
    fleet = parse_fleet(_doc([_node("a", None, "nvl72"), _node("b", None, "nvl72")]))
    assert unreachable_pair(fleet) is None
    assert len(parse_fleet(_doc([_node("solo", None, None)])).gpus) == 1


def _reachable(a: Node, b: Node, links: tuple[FabricLink, ...]) -> bool:
    """The pairwise rule of policies.hardware.topology's channels, one pair at a time."""
    if a.nvlink and b.nvlink and a.nvlink.domain == b.nvlink.domain:
        return True
    group = {f: {f} for n in (a, b) for f in n.fabrics}
    changed = True
    while changed:  # fabrics joined by chains of links
        changed = False
        for x in links:
            joined = group.get(x.a, {x.a}) | group.get(x.b, {x.b})
            for f in joined:
                if group.get(f) != joined:
                    group[f], changed = joined, True
    return any(group.get(f, {f}) & set(b.fabrics) for f in a.fabrics)


def test_the_grouped_check_agrees_with_the_pairwise_rule_on_random_fleets() -> None:
    rng = random.Random(7)
    for _ in range(300):
        nodes = tuple(
            parse_node(
                _node(
                    f"n{i}",
                    rng.choice([None, "f0", "f1", "f2"]),
                    rng.choice([None, "d0", "d1", f"own{i}"]),
                )
            )
            for i in range(rng.randint(1, 6))
        )
        links = tuple(
            FabricLink(a, b, 800.0)
            for a, b in itertools.combinations(["f0", "f1", "f2"], 2)
            if rng.random() < 0.3
        )
        fleet = Fleet("r", nodes, links)
        bad = [(a, b) for a, b in itertools.combinations(nodes, 2) if not _reachable(a, b, links)]
        pair = unreachable_pair(fleet)
        assert (pair is None) == (not bad), (nodes, links, pair, bad)
        if pair is not None:
            assert not _reachable(*pair, links) and pair[0] is not pair[1]


def test_every_solve_checks_reachability() -> None:
    """Fleets built from reported nodes (controller, operator) meet the same check."""
    fleet = Fleet(
        "reported", (parse_node(_node("a", "ib0", "a")), parse_node(_node("b", "x", "b")))
    )
    model = tiny_model()
    workload = make_workload(model, phase="decode", tokens_per_gpu=8, context_len=128)
    req = PlacementRequest(fleet=fleet, model=model, workload=workload, form="native")
    with pytest.raises(InputError, match="'a' and 'b' cannot reach each other"):
        check_request(req)
    with pytest.raises(InputError, match="cannot reach"):
        check_reachable(fleet)


def test_every_example_and_fixture_fleet_loads() -> None:
    paths = [*REPO.glob("examples/fleets/*.yaml"), *REPO.glob("tests/fixtures/*.yaml")]
    assert len(paths) >= 8
    for p in paths:
        assert read_fleet(p).gpus, p


# --------------------------------------------------------------- deployments and the rest


def _deployment(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "mx"}, "spec": {"model": "mixtral-8x7b", **spec}}


@pytest.mark.parametrize(
    ("doc", "field", "near"),
    [
        (
            _deployment(workload={"tokensPerGpux": 99}),
            "spec.workload.tokensPerGpux",
            "tokensPerGpu",
        ),
        (_deployment(rebalance={"sustainSec": 20}), "spec.rebalance.sustainSec", "sustainS"),
        (_deployment(redundant_experts=8), "spec.redundant_experts", "redundantExperts"),
        (_deployment(engine={"name": "sglang", "option": {}}), "spec.engine.option", "options"),
        ({**_deployment(), "metdata": {}}, "metdata", "metadata"),
        ({**_deployment(), "metadata": {"nam": "mx"}}, "metadata.nam", "name"),
    ],
)
def test_every_level_of_a_deployment_refuses_unknown_keys(
    doc: dict[str, Any], field: str, near: str
) -> None:
    err = _refused(parse_deployment, doc)
    assert err.field == field
    assert f"did you mean {near!r}?" in str(err)


def test_inventory_measured_and_price_documents_refuse_unknown_keys() -> None:
    node = parse_fleet(fleet_doc([("n0", "H100-SXM5-80GB", 1, 900)])).nodes[0]
    inv = inventory_to_dict(inventory_from_node(node))
    inv["gpus"][0]["health"]["xid_error"] = []
    err = _refused(inventory_from_dict, inv)
    assert err.field == "inventory.gpus[0].health.xid_error"
    assert "did you mean 'xid_errors'?" in str(err)
    err = _refused(measured_from_dict, {"hbm_gbyte_per_s": 3000})
    assert err.field == "hbm_gbyte_per_s" and "did you mean 'hbm_gbytes_per_s'?" in str(err)
    doc = {"currency": "EUR", "prices": {"L4": 0.1}, "curency": "USD"}
    err = _refused(price_table_from_dict, doc)
    assert err.field == "curency" and "did you mean 'currency'?" in str(err)


def test_custom_resources_are_read_strictly() -> None:
    spec = {"model": "mixtral-8x7b", "workload": {"tokensPerGpux": 99}}
    lenient = from_wire(v1alpha1.ModelDeploymentSpec, spec, "spec")
    assert lenient.workload.tokens_per_gpu == v1alpha1.WorkloadSpec().tokens_per_gpu
    with pytest.raises(InputError) as err:
        from_wire(v1alpha1.ModelDeploymentSpec, spec, "spec", strict=True)
    assert err.value.field == "spec.workload.tokensPerGpux"
    assert "did you mean 'tokensPerGpu'?" in str(err.value)
    from operators.operator import Operator

    view = Operator._node_view({"metadata": {"name": "n0"}, "spec": {"cordoned": True}})
    assert view.spec.cordon and "spec.cordoned" in view.error and "'cordon'" in view.error


def test_every_example_custom_resource_reads_strictly() -> None:
    kinds = {
        "ModelDeployment": v1alpha1.ModelDeploymentSpec,
        "PlacementPolicy": v1alpha1.PlacementPolicySpec,
        "GPUNode": v1alpha1.GPUNodeSpec,
    }
    seen = 0
    for p in REPO.glob("examples/k8s/*.yaml"):
        for obj in yaml.safe_load_all(p.read_text()):
            if isinstance(obj, dict) and obj.get("kind") in kinds:
                from_wire(kinds[obj["kind"]], obj.get("spec") or {}, "spec", strict=True)
                seen += 1
    assert seen >= 5


# ------------------------------------------------------------------------ GPU names


@pytest.mark.parametrize("name", sorted(ambiguous_names()))
def test_ambiguous_gpu_names_are_refused_with_the_candidates(name: str) -> None:
    with pytest.raises(AmbiguousGpuNameError) as err:
        lookup(name.lower(), field_path="spec.nodes[0].gpus[0].model")
    assert err.value.candidates == ambiguous_names()[name]
    assert all(c in str(err.value) for c in err.value.candidates)
    assert err.value.field == "spec.nodes[0].gpus[0].model"


def test_a_prefix_of_several_entries_is_ambiguous_and_exact_names_resolve() -> None:
    with pytest.raises(AmbiguousGpuNameError, match="A100-SXM4-40GB or A100-SXM4-80GB"):
        lookup("A100-SXM4")
    for name in CATALOG:
        assert lookup(name.lower()).model == name
    assert lookup("NVIDIA H100 PCIe").model == "H100-PCIe"
    assert lookup("NVIDIA H200").model == "H200-SXM-141GB"
    assert lookup("H100-SXM").model == "H100-SXM5-80GB"
    err = _refused(lookup, "L40")  # one entry starts so: unknown, not ambiguous
    assert not isinstance(err, AmbiguousGpuNameError) and "L40S" in str(err)


def test_an_ambiguous_price_name_is_refused_not_kept_as_a_custom_gpu() -> None:
    with pytest.raises(AmbiguousGpuNameError):
        price_table_from_dict({"H100": 2.0})
    assert price_table_from_dict({"MyGPU": 2.0}).price("MyGPU") == 2.0


def test_every_figure_has_a_source() -> None:
    assert set(DATASHEETS) == set(CATALOG)
    for name in CATALOG:
        assert set(figure_sources(name)) == GpuSpec.figure_names()


# ------------------------------------------------------------------------ the CLI


def test_gpu_list_shows_every_entry_with_its_figures_and_source(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["gpu", "list"]) == 0
    table = capsys.readouterr().out
    for spec in CATALOG.values():
        row = next(line for line in table.splitlines() if line.startswith(spec.model + " "))
        assert f" {spec.hbm_bandwidth_gbytes_per_s:g} " in row and DATASHEETS[spec.model] in row
    assert "H100 (H100-SXM5-80GB, H100-PCIe)" in table
    assert main(["gpu", "list", "-o", "json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["model"] for d in docs] == list(CATALOG)
    h200 = next(d for d in docs if d["model"] == "H200-SXM-141GB")
    assert h200["memory_gib"] == 140 and "measured" in h200["sources"]["memory_gib"]
    assert "NVIDIA H200" in h200["aliases"]
    assert main(["gpu", "list", "-o", "yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == docs


def test_gpu_show_resolves_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu", "show", "NVIDIA H100 PCIe", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "H100-PCIe" and doc["hbm_bandwidth_gbytes_per_s"] == 2000
    assert main(["gpu", "show", "H100-PCIe"]) == 0
    assert "hbm_bandwidth_gbytes_per_s" in capsys.readouterr().out


def _write(tmp_path: Path, name: str, doc: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_each_refusal_is_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = _fleet()
    typo["spec"]["nodes"][1]["nic"] = typo["spec"]["nodes"][1].pop("nics")
    islands = _doc([_node("a", "ib-a", "a"), _node("b", "ib-b", "b")])
    short = copy.deepcopy(_fleet())
    short["spec"]["nodes"][0]["gpus"][0]["model"] = "H100"
    solve = ["plan", "solve", "--model", "mixtral-8x7b", "--policy", "greedy", "-q", "--fleet"]
    cases = {
        "spec.nodes[1].nic: unknown field 'nic'; did you mean 'nics'?": [
            *solve,
            _write(tmp_path, "typo.yaml", typo),
        ],
        "nodes 'a' and 'b' cannot reach each other": [
            *solve,
            _write(tmp_path, "islands.yaml", islands),
        ],
        "'H100' is ambiguous": ["fleet", "show", _write(tmp_path, "short.yaml", short)],
        "NAME: GPU model 'A100' is ambiguous": ["gpu", "show", "A100"],
    }
    for needle, argv in cases.items():
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], err
        assert "Traceback" not in err


def test_a_plan_file_refuses_an_unknown_top_level_key() -> None:
    from policies.plan import PLAN_SCHEMA_VERSION, plan_from_dict

    with pytest.raises(InputError) as err:
        plan_from_dict({"schema_version": PLAN_SCHEMA_VERSION, "gpuz": []})
    assert err.value.field == "gpuz" and "did you mean 'gpus'?" in str(err.value)
