"""Hostile files for the readers of user documents, and how to put each through them.

The corpus is the small files kept in tests/fixtures/hostile/ (named ``KIND-what``: non-UTF-8
text, an alias bomb, GPU counts of 1e9, 2e18 and 2^64, integers of 5,000 digits, NaN,
numbers beyond any wire type, a Python tag, model configs with 1e8 layers...) plus the large
ones :func:`corpus` writes at run time rather than keeping megabytes in the repository
(nesting 100,000 deep, 50 MB files, 5,000 documents, a fleet of 96,000 GPUs), and plans made
hostile one field at a time from a valid one (3e8 or 1e30 experts, layers that disagree, a
string where a number belongs, at every nesting level).

Each file goes through the reader of its kind, in this process (:func:`read_in_process`) or
through the real command line (:func:`command`). Used by tests/hostile and bench/hostile.py.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hostile"
REPO = Path(__file__).resolve().parents[2]
FLEET_HEAD = "apiVersion: mixfleet.io/v1alpha1\nkind: Fleet\nspec:\n  nodes:\n"
DEPLOYMENT = (
    "apiVersion: mixfleet.io/v1alpha1\nkind: ModelDeployment\nmetadata: {{name: d{i}}}\n"
    "spec: {{model: mixtral-8x7b, policy: greedy}}\n"
)
KINDS = ("fleet", "agent-fleet", "model", "load", "plan", "deploy", "tokens")


@dataclass(frozen=True)
class HostileFile:
    """One file of the corpus.

    Attributes:
        name: file name (``fleet-alias-bomb.yaml``).
        kind: the reader it is for (one of :data:`KINDS`).
        path: where it is.
        accepted: the file is valid (a control: the reader must accept it).
    """

    name: str
    kind: str
    path: Path
    accepted: bool = False


def _kind(name: str) -> str:
    return name.split("-", 1)[0]


def _node(i: int, count: int = 8) -> str:
    return (
        f"  - name: n{i}\n    gpus: [{{model: H100-SXM5-80GB, count: {count}}}]\n"
        "    nics: [{count: 1, per_direction_gbits_per_s: 400, fabric: ib0}]\n"
    )


def _generated(out: Path) -> list[HostileFile]:
    """The large files, written into ``out``."""
    files: dict[str, str | bytes] = {
        "fleet-deep.json": "[" * 100_000 + "]" * 100_000,
        "fleet-deep-flow.yaml": "spec: " + "[" * 100_000 + "]" * 100_000,
        "fleet-deep-block.yaml": "".join(" " * i + "a:\n" for i in range(2_000)),
        "fleet-50mb.yaml": FLEET_HEAD + "".join(_node(i) for i in range(700_000)),
        "fleet-96k-gpus.yaml": FLEET_HEAD + "".join(_node(i) for i in range(12_000)),
        "fleet-5000-docs.yaml": "---\n".join(FLEET_HEAD + _node(0) for _ in range(5_000)),
        "model-deep.json": '{"a": ' * 50_000 + "1" + "}" * 50_000,
        "load-40mb.json": "[" + ",".join(["[" + ",".join(["1.0"] * 8) + "]"] * 1_000_000) + "]",
        "deploy-50mb.yaml": "".join(DEPLOYMENT.format(i=i) for i in range(500_000)),
        "deploy-5000-docs.yaml": "---\n".join(DEPLOYMENT.format(i=i) for i in range(5_000)),
        "tokens-2mb": "x" * (2 << 20),
    }
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name, text in files.items():
        path = out / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        made.append(HostileFile(name, _kind(name), path))
    return made


#: A valid plan (Mixtral 8x7B on one node of four H100, greedy, engine form), the base of the
#: hostile plans below and a control itself.
PLAN = FIXTURES.parent / "plan-mixtral-4gpu.json"


def _hostile_plans(out: Path) -> list[HostileFile]:
    """Plans that are valid JSON of the right shape with one field made hostile: counts
    beyond the limits (a table of 3e8 experts, a loop over 1e30), inconsistent counts,
    wrong types at every nesting level."""
    import json

    def edit(change: Callable[[dict[str, Any]], Any]) -> str:
        doc = json.loads(PLAN.read_text())
        change(doc)
        return json.dumps(doc)

    def gpu(key: str, value: Any) -> Callable[[dict[str, Any]], Any]:
        return lambda d: d["gpus"][1].__setitem__(key, value)

    files = {
        "plan-experts-3e8.json": edit(lambda d: d.update(num_experts=300_000_000)),
        "plan-experts-1e30.json": edit(lambda d: d.update(num_experts=10**30)),
        "plan-layers-1e9.json": edit(lambda d: d.update(num_layers=10**9)),
        "plan-fewer-layers.json": edit(lambda d: d["gpus"][1]["experts"].pop()),
        "plan-more-moe-layers.json": edit(lambda d: d.update(moe_layers=[*range(32), 31])),
        "plan-expert-index.json": edit(lambda d: d.update(num_experts=4)),
        "plan-step-string.json": edit(lambda d: d["summary"].update(step_time_us="fast")),
        "plan-share-string.json": edit(gpu("experts", [[[0, "all"]]] * 32)),
        "plan-slot-triple.json": edit(gpu("experts", [[[0, 1.0, 2]]] * 32)),
        "plan-hints-string.json": edit(lambda d: d["gpus"][0]["hints"].update(deepep_num_sms="x")),
        "plan-memory-nan.json": edit(gpu("memory_bytes", {"total": float("nan")})),
        "plan-gpus-none.json": edit(lambda d: d.update(gpus=[])),
        "plan-version-float.json": edit(lambda d: d.update(version=1.5)),
        "plan-engine-number.json": edit(lambda d: d["engine"].update(name=7)),
        "plan-gpu-unknown-key.json": edit(gpu("rank", 3)),
    }
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name, text in files.items():
        (out / name).write_text(text)
        made.append(HostileFile(name, "plan", out / name))
    return made


def _controls(out: Path) -> list[HostileFile]:
    """Valid files of each kind: the limits must let them through."""
    out.mkdir(parents=True, exist_ok=True)
    fleet = REPO / "examples" / "fleets" / "mixed-24.yaml"
    deploy = REPO / "examples" / "deployments" / "mixtral-small.yaml"
    tokens = out / "tokens-valid"
    tokens.write_text("admin-token-0123456789abcdef admin cli\n")
    big = out / "fleet-2000-nodes.yaml"
    big.write_text(FLEET_HEAD + "".join(_node(i) for i in range(2_000)))
    return [
        HostileFile("fleet-mixed-24.yaml", "fleet", fleet, accepted=True),
        HostileFile("agent-fleet-mixed-24.yaml", "agent-fleet", fleet, accepted=True),
        HostileFile("fleet-2000-nodes.yaml", "fleet", big, accepted=True),
        HostileFile("deploy-mixtral-small.yaml", "deploy", deploy, accepted=True),
        HostileFile("tokens-valid", "tokens", tokens, accepted=True),
        HostileFile("plan-mixtral-4gpu.json", "plan", PLAN, accepted=True),
    ]


def corpus(out: Path, *, large: bool = True) -> list[HostileFile]:
    """Every hostile file (the kept ones, copied into ``out``, then the generated ones), and
    the valid controls. ``large=False`` leaves out the generated files."""
    out.mkdir(parents=True, exist_ok=True)
    kept = []
    for p in sorted(FIXTURES.iterdir()):
        dest = out / p.name
        shutil.copyfile(p, dest)
        kept.append(HostileFile(p.name, _kind(p.name), dest))
        if p.name.startswith("fleet-"):  # the agent's static discovery reads fleets too
            kept.append(HostileFile(f"agent-{p.name}", "agent-fleet", dest))
    return [
        *kept,
        *_hostile_plans(out / "plans"),
        *(_generated(out / "generated") if large else []),
        *_controls(out / "ok"),
    ]


# --------------------------------------------------------------------------- readers


def _readers() -> dict[str, Callable[[Path], Any]]:
    from agents.discovery.static import load_fleet_file
    from controlplane.cli.deploy import _read_docs
    from controlplane.cli.files import read_expert_load, read_fleet, read_model_config, read_plan
    from controlplane.server.auth import load_tokens
    from policies.model.architecture import preset
    from policies.spec.build import parse_deployment

    mixtral = preset("mixtral-8x7b")
    return {
        "fleet": read_fleet,
        "agent-fleet": load_fleet_file,
        "model": read_model_config,
        "load": lambda p: read_expert_load(p, mixtral),
        "plan": read_plan,
        "deploy": lambda p: [parse_deployment(d) for d in _read_docs(str(p))],
        "tokens": load_tokens,
    }


def read_in_process(f: HostileFile) -> str:
    """Put ``f`` through its reader here; returns ``"accepted"``, or ``"refused: <message>"``
    for the project's own error. Any other exception propagates (a crash)."""
    from agents.discovery.base import DiscoveryError
    from policies.errors import InputError

    try:
        _readers()[f.kind](f.path)
    except (InputError, DiscoveryError) as exc:
        return f"refused: {exc}"
    return "accepted"


def command(f: HostileFile, scratch: Path) -> list[str]:
    """The command line that reads ``f`` as a user would (``scratch``: for a store file)."""
    ctl = [sys.executable, "-m", "controlplane.cli"]
    mixed = str(REPO / "examples" / "fleets" / "mixed-24.yaml")
    solve = [*ctl, "plan", "solve", "--fleet", mixed, "--policy", "greedy", "-q"]
    return {
        "fleet": [*ctl, "fleet", "show", str(f.path)],
        "agent-fleet": [
            sys.executable,
            "-m",
            "agents.cli",
            "simulate",
            "--controller",
            "127.0.0.1:9",
            "--insecure",
            "--fleet",
            str(f.path),
        ],
        "model": [*solve, "--model-config", str(f.path)],
        "load": [*solve, "--model", "mixtral-8x7b", "--load", str(f.path)],
        "plan": [*ctl, "plan", "show", str(f.path)],
        "deploy": [*ctl, "--controller", "127.0.0.1:9", "deploy", "apply", "-f", str(f.path)],
        "tokens": [
            *ctl,
            "controller",
            "run",
            "--insecure",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            str(f.path),
            "--store",
            f"sqlite:{scratch / 'state.db'}",
            "--store-new",
        ],
    }[f.kind]
