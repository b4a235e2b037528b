"""The CRDs: generated from operators/v1alpha1.py, structural, valid CustomResourceDefinitions
for Kubernetes 1.29-1.35, and the example custom resources valid against them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.cel import CelError, compile_rule, evaluate
from support.structural import admit, check_structural

from apis.kube.schema import from_wire, to_wire
from apis.kube.v1alpha1 import (
    CRDS,
    GPUNODE,
    MODEL_DEPLOYMENT,
    PARTITION_PLAN,
    PLACEMENT_POLICY,
    CrdDef,
    GPUNodeSpec,
    ModelDeploymentSpec,
    PlacementPolicySpec,
)
from operators import crdgen

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ("1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35")
BY_KIND = {c.kind: c for c in CRDS}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_generated_manifests_are_up_to_date() -> None:
    assert crdgen.stale_files(crdgen.CRD_DIR) == [], "run `python -m operators.crdgen`"
    assert crdgen.main(["--check"]) == 0


def test_check_mode_names_stale_and_stray_files(tmp_path: Path) -> None:
    crdgen.write(tmp_path)
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "gpunodes.mixfleet.io.yaml").write_text("edited by hand\n")
    (tmp_path / "old.yaml").write_text("{}\n")
    assert crdgen.stale_files(tmp_path) == ["gpunodes.mixfleet.io.yaml", "old.yaml"]
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("crd", CRDS, ids=lambda c: c.kind)
def test_schemas_are_structural(crd: CrdDef) -> None:
    assert check_structural(crd.schema()) == []


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("crd", CRDS, ids=lambda c: c.kind)
def test_manifests_are_valid_customresourcedefinitions(crd: CrdDef, version: str) -> None:
    assert version in {v.rsplit(".", 1)[0] for v in kubernetes_validate.utils.all_versions()}
    (doc,) = _docs(crdgen.CRD_DIR / crdgen.filename(crd))
    assert kubernetes_validate.validate(doc, version, strict=True) == version


#: Printer columns that read the controller's free-form status document.
FREE_FORM_COLUMNS = (
    ".status.controller.demand.measured.requestsPerS",
    ".status.controller.demand.measured.sloAttainment",
)


def _schema_at(schema: dict[str, Any], json_path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    segment = re.compile(r'\.(\w+)(\[\?\(@\.\w+=="\w+"\)\])?')
    parts = list(segment.finditer(json_path))
    assert "".join(m.group(0) for m in parts) == json_path, f"unsupported path {json_path}"
    for m in parts:
        if node is None:
            return None
        if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
            return node  # a free-form document: any path into it reads
        node = (node.get("properties") or {}).get(m.group(1))
        if node is not None and m.group(2):
            node = node["items"]
    return node


@pytest.mark.parametrize("crd", CRDS, ids=lambda c: c.kind)
def test_printer_columns_point_at_schema_fields_of_their_type(crd: CrdDef) -> None:
    schema = crd.schema()
    for col in crd.manifest()["spec"]["versions"][0]["additionalPrinterColumns"]:
        if col["jsonPath"] == ".metadata.creationTimestamp":
            continue
        node = _schema_at(schema, col["jsonPath"])
        assert node is not None, col
        if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
            # Into a free-form document (the controller's status.controller): the schema
            # cannot say the type; the writer's test checks the path (test_operator_demand).
            assert col["jsonPath"] in FREE_FORM_COLUMNS, col
            continue
        want = {
            "date": "string",
            "boolean": "boolean",
            "integer": "integer",
            "number": "number",
        }.get(col["type"], "string")
        assert node["type"] == want, col


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for k, v in (node.get("properties") or {}).items():
        out += _walk(v, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_immutable_plan_spec_is_bounded_so_its_cel_rule_stays_cheap() -> None:
    spec = PARTITION_PLAN.schema()["properties"]["spec"]
    assert {
        "rule": "self == oldSelf",
        "message": spec["x-kubernetes-validations"][0]["message"],
    } in spec["x-kubernetes-validations"]
    for path, node in _walk(spec):
        if node.get("type") == "array":
            assert "maxItems" in node, path
        if node.get("type") == "string" and "enum" not in node and "pattern" not in node:
            assert "maxLength" in node, path


def test_status_lists_merge_per_entry_under_server_side_apply() -> None:
    md = MODEL_DEPLOYMENT.schema()["properties"]["status"]["properties"]["conditions"]
    assert (md["x-kubernetes-list-type"], md["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    pp = PARTITION_PLAN.schema()["properties"]["status"]["properties"]["nodes"]
    assert (pp["x-kubernetes-list-type"], pp["x-kubernetes-list-map-keys"]) == ("map", ["node"])


@pytest.mark.parametrize(
    ("crd", "cls"),
    [(PLACEMENT_POLICY, PlacementPolicySpec), (GPUNODE, GPUNodeSpec)],
    ids=["PlacementPolicy", "GPUNode"],
)
def test_schema_defaults_equal_dataclass_defaults(crd: CrdDef, cls: type) -> None:
    """The API server's defaults and the operator's are the same values (one source)."""
    obj, _, causes = admit({"spec": {}}, crd.schema())
    assert causes == []
    assert from_wire(cls, obj["spec"], "spec") == cls()


def test_deployment_spec_survives_the_wire_both_ways() -> None:
    doc = _docs(ROOT / "examples/k8s/modeldeployment-deepseek.yaml")[0]
    admitted, dropped, causes = admit(doc, MODEL_DEPLOYMENT.schema())
    assert (dropped, causes) == ([], [])
    spec = from_wire(ModelDeploymentSpec, admitted["spec"], "spec")
    assert from_wire(ModelDeploymentSpec, to_wire(spec), "spec") == spec
    assert dataclasses.asdict(spec)["workload"]["load"] == "synthetic:zipf:1.0:seed=7"


CUSTOM_EXAMPLES = sorted((ROOT / "examples/k8s").glob("*.yaml"))


@pytest.mark.parametrize("path", CUSTOM_EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    for doc in _docs(path):
        crd = BY_KIND.get(doc["kind"]) if doc["apiVersion"].startswith("mixfleet.io/") else None
        if crd is None:
            for v in K8S_VERSIONS:
                kubernetes_validate.validate(doc, v, strict=True)
            continue
        _, dropped, causes = admit(doc, crd.schema())
        assert dropped == [], f"unknown fields would be pruned: {dropped}"
        assert causes == []


@pytest.mark.parametrize(
    "path", sorted((ROOT / "examples/deployments").glob("*.yaml")), ids=lambda p: p.name
)
def test_controller_deployment_documents_are_valid_model_deployments(path: Path) -> None:
    """`mixfleetctl deploy apply -f X` and `kubectl apply -f X` take the same document."""
    (doc,) = _docs(path)
    doc["metadata"].setdefault("namespace", "default")
    _, dropped, causes = admit(doc, MODEL_DEPLOYMENT.schema())
    assert (dropped, causes) == ([], [])


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"workload": {"phase": "train"}}, "spec.workload.phase", "unsupported value"),
        (
            {"workload": {"tokensPerGpu": 0}},
            "spec.workload.tokensPerGpu",
            "greater than or equal to 1",
        ),
        ({"workload": {"load": "zipf"}}, "spec.workload.load", "does not match"),
        ({"modelConfig": {"model_type": "mixtral"}}, "spec", "exactly one of spec.model"),
        ({"form": "native"}, "spec", "engineFormat needs form: engine"),
        ({"solverTimeLimitS": 0}, "spec.solverTimeLimitS", "greater than 0"),
        ({"policyRef": {"name": "Bad_Name"}}, "spec.policyRef.name", "does not match"),
        ({"engineFormat": "tensorrt"}, "spec.engineFormat", "unsupported value"),
        ({"engine": {"name": "tgi"}}, "spec.engine.name", "unsupported value"),
        ({"engine": {"name": "vllm"}}, "spec", "engineFormat must be the engine's own file"),
        (
            {"engine": {"name": "sglang", "options": {"a2aBackend": "nccl"}}},
            "spec.engine",
            "sglang: deepep, mori, none",
        ),
        (
            {"engine": {"name": "sglang", "options": {"dpBalance": "even"}}},
            "spec.engine.options.dpBalance",
            "unsupported value",
        ),
        (
            {"engine": {"name": "trtllm", "options": {"dispatch": "static"}}},
            "spec.engine",
            "dispatch static or dynamic is SGLang's",
        ),
        ({"engine": {"name": "sglang", "version": "0.5 rc"}}, "spec.engine.version", "match"),
    ],
)
def test_bad_deployments_are_rejected_with_the_field(
    change: dict[str, Any], field: str, message: str
) -> None:
    doc = _docs(ROOT / "examples/k8s/modeldeployment-qwen3.yaml")[0]
    spec = doc["spec"]
    for k, v in change.items():
        spec[k] = {**spec[k], **v} if isinstance(v, dict) and isinstance(spec.get(k), dict) else v
    _, _, causes = admit(doc, MODEL_DEPLOYMENT.schema())
    assert any(c.field == field and message in c.message for c in causes), causes


def test_cel_subset_evaluates_the_rules_and_refuses_the_rest() -> None:
    assert evaluate("has(self.model) != has(self.modelConfig)", {"model": "x"})
    assert not evaluate("self == oldSelf", {"a": [1]}, {"a": [2]})
    assert evaluate(
        "self.x.all(v, v > 1) && size(self.x) == 2 && 'b' in self.y", {"x": [2, 3], "y": ["a", "b"]}
    )
    assert evaluate("self.s.startsWith('ab') ? self.n % 2 == 0 : false", {"s": "abc", "n": 4})
    with pytest.raises(CelError):
        compile_rule("self.quantity().isGreaterThan(1)")
    with pytest.raises(CelError):
        evaluate("self.missing == 1", {})
    for crd in CRDS:
        for _, node in _walk(crd.schema()):
            for rule in node.get("x-kubernetes-validations") or []:
                compile_rule(rule["rule"])
