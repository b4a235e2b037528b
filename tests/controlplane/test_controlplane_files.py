"""controlplane/files.py: every failure is an InputError naming the file and the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_builders import TINY_FLEET

from controlplane.cli.files import (
    dump_document,
    read_document,
    read_expert_load,
    read_fleet,
    read_model_config,
    read_plan,
)
from policies.errors import InputError
from policies.model.architecture import preset


def test_fleet_yaml_and_json_read_alike(tmp_path: Path) -> None:
    (tmp_path / "f.yaml").write_text(TINY_FLEET)
    import yaml

    (tmp_path / "f.json").write_text(json.dumps(yaml.safe_load(TINY_FLEET)))
    a, b = read_fleet(tmp_path / "f.yaml"), read_fleet(tmp_path / "f.json")
    assert a == b
    assert len(a.gpus) == 4


def test_examples_parse() -> None:
    root = Path(__file__).resolve().parents[2] / "examples" / "fleets"
    sizes = {p.stem: len(read_fleet(p).gpus) for p in root.glob("*.yaml")}
    assert sizes["mixed-24"] == 24


def test_json_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{\n  "a": 1,\n  "b": ,\n}\n')
    with pytest.raises(InputError, match=r"plan\.json.*line 3, column 8"):
        read_document(path, "plan")


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(InputError, match=r"f\.yaml.*not valid YAML.*line \d+, column \d+"):
        read_fleet(path)


def test_wrong_shape_names_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text("spec: {nodes: [{name: a, gpus: [{model: H100, count: -1}]}]}\n")
    with pytest.raises(
        InputError, match=r"fleet file .*f\.yaml.*spec\.nodes\[0\]\.gpus\[0\]\.count"
    ):
        read_fleet(path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(InputError, match="must be a mapping"):
        read_fleet(path)


def test_directory_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is a directory"):
        read_fleet(tmp_path)
    empty = tmp_path / "e.yaml"
    empty.write_text("\n")
    with pytest.raises(InputError, match="is empty"):
        read_fleet(empty)


def test_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InputError, match="not UTF-8"):
        read_plan(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(TINY_FLEET)
    path.chmod(0)
    with pytest.raises(InputError, match="permission denied"):
        read_fleet(path)


def test_permission_denied_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def deny(self: Path, *args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(
        InputError, match=r"cannot read fleet file .*f\.yaml.*permission denied.*chmod"
    ):
        read_fleet(tmp_path / "f.yaml")


def test_load_accepts_all_layers_and_sglang_dumps(tmp_path: Path) -> None:
    model = preset("deepseek-v3")  # 61 layers, the first 3 dense
    all_layers = [[float(e + layer) for e in range(256)] for layer in range(61)]
    path = tmp_path / "load.json"
    path.write_text(json.dumps(all_layers))
    rows = read_expert_load(path, model)
    assert len(rows) == 58 and rows[0][5] == 8.0  # MoE layer 0 is model layer 3
    path.write_text(json.dumps({"logical_count": [all_layers, all_layers]}))
    assert read_expert_load(path, model)[0][5] == 16.0  # summed over steps


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"counts": []}, "no 'logical_count'"),
        ([1, 2, 3], "2-D or 3-D list"),
        ([[1.0] * 128, 5], "list of numbers"),
        ([[-1.0] * 128] * 48, "finite number >= 0"),
    ],
)
def test_bad_load_documents(tmp_path: Path, doc: object, needle: str) -> None:
    path = tmp_path / "load.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=needle) as info:
        read_expert_load(path, preset("qwen3-30b-a3b"))
    assert "load.json" in str(info.value)


def test_model_config_named_after_its_directory(tmp_path: Path) -> None:
    d = tmp_path / "Tiny-Llama"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 256,
                "num_attention_heads": 4,
                "intermediate_size": 512,
                "vocab_size": 1000,
            }
        )
    )
    assert read_model_config(d / "config.json").name == "Tiny-Llama"
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(InputError, match=r"config\.json.*lacks 'num_hidden_layers'"):
        read_model_config(d / "config.json")


def test_dump_document_is_json_and_yaml_safe() -> None:
    doc = {"a": (1, 2), "b": float("nan"), "c": {"d": [1.5]}}
    assert json.loads(dump_document(doc, "json")) == {"a": [1, 2], "b": None, "c": {"d": [1.5]}}
    import yaml

    assert yaml.safe_load(dump_document(doc, "yaml")) == {"a": [1, 2], "b": None, "c": {"d": [1.5]}}
