"""What a node is asked to run: :class:`NodeAssignment` (this node's GPUs of one plan
version), read from the controller's ``part_json`` (:func:`assignment_from_json`, with the
zlib-compressed expert location inflated under a size cap) or cut from a whole plan
(:func:`assignment_from_plan`), and the checks an applier runs before staging one
(:func:`check_assignment`, :func:`check_expert_location`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.defaults import INSTANCE_ROLES as ROLES
from policies.errors import InputError
from policies.exports.engine import placement_document
from policies.plan import GpuPlan, Plan, gpu_plan_from_dict, gpu_plan_to_dict

_DEPLOYMENT_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class NodeAssignment:
    """This node's part of one plan version of one deployment.

    The wire form is the ``part_json`` document of ``mixfleet.v1.Assignment`` (see
    proto/mixfleet/v1/agent.proto); :meth:`to_dict` and :func:`assignment_from_dict` convert.

    Attributes:
        deployment: deployment name (DNS-1123).
        plan_id: plan content id.
        version: plan version (grows per deployment).
        node: node name.
        world_size: GPUs (ranks) in the whole plan.
        header: the plan without its GPUs (``Plan.to_dict()`` less ``gpus``): model, form,
            MoE layers, experts, slots, summary.
        gpus: this node's GPUs in the plan (may be empty: the node holds nothing).
        ranks: rank of each of ``gpus`` in the whole plan (its position in ``Plan.gpus``).
        expert_location_json: engine form: the whole plan's SGLang ``--init-expert-location``
            document (``{"physical_to_logical_map": [[...]]}``) as UTF-8 JSON, kept as bytes
            (written to disk verbatim); empty in native form.
        expert_location_sha256: hex SHA-256 the part names for ``expert_location_json``
            (``""`` when the part names none).
        expert_location_bytes: its length as the part names it, bytes (0 = none named).
        role: the engine instance's role when the deployment is one (``aggregated`` |
            ``prefill`` | ``decode``, :data:`policies.fleetplan.ROLES`); ``""`` for a
            deployment not cut into instances. From ``Assignment.role``, not ``part_json``.
        instance_of: the deployment the instance serves (``""`` when not an instance).
        engine_port: the instance's engine HTTP port (TCP), where routers reach it on its
            first node; 0 = the engine's default.
        bootstrap_port: a prefill instance's SGLang bootstrap port (TCP); 0 otherwise.
    """

    deployment: str
    plan_id: str
    version: int
    node: str
    world_size: int
    header: Mapping[str, Any]
    gpus: tuple[GpuPlan, ...]
    ranks: tuple[int, ...]
    expert_location_json: bytes = b""
    expert_location_sha256: str = ""
    expert_location_bytes: int = 0
    role: str = ""
    instance_of: str = ""
    engine_port: int = 0
    bootstrap_port: int = 0

    @property
    def expert_location(self) -> dict[str, Any] | None:
        """``expert_location_json`` parsed (None when absent).

        Raises:
            InputError: it is not a JSON object.
        """
        if not self.expert_location_json:
            return None
        try:
            doc = json.loads(self.expert_location_json)
        except ValueError as exc:
            raise InputError(f"not valid JSON: {exc}", field="expert_location_json") from exc
        if not isinstance(doc, dict):
            raise InputError("must be a JSON object", field="expert_location_json")
        return doc

    @property
    def model(self) -> str:
        return str(self.header.get("model", ""))

    @property
    def form(self) -> str:
        summary = self.header.get("summary") or {}
        return str(summary.get("form", "engine"))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.header.get("moe_layers", ()))

    @property
    def num_experts(self) -> int:
        return int(self.header.get("num_experts", 0))

    @property
    def slots_per_gpu(self) -> int | None:
        v = self.header.get("slots_per_gpu")
        return None if v is None else int(v)

    def to_dict(self) -> dict[str, Any]:
        """The ``part_json`` document (inverse of :func:`assignment_from_dict`), plus, when
        the deployment is an engine instance, ``"instance": {"role", "of", "engine_port",
        "bootstrap_port"}`` (what ``Assignment`` carries beside the part; the agent keeps it
        in the ``plan.json`` it writes)."""
        gpus = []
        for rank, g in zip(self.ranks, self.gpus, strict=True):
            d = gpu_plan_to_dict(g)
            d["rank"] = rank
            gpus.append(d)
        doc: dict[str, Any] = {
            "deployment": self.deployment,
            "plan_id": self.plan_id,
            "version": self.version,
            "node": self.node,
            "world_size": self.world_size,
            "plan": dict(self.header),
            "gpus": gpus,
        }
        if self.expert_location_sha256:
            doc["expert_location_sha256"] = self.expert_location_sha256
            doc["expert_location_bytes"] = self.expert_location_bytes or len(
                self.expert_location_json
            )
        if self.role:
            doc["instance"] = {
                "role": self.role,
                "of": self.instance_of,
                "engine_port": self.engine_port,
                "bootstrap_port": self.bootstrap_port,
            }
        return doc


def assignment_from_plan(deployment: str, plan: Plan, node: str) -> NodeAssignment:
    """The part of ``plan`` that ``node`` applies (what the controller sends it)."""
    mine = [(rank, g) for rank, g in enumerate(plan.gpus) if g.node == node]
    header = plan.to_dict()
    del header["gpus"]
    header = json.loads(json.dumps(header))  # the wire form: lists, not tuples
    location = b""
    if plan.form == "engine" and plan.moe_layers:
        location = json.dumps(placement_document(plan, "sglang"), separators=(",", ":")).encode()
    return NodeAssignment(
        deployment=deployment,
        plan_id=plan.id,
        version=plan.version,
        node=node,
        world_size=len(plan.gpus),
        header=header,
        gpus=tuple(g for _, g in mine),
        ranks=tuple(r for r, _ in mine),
        expert_location_json=location,
        expert_location_sha256=hashlib.sha256(location).hexdigest() if location else "",
        expert_location_bytes=len(location),
    )


def _field(d: Mapping[str, Any], key: str, path: str) -> Any:
    if not isinstance(d, Mapping):
        raise InputError("must be a JSON object", field=path)
    if key not in d:
        raise InputError(f"missing field {key!r}", field=f"{path}.{key}")
    return d[key]


def assignment_from_dict(d: Any, expert_location_json: bytes = b"") -> NodeAssignment:
    """Read a ``part_json`` document (and the plan's expert location that came with it).

    Raises:
        InputError: naming the missing or malformed field.
    """
    if not isinstance(d, Mapping):
        raise InputError("an assignment must be a JSON object", field="part")
    try:
        gpus = []
        ranks = []
        for i, g in enumerate(_field(d, "gpus", "part")):
            path = f"part.gpus[{i}]"
            gpus.append(gpu_plan_from_dict(g, path))
            ranks.append(int(_field(g, "rank", path)))
        header = _field(d, "plan", "part")
        if not isinstance(header, Mapping):
            raise InputError("must be a JSON object", field="part.plan")
        digest = d.get("expert_location_sha256", "")
        if not isinstance(digest, str):
            raise InputError("must be a hex string", field="part.expert_location_sha256")
        size = d.get("expert_location_bytes", 0)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InputError("must be an integer >= 0", field="part.expert_location_bytes")
        inst = d.get("instance", {})
        if not isinstance(inst, Mapping):
            raise InputError("must be a JSON object", field="part.instance")
        for key in ("engine_port", "bootstrap_port"):
            port = inst.get(key, 0)
            if isinstance(port, bool) or not isinstance(port, int):
                raise InputError("must be an integer", field=f"part.instance.{key}")
        return NodeAssignment(
            deployment=str(_field(d, "deployment", "part")),
            plan_id=str(_field(d, "plan_id", "part")),
            version=int(_field(d, "version", "part")),
            node=str(_field(d, "node", "part")),
            world_size=int(_field(d, "world_size", "part")),
            header=dict(header),
            gpus=tuple(gpus),
            ranks=tuple(ranks),
            expert_location_json=bytes(expert_location_json),
            expert_location_sha256=digest,
            expert_location_bytes=size,
            role=str(inst.get("role", "")),
            instance_of=str(inst.get("of", "")),
            engine_port=inst.get("engine_port", 0),
            bootstrap_port=inst.get("bootstrap_port", 0),
        )
    except (TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"malformed assignment: {exc}", field="part") from exc


#: Largest expert location an agent inflates, bytes (a 256-layer x 65,536-slot map is ~1 GiB;
#: real ones are megabytes).
MAX_EXPERT_LOCATION_BYTES = 1 << 30


def inflate_expert_location(data: bytes, expected_bytes: int) -> bytes:
    """Decompress ``Assignment.expert_location_zlib`` (nothing for empty input), refusing
    more output than the part announced (``expert_location_bytes``).

    Raises:
        InputError: not zlib data, or it inflates beyond ``expected_bytes`` (a corrupt or
            hostile message).
    """
    if not data:
        return b""
    limit = min(max(expected_bytes, 0), MAX_EXPERT_LOCATION_BYTES)
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise InputError(f"not zlib data: {exc}", field="expert_location_zlib") from exc
    if len(out) > limit or inflater.unconsumed_tail:
        raise InputError(
            f"inflates beyond the {limit} bytes the part announces",
            field="expert_location_zlib",
        )
    return out


def assignment_from_json(data: bytes, expert_location_json: bytes = b"") -> NodeAssignment:
    """:func:`assignment_from_dict` of UTF-8 JSON bytes.

    Raises:
        InputError: not JSON, or not a valid part.
    """
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise InputError(f"not valid JSON: {exc}", field="part_json") from exc
    return assignment_from_dict(doc, expert_location_json)


def check_assignment(a: NodeAssignment, node: str, *, with_location: bool = True) -> list[str]:
    """Problems that make ``a`` unusable on ``node``; empty when it can be staged.

    Args:
        with_location: the expert location must be there and match the part's digest
            (False: it was not inflated because nothing on this node reads it).
    """
    problems: list[str] = []
    if not _DEPLOYMENT_RE.match(a.deployment) or len(a.deployment) > 63:
        problems.append(f"deployment: {a.deployment!r} is not a DNS-1123 name")
    if a.version < 1:
        problems.append(f"version: must be >= 1, got {a.version}")
    if not a.plan_id:
        problems.append("plan_id: empty")
    if a.node != node:
        problems.append(f"node: assignment is for {a.node!r}, this agent is {node!r}")
    if len(a.ranks) != len(a.gpus):
        problems.append(f"ranks: {len(a.ranks)} ranks for {len(a.gpus)} GPUs")
    bad_ranks = [r for r in a.ranks if not 0 <= r < a.world_size]
    if bad_ranks:
        problems.append(f"ranks: {bad_ranks[:3]} outside world size {a.world_size}")
    if a.form not in ("engine", "native"):
        problems.append(f"form: must be 'engine' or 'native', got {a.form!r}")
    problems += _instance_problems(a)
    if not with_location:
        pass
    elif a.expert_location_sha256 or a.expert_location_json:
        got = hashlib.sha256(a.expert_location_json).hexdigest()
        if got != a.expert_location_sha256:
            problems.append(
                f"expert_location_json: {len(a.expert_location_json)} bytes with SHA-256 "
                f"{got[:12]}..., the part names {a.expert_location_sha256[:12] or '(none)'}..."
            )
    elif a.form == "engine" and a.moe_layers:
        problems.append("expert_location_json: missing (an engine-form MoE part needs it)")
    for k, g in enumerate(a.gpus):
        path = f"gpus[{k}] ({g.gpu})"
        if g.node != node:
            problems.append(f"{path}.node: GPU belongs to {g.node!r}, not {node!r}")
        if gpu_index(g) is None:
            problems.append(f"{path}.gpu: expected '<node>/gpu<index>'")
        if not (0.0 <= g.attention_share <= 1.0 + 1e-9):
            problems.append(f"{path}.attention_share: {g.attention_share} not in [0, 1]")
        if not math.isfinite(g.dp_weight) or g.dp_weight < 0:
            problems.append(f"{path}.dp_weight: must be a finite number >= 0, got {g.dp_weight}")
        if len(g.experts) != len(a.moe_layers):
            problems.append(
                f"{path}.experts: {len(g.experts)} layers, plan has {len(a.moe_layers)}"
            )
        for li, layer in enumerate(g.experts):
            if a.form == "engine" and a.slots_per_gpu is not None and len(layer) != a.slots_per_gpu:
                problems.append(
                    f"{path}.experts[{li}]: {len(layer)} slots, engine form needs {a.slots_per_gpu}"
                )
            for s in layer:
                if not 0 <= s.expert < a.num_experts:
                    problems.append(f"{path}.experts[{li}]: expert {s.expert} out of range")
                if not (0.0 < s.share <= 1.0 + 1e-9):
                    problems.append(f"{path}.experts[{li}]: share {s.share} not in (0, 1]")
        total = g.memory_bytes.get("total", 0.0)
        usable = g.memory_bytes.get("usable", math.inf)
        if total > usable * (1 + 1e-9):
            problems.append(
                f"{path}.memory_bytes: needs {total / 2**30:.1f} GiB, {usable / 2**30:.1f} usable"
            )
    return problems


def _instance_problems(a: NodeAssignment) -> list[str]:
    """Problems with ``a``'s instance fields (role, ports)."""
    problems: list[str] = []
    if a.role and a.role not in ROLES:
        problems.append(f"role: must be one of {', '.join(ROLES)} or empty, got {a.role!r}")
    if not a.role and (a.instance_of or a.engine_port or a.bootstrap_port):
        problems.append("role: empty, but instance_of or a port is set")
    if a.role and not a.instance_of:
        problems.append("instance_of: empty for an instance")
    for name, port in (("engine_port", a.engine_port), ("bootstrap_port", a.bootstrap_port)):
        if not 0 <= port <= 65535:
            problems.append(f"{name}: must be a TCP port in 0..65535 (0 = default), got {port}")
    if a.bootstrap_port and a.role != "prefill":
        problems.append(f"bootstrap_port: set for a {a.role or 'plain'} deployment, not prefill")
    return problems


def check_expert_location(a: NodeAssignment) -> list[str]:
    """Problems with the content of ``a``'s expert location: JSON, one row per model layer,
    one entry per physical slot of the plan (``world_size * slots_per_gpu``), experts in
    range. Empty when there is none (native form) or it is sound."""
    if not a.expert_location_json:
        return []
    try:
        doc = a.expert_location
    except InputError as exc:
        return [str(exc)]
    rows = (doc or {}).get("physical_to_logical_map")
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        return ["expert_location_json.physical_to_logical_map: must be a list of lists"]
    num_layers = a.header.get("num_layers")
    if isinstance(num_layers, int) and len(rows) != num_layers:
        return [f"expert_location_json: {len(rows)} rows, the model has {num_layers} layers"]
    slots = a.slots_per_gpu
    width = a.world_size * slots if slots is not None else None
    for i, row in enumerate(rows):
        if width is not None and len(row) != width:
            return [f"expert_location_json row {i}: {len(row)} slots, the plan has {width}"]
        if any(not isinstance(e, int) or not 0 <= e < a.num_experts for e in row):
            return [f"expert_location_json row {i}: expert ids outside 0..{a.num_experts - 1}"]
    return []


def gpu_index(g: GpuPlan) -> int | None:
    """The device index of a plan GPU named ``.../gpu<i>`` (its CUDA index on this node);
    None when the name does not end in ``gpu<digits>``."""
    tail = g.gpu.rsplit("/", 1)[-1]
    if tail.startswith("gpu") and tail[3:].isdigit():
        return int(tail[3:])
    return None
