"""An engine instance's role and ports on the agent side: the wire message's fields become
the assignment's (whatever its part says), the written plan.json keeps them, bad values are
refused with the field named, and both hook phases see them."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from agent_builders import small_fleet, small_plan
from mixfleet.v1 import agent_pb2

from agents.agent.connection import AgentSettings
from agents.agent.session import Agent
from agents.applier import (
    ApplierSettings,
    MemoryApplier,
    NodeAssignment,
    PlanApplier,
    assignment_from_dict,
    assignment_from_plan,
    check_assignment,
    parse_env,
)
from policies.errors import InputError
from policies.hardware.inventory import inventory_from_node

PREFILL = {
    "role": "prefill",
    "instance_of": "q",
    "engine_port": 30007,
    "bootstrap_port": 8998,
}


def _assignment(**instance: object) -> NodeAssignment:
    a = assignment_from_plan("mixtral", small_plan(version=1), "n0")
    return replace(a, **instance)  # type: ignore[arg-type]


def test_plan_json_keeps_the_instance_and_a_plain_part_has_none() -> None:
    a = _assignment(**PREFILL)
    doc = a.to_dict()
    assert doc["instance"] == {
        "role": "prefill",
        "of": "q",
        "engine_port": 30007,
        "bootstrap_port": 8998,
    }
    assert assignment_from_dict(json.loads(json.dumps(doc)), a.expert_location_json) == a
    plain = _assignment()
    assert "instance" not in plain.to_dict()
    again = assignment_from_dict(plain.to_dict(), plain.expert_location_json)
    assert (again.role, again.instance_of, again.engine_port, again.bootstrap_port) == (
        "",
        "",
        0,
        0,
    )


@pytest.mark.parametrize(
    ("instance", "problem"),
    [
        ({"role": "router", "instance_of": "q"}, "role: must be one of"),
        ({"instance_of": "q", "engine_port": 30000}, "role: empty"),
        ({"role": "decode"}, "instance_of: empty"),
        ({"role": "decode", "instance_of": "q", "engine_port": 70000}, "engine_port: must be"),
        ({"role": "decode", "instance_of": "q", "engine_port": -1}, "engine_port: must be"),
        ({"role": "decode", "instance_of": "q", "bootstrap_port": 8998}, "bootstrap_port: set"),
    ],
)
def test_bad_instance_fields_are_refused_naming_the_field(
    instance: dict[str, object], problem: str
) -> None:
    a = _assignment(**instance)
    problems = check_assignment(a, "n0")
    assert any(p.startswith(problem) for p in problems), problems
    result = MemoryApplier("n0").stage(a)
    assert not result.ok and problem in result.reason
    assert check_assignment(_assignment(**PREFILL), "n0") == []


def test_a_non_integer_port_in_plan_json_is_an_input_error() -> None:
    doc = _assignment(**PREFILL).to_dict()
    doc["instance"]["engine_port"] = "30007"
    with pytest.raises(InputError, match="engine_port"):
        assignment_from_dict(doc)
    doc["instance"] = ["prefill"]
    with pytest.raises(InputError, match=r"part\.instance"):
        assignment_from_dict(doc)


def test_the_message_fields_win_over_the_part() -> None:
    """The controller's part_json carries no instance; one that does is overridden by the
    message's own fields (one source)."""
    a = _assignment()
    doc = a.to_dict()
    doc["instance"] = {"role": "decode", "of": "other", "engine_port": 1, "bootstrap_port": 0}
    msg = agent_pb2.Assignment(
        deployment=a.deployment,
        plan_id=a.plan_id,
        version=a.version,
        phase=agent_pb2.ASSIGNMENT_PHASE_PREPARE,
        part_json=json.dumps(doc).encode(),
        **PREFILL,  # type: ignore[arg-type]
    )
    agent = Agent(
        AgentSettings(controller="127.0.0.1:1", insecure=True),
        lambda: inventory_from_node(small_fleet().nodes[0]),
        MemoryApplier("n0"),
    )  # never run: only the message's reading is exercised
    got = agent._part(msg)
    assert (got.role, got.instance_of, got.engine_port, got.bootstrap_port) == (
        "prefill",
        "q",
        30007,
        8998,
    )


def test_both_hook_phases_see_the_instance(tmp_path: Path) -> None:
    out = tmp_path / "hook"
    out.mkdir()
    script = tmp_path / "hook.py"
    script.write_text(
        "import os\n"
        f"out = {str(out)!r}\n"
        "env = {k: v for k, v in os.environ.items() if k.startswith('MIXFLEET_')}\n"
        "open(os.path.join(out, env['MIXFLEET_HOOK_PHASE'] + '.env'), 'w').write(\n"
        "    ''.join(f'{k}={v}\\n' for k, v in env.items()))\n"
    )
    ap = PlanApplier(
        ApplierSettings(
            plan_dir=tmp_path / "plans",
            node="n0",
            hook=(sys.executable, str(script)),
        )
    )
    assert ap.stage(_assignment(**PREFILL)).ok
    assert ap.commit("mixtral", 1).ok
    for phase in ("prepare", "commit"):
        env = parse_env((out / f"{phase}.env").read_text())
        assert env["MIXFLEET_ROLE"] == "prefill"
        assert env["MIXFLEET_INSTANCE_OF"] == "q"
        assert env["MIXFLEET_ENGINE_PORT"] == "30007"
        assert env["MIXFLEET_BOOTSTRAP_PORT"] == "8998"
    gpu_env = parse_env((tmp_path / "plans" / "mixtral" / "gpu0.env").read_text())
    assert gpu_env["MIXFLEET_ENGINE_PORT"] == "30007"
