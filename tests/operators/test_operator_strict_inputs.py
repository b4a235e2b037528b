"""The operator's strict inputs: GPUNodes that cannot reach each other, and specs with
unknown fields, become conditions naming the nodes or the field - never a plan."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from k8s_builders import deployment, inventory, node_view, observed

from apis.kube.errors import PermanentError
from apis.kube.schema import from_wire
from apis.kube.v1alpha1 import ModelDeploymentSpec
from operators.decide import ApplyStatus, SolveAction, reconcile
from operators.inputs import solve_inputs
from operators.observe import ReconcileSettings
from policies.errors import InputError
from policies.hardware.inventory import NicInventory

SETTINGS = ReconcileSettings(node_stale_after_s=90.0, plan_history=2, solver_error_retry_s=60.0)


def _solved(actions: tuple[object, ...]) -> dict[str, Any]:
    (status,) = [a for a in actions if isinstance(a, ApplyStatus)]
    conditions = status.status["conditions"]
    return dict(next(c for c in conditions if c["type"] == "Solved"))


def test_gpunodes_on_unjoined_fabrics_are_a_condition_not_a_plan() -> None:
    far = inventory("a100-0")
    far = dataclasses.replace(
        far, nics=tuple(dataclasses.replace(n, fabric="ib-far") for n in far.nics)
    )
    assert all(isinstance(n, NicInventory) and n.fabric == "ib-far" for n in far.nics)
    obs = observed(nodes=[node_view("h100-0"), node_view("a100-0", inv=far)])
    actions = reconcile(obs, SETTINGS)
    assert not [a for a in actions if isinstance(a, SolveAction)]
    solved = _solved(actions)
    assert solved["status"] == "False" and solved["reason"] == "NodesUnreachable"
    assert "nodes 'a100-0' and 'h100-0' cannot reach each other" in solved["message"]
    assert "--nic-fabric" in solved["message"]


def test_a_spec_with_an_unknown_field_is_a_condition() -> None:
    spec_doc = {"model": "mixtral-8x7b", "rebalance": {"sustainSec": 20}}
    with pytest.raises(InputError) as err:  # what Operator.observe keeps as spec_error
        from_wire(ModelDeploymentSpec, spec_doc, "spec", strict=True)
    d = dataclasses.replace(deployment(), spec=None, spec_error=str(err.value))
    with pytest.raises(PermanentError) as refused:
        solve_inputs(observed(d), SETTINGS)
    assert refused.value.reason == "InvalidSpec"
    assert "spec.rebalance.sustainSec" in str(refused.value) and "'sustainS'" in str(refused.value)
    solved = _solved(reconcile(observed(d), SETTINGS))
    assert solved["reason"] == "InvalidSpec" and "sustainSec" in solved["message"]


def test_an_unset_tokens_per_gpu_takes_the_phase_default_as_on_the_command_line() -> None:
    from apis.kube import v1alpha1
    from operators.inputs import effective_spec
    from policies.defaults import default_tokens_per_gpu

    for phase in ("decode", "prefill"):
        cr = from_wire(
            v1alpha1.ModelDeploymentSpec,
            {"model": "mixtral-8x7b", "workload": {"phase": phase}},
            "spec",
        )
        assert cr.workload.tokens_per_gpu is None  # no schema default: it depends on the phase
        eff = effective_spec("mx", cr, v1alpha1.PlacementPolicySpec())
        assert eff.workload.tokens_per_gpu == default_tokens_per_gpu(phase)
    cr = from_wire(
        v1alpha1.ModelDeploymentSpec,
        {"model": "mixtral-8x7b", "workload": {"phase": "prefill", "tokensPerGpu": 512}},
        "spec",
    )
    assert effective_spec("mx", cr, v1alpha1.PlacementPolicySpec()).workload.tokens_per_gpu == 512
