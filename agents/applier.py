"""Plan applier: hands this node's part of a plan to the local runtime, crash-safely.

Two phases, matching the controller's rollout:

* :meth:`PlanApplier.stage` writes every file of a new plan version into a staging
  directory (each file written and fsynced, then the directory fsynced), reads them back to
  validate them, and runs the hook with ``MIXFLEET_HOOK_PHASE=prepare``. Nothing visible to
  engines changes. Success means the agent may ack ``prepared``.
* :meth:`PlanApplier.commit` renames the staged directory into ``.versions/`` and switches
  the deployment's link to it with one atomic ``rename(2)`` of a symlink, then runs the hook
  with ``MIXFLEET_HOOK_PHASE=commit``. If the hook fails the link is switched back: the
  previous committed files stay in force. Success means the agent may ack ``committed``.

Layout under ``plan_dir``::

    <deployment>.json   -> <deployment>/plan.json       (one JSON per deployment)
    <deployment>        -> .versions/<deployment>.v<N>  (switched atomically on commit)
    .versions/<deployment>.v<N>/plan.json               this node's part of plan version N
    .versions/<deployment>.v<N>/gpu<i>.env              env file for GPU i's engine container
    .versions/<deployment>.v<N>/gpu<i>.experts.json     GPU i's expert slots per MoE layer
    .staging/<deployment>.v<N>/...                       staged, not yet committed

Engines read ``<plan_dir>/<deployment>/gpu<i>.env`` (``docker run --env-file``); because the
whole directory switches in one rename, they never see a mix of two versions. A crash at
any point leaves either the old or the new version committed, never a torn one;
:meth:`PlanApplier.recover` removes staging leftovers at start-up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from policies.errors import InputError
from policies.exports import export_plan
from policies.plan import ExpertSlot, GpuPlan, Plan, RuntimeHints

_DEPLOYMENT_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
HOOK_PHASES = ("prepare", "commit")


# --------------------------------------------------------------------------- assignment


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
        """The ``part_json`` document (inverse of :func:`assignment_from_dict`)."""
        gpus = []
        for rank, g in zip(self.ranks, self.gpus, strict=True):
            d = asdict(g)
            d["experts"] = [
                [[s["expert"], round(s["share"], 9)] for s in layer] for layer in d["experts"]
            ]
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
        return doc


def assignment_from_plan(deployment: str, plan: Plan, node: str) -> NodeAssignment:
    """The part of ``plan`` that ``node`` applies (what the controller sends it)."""
    mine = [(rank, g) for rank, g in enumerate(plan.gpus) if g.node == node]
    header = plan.to_dict()
    del header["gpus"]
    header = json.loads(json.dumps(header))  # the wire form: lists, not tuples
    location = b""
    if plan.form == "engine" and plan.moe_layers:
        location = json.dumps(export_plan(plan, "sglang"), separators=(",", ":")).encode()
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
            gpus.append(
                GpuPlan(
                    gpu=str(_field(g, "gpu", path)),
                    node=str(_field(g, "node", path)),
                    model=str(_field(g, "model", path)),
                    attention_share=float(_field(g, "attention_share", path)),
                    attention_heads=g.get("attention_heads"),
                    dp_weight=float(_field(g, "dp_weight", path)),
                    experts=tuple(
                        tuple(ExpertSlot(int(e), float(s)) for e, s in layer)
                        for layer in _field(g, "experts", path)
                    ),
                    hints=RuntimeHints(**_field(g, "hints", path)),
                    predicted_busy_us=float(g.get("predicted_busy_us", 0.0)),
                    memory_bytes={
                        str(k): float(v) for k, v in dict(g.get("memory_bytes", {})).items()
                    },
                )
            )
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
        if _gpu_index(g) is None:
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


def _gpu_index(g: GpuPlan) -> int | None:
    tail = g.gpu.rsplit("/", 1)[-1]
    if tail.startswith("gpu") and tail[3:].isdigit():
        return int(tail[3:])
    return None


def gpu_env(
    a: NodeAssignment, k: int, experts_file: Path, location_file: Path | None
) -> dict[str, str]:
    """Environment of the engine container of ``a.gpus[k]``; file paths point through the
    deployment's link so they stay valid across versions."""
    g = a.gpus[k]
    h = g.hints
    env = {
        "MIXFLEET_DEPLOYMENT": a.deployment,
        "MIXFLEET_PLAN_ID": a.plan_id,
        "MIXFLEET_PLAN_VERSION": str(a.version),
        "MIXFLEET_NODE": a.node,
        "MIXFLEET_MODEL": a.model,
        "MIXFLEET_FORM": a.form,
        "MIXFLEET_GPU_ID": g.gpu,
        "MIXFLEET_GPU_INDEX": str(_gpu_index(g)),
        "MIXFLEET_RANK": str(a.ranks[k]),
        "MIXFLEET_WORLD_SIZE": str(a.world_size),
        "MIXFLEET_ATTENTION_SHARE": f"{g.attention_share:.9f}",
        "MIXFLEET_DP_WEIGHT": f"{g.dp_weight:.9f}",
        "MIXFLEET_EXPERTS_FILE": str(experts_file),
        "MIXFLEET_EP_BACKEND": h.ep_backend,
        "MIXFLEET_DEEPEP_MODE": h.deepep_mode,
        "MIXFLEET_DEEPEP_NUM_SMS": str(h.deepep_num_sms),
        "MIXFLEET_DEEPEP_NUM_NVL_BYTES": str(h.num_nvl_bytes),
        "MIXFLEET_DEEPEP_NUM_RDMA_BYTES": str(h.num_rdma_bytes),
        "MIXFLEET_FP8_DISPATCH": "1" if h.fp8_dispatch else "0",
        "MIXFLEET_ATTENTION_BACKEND": h.attention_backend,
        "MIXFLEET_DECODE_NUM_SPLITS": str(h.decode_num_splits),
    }
    if a.slots_per_gpu is not None:
        env["MIXFLEET_SLOTS_PER_GPU"] = str(a.slots_per_gpu)
    if g.attention_heads is not None:
        env["MIXFLEET_ATTENTION_HEADS"] = str(g.attention_heads)
    if location_file is not None:
        env["MIXFLEET_EXPERT_LOCATION_FILE"] = str(location_file)
    return env


def render_env(env: Mapping[str, str]) -> str:
    """``KEY=VALUE`` lines as ``docker run --env-file`` reads them (no quoting)."""
    for k, v in env.items():
        if "\n" in v or "\n" in k:
            raise InputError("env values cannot contain newlines", field=k)
    return "".join(f"{k}={v}\n" for k, v in sorted(env.items()))


def parse_env(text: str) -> dict[str, str]:
    """Inverse of :func:`render_env`."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


# --------------------------------------------------------------------------- file primitives


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, creations) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Create ``path`` (which must not exist) with ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` so readers see the old or the new content, never a
    part: write a temporary file in the same directory, fsync it, rename it over ``path``,
    fsync the directory. The temporary file is removed if any step fails."""
    tmp = path.parent / f".tmp-{path.name}-{secrets.token_hex(4)}"
    try:
        write_file(tmp, data, fsync=fsync)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_symlink(link: Path, target: str, *, fsync: bool = True) -> None:
    """Point ``link`` at ``target`` with one rename (a new symlink renamed over the old)."""
    tmp = link.parent / f".tmp-{link.name}-{secrets.token_hex(4)}"
    try:
        os.symlink(target, tmp)
        os.replace(tmp, link)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if fsync:
        fsync_dir(link.parent)


# --------------------------------------------------------------------------- hook


@dataclass(frozen=True)
class HookResult:
    """Outcome of one hook run.

    Attributes:
        ok: exited 0 within the timeout.
        reason: why not (exit code or timeout and the last stderr line); empty when ok.
    """

    ok: bool
    reason: str = ""


def run_hook(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> HookResult:
    """Run ``argv`` with ``env`` added to this process's environment; kill its whole process
    group when it outlives ``timeout_s``."""
    full_env = {**os.environ, **env}
    try:
        proc = subprocess.Popen(
            list(argv),
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return HookResult(False, f"hook {argv[0]!r} could not start: {exc.strerror or exc}")
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return HookResult(False, f"hook timed out after {timeout_s:g} s")
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        tail = f": {lines[-1][:200]}" if lines else ""
        return HookResult(False, f"hook exited with status {proc.returncode}{tail}")
    return HookResult(True)


# --------------------------------------------------------------------------- applier


@dataclass(frozen=True)
class ApplyResult:
    """Outcome of a stage, commit or remove.

    Attributes:
        ok: the step succeeded (ack ``prepared`` / ``committed``).
        reason: why not, for the ``failed`` ack; empty when ok.
    """

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class CommittedPlan:
    """What is in force for a deployment on this node."""

    deployment: str
    plan_id: str
    version: int


class Applier(Protocol):
    """What the agent needs from an applier (disk-backed or in memory).

    Attributes:
        blocking: methods block (disk, hook): the agent calls them from a worker thread.
        wants_expert_location: it hands the whole plan's expert location to an engine, so
            the agent inflates and checks it; False: parts are staged without it.
    """

    blocking: bool
    wants_expert_location: bool

    def stage(self, a: NodeAssignment) -> ApplyResult: ...

    def commit(self, deployment: str, version: int) -> ApplyResult: ...

    def abort(self, deployment: str, version: int) -> None: ...

    def committed(self, deployment: str) -> CommittedPlan | None: ...

    def remove(self, deployment: str) -> ApplyResult: ...

    def is_staged(self, deployment: str, version: int) -> bool: ...

    def applied(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class ApplierSettings:
    """Where and how plans are written.

    Attributes:
        plan_dir: directory the plan files go to (created if missing).
        node: this node's name; assignments for other nodes are refused.
        hook: command run after staging and after committing (argv); None for no hook.
        hook_timeout_s: the hook is killed and the step fails after this many seconds.
        hook_phases: phases the hook runs in (``prepare``, ``commit``).
        keep_versions: committed versions kept on disk per deployment (for roll-back and
            inspection), the one in force included.
        fsync: fsync files and directories (off only for throw-away simulations).
    """

    plan_dir: Path
    node: str
    hook: tuple[str, ...] | None = None
    hook_timeout_s: float = 30.0
    hook_phases: tuple[str, ...] = HOOK_PHASES
    keep_versions: int = 3
    fsync: bool = True

    @staticmethod
    def parse_hook(command: str | None) -> tuple[str, ...] | None:
        """A ``--hook`` string split like a shell would (no shell is run)."""
        if not command:
            return None
        argv = tuple(shlex.split(command))
        return argv or None


class PlanApplier:
    """Disk-backed :class:`Applier` (see the module docstring for the layout).

    Methods do blocking file I/O and may run the hook: call them from a worker thread in
    asyncio code (``asyncio.to_thread``).
    """

    blocking = True
    wants_expert_location = True

    def __init__(self, settings: ApplierSettings) -> None:
        self.settings = settings
        self.root = Path(settings.plan_dir)
        self.staging = self.root / ".staging"
        self.versions = self.root / ".versions"
        for d in (self.root, self.staging, self.versions):
            d.mkdir(parents=True, exist_ok=True)
        # deployment -> (link target, what it holds): heartbeats ask often, links rarely move.
        self._committed_cache: dict[str, tuple[str, CommittedPlan]] = {}

    # -- naming

    def _staged_dir(self, deployment: str, version: int) -> Path:
        return self.staging / f"{deployment}.v{version}"

    def _version_dir(self, deployment: str, version: int) -> Path:
        return self.versions / f"{deployment}.v{version}"

    def link(self, deployment: str) -> Path:
        """The path engines read: ``<plan_dir>/<deployment>`` (a symlink)."""
        return self.root / deployment

    # -- queries

    def committed(self, deployment: str) -> CommittedPlan | None:
        """The plan in force for ``deployment``, None when none was committed."""
        try:
            target = os.readlink(self.link(deployment))
        except OSError:
            return None
        cached = self._committed_cache.get(deployment)
        if cached is not None and cached[0] == target:
            return cached[1]
        try:
            doc = json.loads((self.link(deployment) / "plan.json").read_text())
            found = CommittedPlan(deployment, str(doc["plan_id"]), int(doc["version"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._committed_cache[deployment] = (target, found)
        return found

    def is_staged(self, deployment: str, version: int) -> bool:
        return self._staged_dir(deployment, version).is_dir()

    def applied(self) -> dict[str, int]:
        """Deployment -> committed version (for heartbeats)."""
        out: dict[str, int] = {}
        for d in self.deployments():
            c = self.committed(d)
            if c is not None:
                out[d] = c.version
        return out

    def deployments(self) -> list[str]:
        """Deployments with a committed plan on this node."""
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_symlink() and not p.name.endswith(".json") and not p.name.startswith(".")
        )

    def recover(self) -> list[str]:
        """Remove leftovers of an interrupted stage or commit (staged directories, temporary
        files); returns what was removed. Committed plans are untouched."""
        removed: list[str] = []
        for p in sorted(self.staging.iterdir()):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(str(p))
        for p in sorted(self.root.glob(".tmp-*")):
            with contextlib.suppress(OSError):
                p.unlink()
            removed.append(str(p))
        return removed

    # -- phases

    def stage(self, a: NodeAssignment) -> ApplyResult:
        """Write and check ``a``'s files, run the prepare hook; nothing switches."""
        problems = check_assignment(a, self.settings.node)
        if problems:
            return ApplyResult(False, "invalid assignment: " + "; ".join(problems[:5]))
        current = self.committed(a.deployment)
        if current is not None:
            if current.version == a.version and current.plan_id == a.plan_id:
                return ApplyResult(True)  # already in force: acks are idempotent
            if current.version >= a.version:
                return ApplyResult(
                    False,
                    f"stale assignment: version {a.version} <= committed {current.version}",
                )
        staged = self._staged_dir(a.deployment, a.version)
        try:
            if staged.exists():
                shutil.rmtree(staged)
            staged.mkdir()
            expected = self._write_files(a, staged)
            self._verify(staged, expected)
        except (OSError, ValueError, InputError) as exc:
            shutil.rmtree(staged, ignore_errors=True)
            return ApplyResult(False, f"staging failed: {exc}")
        hook = self._hook("prepare", a.deployment, a.plan_id, a.version, staged)
        if not hook.ok:
            shutil.rmtree(staged, ignore_errors=True)
            return ApplyResult(False, f"prepare {hook.reason}")
        return ApplyResult(True)

    def commit(self, deployment: str, version: int) -> ApplyResult:
        """Switch ``deployment`` to its staged ``version`` and run the commit hook; on any
        failure the previous version stays (or is put back) in force."""
        current = self.committed(deployment)
        staged = self._staged_dir(deployment, version)
        if not staged.is_dir():
            if current is not None and current.version == version:
                return ApplyResult(True)  # a repeated commit
            return ApplyResult(False, f"nothing staged for {deployment} version {version}")
        try:
            plan_id = str(json.loads((staged / "plan.json").read_text())["plan_id"])
        except (OSError, ValueError, KeyError) as exc:
            shutil.rmtree(staged, ignore_errors=True)
            return ApplyResult(False, f"staged files of version {version} unreadable: {exc}")
        link = self.link(deployment)
        previous_target = os.readlink(link) if link.is_symlink() else None
        target = self._version_dir(deployment, version)
        fs = self.settings.fsync
        try:
            if target.exists():
                shutil.rmtree(target)
            os.replace(staged, target)
            if fs:
                fsync_dir(self.versions)
                fsync_dir(self.staging)
            atomic_symlink(link, os.path.relpath(target, self.root), fsync=fs)
            json_link = self.root / f"{deployment}.json"
            if not json_link.is_symlink():
                atomic_symlink(json_link, f"{deployment}/plan.json", fsync=fs)
        except OSError as exc:
            self._restore(link, previous_target)
            if target.is_dir() and not staged.exists():
                with contextlib.suppress(OSError):
                    os.replace(target, staged)  # keep it staged so a retry can commit
            return ApplyResult(False, f"commit failed: {exc}")
        hook = self._hook("commit", deployment, plan_id, version, link)
        if not hook.ok:
            self._restore(link, previous_target)
            shutil.rmtree(target, ignore_errors=True)
            return ApplyResult(False, f"commit {hook.reason}; previous plan kept")
        self._drop_staged_before(deployment, version)
        self._gc(deployment)
        return ApplyResult(True)

    def apply(self, a: NodeAssignment) -> ApplyResult:
        """Stage and commit in one go (no two-phase rollout)."""
        staged = self.stage(a)
        if not staged.ok:
            return staged
        return self.commit(a.deployment, a.version)

    def abort(self, deployment: str, version: int) -> None:
        """Forget a staged version (the rollout was aborted)."""
        shutil.rmtree(self._staged_dir(deployment, version), ignore_errors=True)

    def remove(self, deployment: str) -> ApplyResult:
        """Withdraw a deployment from this node (deleted, or the node left the plan)."""
        try:
            for p in (self.root / f"{deployment}.json", self.link(deployment)):
                if p.is_symlink():
                    p.unlink()
            if self.settings.fsync:
                fsync_dir(self.root)
        except OSError as exc:
            return ApplyResult(False, f"remove failed: {exc}")
        for p in self.versions.glob(f"{deployment}.v*"):
            shutil.rmtree(p, ignore_errors=True)
        for p in self.staging.glob(f"{deployment}.v*"):
            shutil.rmtree(p, ignore_errors=True)
        return ApplyResult(True)

    # -- helpers

    def _write_files(self, a: NodeAssignment, d: Path) -> dict[str, bytes]:
        fs = self.settings.fsync
        files: dict[str, bytes] = {}
        files["plan.json"] = json.dumps(a.to_dict(), indent=1, sort_keys=True).encode()
        link = self.link(a.deployment).absolute()
        location_file = None
        if a.expert_location_json:
            problems = check_expert_location(a)
            if problems:
                raise InputError("; ".join(problems), field="expert_location_json")
            files["expert_location.json"] = a.expert_location_json
            location_file = link / "expert_location.json"
        for k, g in enumerate(a.gpus):
            idx = _gpu_index(g)
            experts = {
                "deployment": a.deployment,
                "plan_id": a.plan_id,
                "version": a.version,
                "gpu": g.gpu,
                "rank": a.ranks[k],
                "moe_layers": list(a.moe_layers),
                "num_experts": a.num_experts,
                "slots_per_gpu": a.slots_per_gpu,
                "slots": [[[s.expert, round(s.share, 9)] for s in layer] for layer in g.experts],
            }
            files[f"gpu{idx}.experts.json"] = json.dumps(experts, sort_keys=True).encode()
            env = gpu_env(a, k, link / f"gpu{idx}.experts.json", location_file)
            files[f"gpu{idx}.env"] = render_env(env).encode()
        for name, data in files.items():
            write_file(d / name, data, fsync=fs)
        if fs:
            fsync_dir(d)
        return files

    @staticmethod
    def _verify(d: Path, expected: Mapping[str, bytes]) -> None:
        """Read every staged file back: same bytes, and JSON files parse."""
        for name, data in expected.items():
            got = (d / name).read_bytes()
            if got != data:
                raise ValueError(f"{name} reads back different from what was written")
            if name.endswith(".json"):
                json.loads(got)
        assignment_from_dict(json.loads((d / "plan.json").read_bytes()))

    def _hook(
        self, phase: str, deployment: str, plan_id: str, version: int, path: Path
    ) -> HookResult:
        s = self.settings
        if s.hook is None or phase not in s.hook_phases:
            return HookResult(True)
        env = {
            "MIXFLEET_HOOK_PHASE": phase,
            "MIXFLEET_DEPLOYMENT": deployment,
            "MIXFLEET_PLAN_ID": plan_id,
            "MIXFLEET_PLAN_VERSION": str(version),
            "MIXFLEET_PLAN_PATH": str(path),
            "MIXFLEET_NODE": s.node,
        }
        return run_hook(s.hook, env, s.hook_timeout_s)

    def _restore(self, link: Path, previous_target: str | None) -> None:
        with contextlib.suppress(OSError):
            if previous_target is None:
                if link.is_symlink():
                    link.unlink()
            else:
                atomic_symlink(link, previous_target, fsync=self.settings.fsync)

    def _drop_staged_before(self, deployment: str, version: int) -> None:
        for p in self.staging.glob(f"{deployment}.v*"):
            v = _version_of(p.name, deployment)
            if v is not None and v <= version:
                shutil.rmtree(p, ignore_errors=True)

    def _gc(self, deployment: str) -> None:
        found = sorted(
            (v, p)
            for p in self.versions.glob(f"{deployment}.v*")
            if (v := _version_of(p.name, deployment)) is not None
        )
        for _, p in found[: max(0, len(found) - self.settings.keep_versions)]:
            shutil.rmtree(p, ignore_errors=True)


def _version_of(name: str, deployment: str) -> int | None:
    prefix = f"{deployment}.v"
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


@dataclass
class MemoryApplier:
    """An :class:`Applier` that keeps plans in memory: checks assignments like the disk
    applier but writes nothing (simulated agents, benchmarks).

    Attributes:
        node: this node's name.
        fail_stage: reason to fail every stage with (fault injection); empty: succeed.
        staged: ``(deployment, version) -> assignment``.
        current: ``deployment -> assignment in force``.
        wants_expert_location: inflate and check the plan's expert location like the disk
            applier. Off by default: a simulated node has no engine to read it, and
            simulating thousands of nodes in one process should not pay thousands of
            inflations a real fleet spreads over its machines.
    """

    node: str
    fail_stage: str = ""
    staged: dict[tuple[str, int], NodeAssignment] = field(default_factory=dict)
    current: dict[str, NodeAssignment] = field(default_factory=dict)
    blocking: bool = False
    wants_expert_location: bool = False

    def is_staged(self, deployment: str, version: int) -> bool:
        return (deployment, version) in self.staged

    def applied(self) -> dict[str, int]:
        return {d: a.version for d, a in self.current.items()}

    def stage(self, a: NodeAssignment) -> ApplyResult:
        problems = check_assignment(a, self.node, with_location=self.wants_expert_location)
        if problems:
            return ApplyResult(False, "invalid assignment: " + "; ".join(problems[:5]))
        if self.fail_stage:
            return ApplyResult(False, self.fail_stage)
        cur = self.current.get(a.deployment)
        if cur is not None and cur.version >= a.version:
            if cur.version == a.version and cur.plan_id == a.plan_id:
                return ApplyResult(True)
            return ApplyResult(
                False, f"stale assignment: version {a.version} <= committed {cur.version}"
            )
        self.staged[(a.deployment, a.version)] = a
        return ApplyResult(True)

    def commit(self, deployment: str, version: int) -> ApplyResult:
        a = self.staged.pop((deployment, version), None)
        if a is None:
            cur = self.current.get(deployment)
            if cur is not None and cur.version == version:
                return ApplyResult(True)
            return ApplyResult(False, f"nothing staged for {deployment} version {version}")
        self.current[deployment] = a
        for key in [k for k in self.staged if k[0] == deployment and k[1] <= version]:
            del self.staged[key]
        return ApplyResult(True)

    def abort(self, deployment: str, version: int) -> None:
        self.staged.pop((deployment, version), None)

    def committed(self, deployment: str) -> CommittedPlan | None:
        a = self.current.get(deployment)
        return None if a is None else CommittedPlan(deployment, a.plan_id, a.version)

    def remove(self, deployment: str) -> ApplyResult:
        self.current.pop(deployment, None)
        return ApplyResult(True)
