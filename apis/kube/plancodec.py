"""Plans in PartitionPlan objects: canonical JSON, gzip, base64.

A DeepSeek-V3 plan on 24 GPUs (58 MoE layers x 24 GPUs x 12 slots) is about 190 KB of JSON;
compressed and base64-encoded, its whole PartitionPlan object is about 45 KB, far below the
1.5 MB limit of an object (tests/operators/test_plancodec.py measures it). Encoding is deterministic (sorted
keys, gzip ``mtime=0``) so the same plan always yields the same bytes and re-applying it
is a no-op.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass

from apis.kube.errors import PermanentError
from apis.kube.v1alpha1 import MAX_PLAN_DATA_CHARS, PartitionPlanSpec, PlanGpu
from policies.errors import InputError
from policies.plan import Plan, plan_from_dict


@dataclass(frozen=True)
class EncodedPlan:
    """A plan as stored in ``PartitionPlan.spec``.

    Attributes:
        data: gzip + base64 of the canonical JSON, characters.
        sha256: hex SHA-256 of the uncompressed JSON.
        uncompressed_bytes: size of the canonical JSON, bytes.
    """

    data: str
    sha256: str
    uncompressed_bytes: int


def canonical_json(plan: Plan) -> bytes:
    """The plan's :meth:`Plan.to_dict` as compact JSON with sorted keys."""
    return json.dumps(plan.to_dict(), separators=(",", ":"), sort_keys=True).encode()


def encode_plan(plan: Plan) -> EncodedPlan:
    """Compress a plan for a PartitionPlan.

    Raises:
        PermanentError: reason ``PlanTooLarge`` when even compressed it exceeds
            :data:`MAX_PLAN_DATA_CHARS`.
    """
    raw = canonical_json(plan)
    data = base64.b64encode(gzip.compress(raw, compresslevel=9, mtime=0)).decode("ascii")
    if len(data) > MAX_PLAN_DATA_CHARS:
        raise PermanentError(
            "PlanTooLarge",
            f"the plan is {len(data)} characters compressed, more than the "
            f"{MAX_PLAN_DATA_CHARS} a PartitionPlan holds. To fix: place on fewer GPUs or "
            "use fewer redundant experts",
        )
    return EncodedPlan(data, hashlib.sha256(raw).hexdigest(), len(raw))


def decode_plan(spec: PartitionPlanSpec) -> Plan:
    """The plan a PartitionPlan holds, checked against its digest.

    Raises:
        InputError: corrupt data, digest mismatch or not a plan document.
    """
    if spec.encoding != "gzip+base64":
        raise InputError(f"unknown encoding {spec.encoding!r}", field="spec.encoding")
    try:
        raw = gzip.decompress(base64.b64decode(spec.data, validate=True))
    except (binascii.Error, OSError, EOFError, zlib.error) as exc:
        raise InputError(f"cannot decode plan data: {exc}", field="spec.data") from exc
    if hashlib.sha256(raw).hexdigest() != spec.data_sha256:
        raise InputError("plan data does not match dataSha256", field="spec.data")
    return plan_from_dict(json.loads(raw))


def plan_spec(
    plan: Plan,
    *,
    deployment: str,
    inputs_digest: str,
    deployment_generation: int,
) -> PartitionPlanSpec:
    """The PartitionPlan spec of a solved plan."""
    enc = encode_plan(plan)
    nodes = tuple(sorted({g.node for g in plan.gpus}))
    return PartitionPlanSpec(
        deployment=deployment,
        plan_id=plan.id,
        version=plan.version,
        model=plan.model,
        form=plan.form,
        policy=plan.summary.policy,
        inputs_digest=inputs_digest,
        deployment_generation=deployment_generation,
        nodes=nodes,
        gpus=tuple(
            PlanGpu(g.gpu, g.node, g.model, round(g.attention_share, 9), round(g.dp_weight, 9))
            for g in plan.gpus
        ),
        step_time_us=round(plan.summary.step_time_us, 3),
        tokens_per_s=round(plan.summary.tokens_per_s, 3),
        data=enc.data,
        data_sha256=enc.sha256,
        uncompressed_bytes=enc.uncompressed_bytes,
    )
