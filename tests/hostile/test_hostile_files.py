"""Hostile files are refused cleanly: an error naming the file, the field or line and the
limit, in bounded memory; valid files still read. How long each refusal takes is measured
by ``make bench-hostile`` (bench/hostile.py, quoted in docs/security.md), not asserted here:
a test's clock is only as steady as the machine it runs on.

The corpus (:mod:`support.hostile_files`): tests/fixtures/hostile/ plus large files generated
here (nesting 100,000 deep, 50 MB, 5,000 documents...). Each goes through the reader of its
kind in this process; a few go through the real command line, which must print one
``error:`` line and exit 2 (and, for ``controller run``, create no file).
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from support.hostile_files import HostileFile, command, corpus, read_in_process

from apis.documents import load_json, load_yaml
from policies.errors import InputError
from policies.limits import MAX_NESTING_DEPTH, json_depth, key_path

#: Most memory a refusal may allocate, MiB (Python allocations, tracemalloc).
REFUSAL_MIB = 64.0

EXPECTED = {  # what the message must say, per file
    "fleet-latin1.yaml": "not UTF-8 text: byte 72",
    "fleet-utf16.yaml": "byte 0",
    "fleet-alias-bomb.yaml": "alias *a refused",
    "fleet-alias.yaml": "at line 9",
    "fleet-count-1e9.yaml": "1,000,000,000 GPUs, over the limit of 65,536",
    "fleet-count-2e64.yaml": "beyond 64 bits",
    "fleet-format-key.yaml": "['%s%n']",
    "fleet-gpu-total.yaml": "81,920 GPUs",
    "fleet-two-docs.yaml": "more than 1 YAML document",
    "fleet-nan.yaml": "memory_gib: must be a finite non-negative number, got nan",
    "fleet-deep.json": f"over the limit of {MAX_NESTING_DEPTH}",
    "fleet-deep-block.yaml": f"over the limit of {MAX_NESTING_DEPTH}",
    "fleet-50mb.yaml": "over the 2 MiB limit for a fleet",
    "fleet-5000-docs.yaml": "more than 1 YAML document",
    "model-layers-1e8.json": "num_hidden_layers: must be an integer from 0 to 1,024",
    "model-layer-experts.json": "(layer, expert) pairs, over the limit",
    "model-deep.json": "nests lists and mappings",
    "load-40mb.json": "over the 32 MiB limit for a load",
    "deploy-50mb.yaml": "over the 2 MiB limit for a deployment",
    "deploy-5000-docs.yaml": "more than 100 YAML documents",
    "deploy-tokens-2e31.yaml": "tokensPerGpu: must be an integer from 1 to 1,048,576",
    "tokens-empty": "holds no token",
    "tokens-binary": "not UTF-8 text: byte 0",
    "tokens-2mb": "over the 1 MiB limit for a token file",
    "fleet-unknown-key.yaml": "spec.nodes[0].nic: unknown field 'nic'; did you mean 'nics'?",
    "fleet-unreachable.yaml": "nodes 'n0' and 'n1' cannot reach each other",
    "fleet-ambiguous-gpu.yaml": "'H100' is ambiguous: it may be H100-SXM5-80GB or H100-PCIe",
    "deploy-unknown-key.yaml": "spec.workload.tokensPerGpux: unknown field 'tokensPerGpux'; "
    "did you mean 'tokensPerGpu'?",
    "deploy-min-gpus-2e31.yaml": "spec.minGpus: must be an integer from 0 to 2,147,483,647",
    "plan-experts-3e8.json": "num_experts: must be an integer from 0 to 4,096, got 300,000,000",
    "plan-experts-1e30.json": "num_experts: must be an integer from 0 to 4,096, got 1.000e+30",
    "plan-layers-1e9.json": "num_layers: must be an integer from 1 to 1,024",
    "plan-fewer-layers.json": "gpus[1].experts: lists 31 MoE layers, must be 32",
    "plan-more-moe-layers.json": "moe_layers: must be a list of at most num_layers (32)",
    "plan-expert-index.json": "expert must be an integer from 0 to 3",
    "plan-step-string.json": "summary.step_time_us: must be a number, got 'fast'",
    "plan-share-string.json": "gpus[1].experts[0][0] share: must be a number, got 'all'",
    "plan-slot-triple.json": "must be an [expert, share] pair, got [0, 1.0, 2]",
    "plan-hints-string.json": "gpus[0].hints.deepep_num_sms: must be an integer, got 'x'",
    "plan-memory-nan.json": "NaN is not a number JSON allows",
    "plan-gpus-none.json": "gpus: must be a list of 1 to 65,536 GPU entries, got 0",
    "plan-version-float.json": "version: must be an integer, got 1.5",
    "plan-engine-number.json": "engine.name: must be a string, got 7",
    "plan-gpu-unknown-key.json": "gpus[1].rank: unknown GPU field 'rank'",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[HostileFile]:
    return corpus(Path(tmp_path_factory.mktemp("hostile")))


def test_every_hostile_file_is_refused_and_every_control_read(
    files: list[HostileFile],
) -> None:
    problems = []
    for f in files:
        try:
            result = read_in_process(f)
        except Exception as exc:  # a crash: the test's finding
            problems.append(f"{f.name}: {type(exc).__name__}: {exc}")
            continue
        if f.accepted:
            if result != "accepted":
                problems.append(f"{f.name}: valid file refused: {result}")
            continue
        needle = EXPECTED.get(f.name.removeprefix("agent-"), "")
        if not result.startswith("refused: "):
            problems.append(f"{f.name}: accepted")
        elif needle not in result:
            problems.append(f"{f.name}: {result!r} lacks {needle!r}")
    assert not problems, "\n".join(problems)


def test_refusals_take_bounded_memory(files: list[HostileFile]) -> None:
    peaks = {}
    for f in files:
        if f.accepted:
            continue
        tracemalloc.start()
        try:
            read_in_process(f)
            peaks[f.name] = tracemalloc.get_traced_memory()[1] / 2**20
        finally:
            tracemalloc.stop()
    worst = max(peaks, key=peaks.__getitem__)
    assert peaks[worst] < REFUSAL_MIB, f"{worst} took {peaks[worst]:.1f} MiB"


@pytest.mark.parametrize(
    "name",
    [
        "fleet-latin1.yaml",
        "agent-fleet-count-1e9.yaml",
        "deploy-alias.yaml",
        "tokens-empty",
        "fleet-unknown-key.yaml",
        "deploy-unknown-key.yaml",
        "plan-experts-3e8.json",
        "plan-step-string.json",
        "plan-fewer-layers.json",
        "export:plan-experts-1e30.json",
        "export:plan-expert-index.json",
    ],
)
def test_the_command_line_prints_one_error_line_and_exits_2(
    files: list[HostileFile], name: str, tmp_path: Path
) -> None:
    verb, _, name = name.rpartition(":")
    f = next(x for x in files if x.name == name)
    argv = command(f, tmp_path)
    if verb == "export":  # plan export reads the plan the same way, then loops over its experts
        argv = [*argv[: argv.index("show")], "export", "--format", "sglang", str(f.path)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    assert not (tmp_path / "state.db").exists()  # a refused controller start creates no file


# --------------------------------------------------------------------------- the loaders


def test_json_depth_is_read_without_parsing() -> None:
    assert json_depth('{"a": [1, {"b": "[[[["}], "c": "\\"]]"}') == 3
    assert json_depth("[" * 100_000 + "]" * 100_000) == MAX_NESTING_DEPTH + 1
    assert json_depth("3") == 0
    with pytest.raises(InputError, match="nests lists and mappings"):
        load_json("[" * 65 + "]" * 65, "doc")
    assert load_json("[" * 64 + "]" * 64, "doc") == eval("[" * 64 + "]" * 64)


def test_yaml_loader_reads_what_safe_load_reads() -> None:
    """Every YAML document of the repository's examples loads as yaml.safe_load has it."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    paths = [*root.glob("examples/**/*.yaml"), *root.glob("tests/fixtures/*.yaml")]
    assert len(paths) > 10
    for p in paths:
        text = p.read_text()
        expected = [d for d in yaml.safe_load_all(text) if d is not None]
        assert load_yaml(text, str(p), max_documents=100) == expected, p


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a: &x 1\nb: *x\n", "alias *x refused"),
        ("<<: {a: 1}\n", "merge key"),
        ("a: !!python/name:os.system x\n", "tag"),
        ("!!set {a}\n", "tag"),
        ("? [1]\n: 2\n", "a list or mapping as a key"),
        ("a: 99999999999999999999\n", "beyond 64 bits"),
        ("a: 1\n---\nb: 2\n", "more than 1 YAML document"),
        ("a: " + "[" * 70 + "]" * 70 + "\n", "over the limit of 64"),
    ],
)
def test_yaml_loader_refusals(text: str, needle: str) -> None:
    with pytest.raises(InputError) as err:
        load_yaml(text, "doc")
    assert needle in str(err.value)


def test_field_paths_quote_odd_keys() -> None:
    assert key_path("gpus[0].measured", "sm_efficiency") == "gpus[0].measured.sm_efficiency"
    assert key_path("gpus[0].measured", "%s%n") == "gpus[0].measured['%s%n']"
    assert key_path("labels", "a.b") == "labels['a.b']"


def test_stdin_is_bounded_too(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("x: 1\n" * 500_000)  # 2.5 MB
    argv = [sys.executable, "-m", "controlplane.cli", "--controller", "127.0.0.1:9"]
    run = subprocess.run(
        [*argv, "deploy", "apply", "-f", "-"],
        stdin=big.open("rb"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "over the 2 MiB limit" in run.stderr, run.stderr
