"""Every integer of a deployment spec that travels in a 32-bit wire field is bounded where
the spec is parsed (policies.spec.build), so ``deploy apply`` refuses it with one ``error:`` line
naming the field instead of the wire encoder raising (``minGpus: 2147483648`` was a
ValueError traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mixfleet.v1 import plan_pb2

from apis.wire.deployment import spec_from_proto, spec_to_proto
from policies.errors import InputError
from policies.limits import MAX_WIRE_INT32
from policies.spec.build import parse_deployment

#: Document path -> how to set it in a spec document; every int32 field of
#: mixfleet.v1.DeploymentSpec and the messages inside it.
FIELDS: dict[str, Any] = {
    "spec.minGpus": lambda s, v: s.update(minGpus=v),
    "spec.maxGpus": lambda s, v: s.update(maxGpus=v),
    "spec.budget.gpus": lambda s, v: s.update(budget={"gpus": v}),
    "spec.priority": lambda s, v: s.update(priority=v),
    "spec.redundantExperts": lambda s, v: s.update(redundantExperts=v),
    "spec.workload.tokensPerGpu": lambda s, v: s.update(workload={"tokensPerGpu": v}),
    "spec.workload.contextLen": lambda s, v: s.update(workload={"contextLen": v}),
}


def _doc(field: str, value: int) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": "mixtral-8x7b", "policy": "greedy"}
    FIELDS[field](spec, value)
    return {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "mx"},
        "spec": spec,
    }


def test_the_table_covers_every_int32_field_of_the_message() -> None:
    def int32_fields(desc: Any) -> int:
        n = 0
        for f in desc.fields:
            if f.type == f.TYPE_INT32:
                n += 1
            elif f.type == f.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry:
                n += int32_fields(f.message_type)
        return n

    assert int32_fields(plan_pb2.DeploymentSpec.DESCRIPTOR) == len(FIELDS)


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_value_beyond_int32_is_refused_naming_the_field(field: str) -> None:
    with pytest.raises(InputError) as err:
        parse_deployment(_doc(field, MAX_WIRE_INT32 + 1))
    assert err.value.field == field
    assert "must be an integer from" in str(err.value)


@pytest.mark.parametrize("field", ["spec.minGpus", "spec.maxGpus", "spec.budget.gpus"])
def test_the_largest_accepted_value_crosses_the_wire(field: str) -> None:
    spec = parse_deployment(_doc(field, MAX_WIRE_INT32))
    assert spec_from_proto(spec_to_proto(spec)) == spec


def test_deploy_apply_prints_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(
        "apiVersion: mixfleet.io/v1alpha1\nkind: ModelDeployment\nmetadata: {name: mx}\n"
        "spec: {model: mixtral-8x7b, minGpus: 2147483648}\n"
    )
    argv = [sys.executable, "-m", "controlplane.cli", "--controller", "127.0.0.1:9"]
    run = subprocess.run(
        [*argv, "deploy", "apply", "-f", str(path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1
        and "spec.minGpus: must be an integer from 0 to 2,147,483,647" in (errors[0])
    ), run.stderr
