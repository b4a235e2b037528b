"""Plan applier: hands this node's part of a plan to the local runtime, crash-safely.

The agent stages a plan version (``prepare``) and later commits it (``commit``) through an
:class:`Applier`; :class:`PlanApplier` writes plan files, per-GPU env files and expert
slots under ``plan_dir`` and switches them in with one atomic rename, :class:`MemoryApplier`
keeps them in memory.

Modules: :mod:`agents.applier.assignment` (what a node is asked to run, read and checked),
:mod:`agents.applier.protocol` (the applier interface, its results, the in-memory one),
:mod:`agents.applier.disk` (the on-disk layout and its two phases),
:mod:`agents.applier.files` (fsync, atomic write, atomic symlink),
:mod:`agents.applier.env` (engine env files), :mod:`agents.applier.hooks` (the hook).
"""

from agents.applier.assignment import (
    MAX_EXPERT_LOCATION_BYTES,
    NodeAssignment,
    assignment_from_dict,
    assignment_from_json,
    assignment_from_plan,
    check_assignment,
    check_expert_location,
    gpu_index,
    inflate_expert_location,
)
from agents.applier.disk import (
    ApplierSettings,
    PlanApplier,
)
from agents.applier.env import (
    gpu_env,
    parse_env,
    render_env,
)
from agents.applier.files import (
    atomic_symlink,
    atomic_write,
    fsync_dir,
    write_file,
)
from agents.applier.hooks import (
    HOOK_PHASES,
    HookResult,
    run_hook,
)
from agents.applier.protocol import (
    Applier,
    ApplyResult,
    CommittedPlan,
    MemoryApplier,
)

__all__ = [
    "HOOK_PHASES",
    "MAX_EXPERT_LOCATION_BYTES",
    "Applier",
    "ApplierSettings",
    "ApplyResult",
    "CommittedPlan",
    "HookResult",
    "MemoryApplier",
    "NodeAssignment",
    "PlanApplier",
    "assignment_from_dict",
    "assignment_from_json",
    "assignment_from_plan",
    "atomic_symlink",
    "atomic_write",
    "check_assignment",
    "check_expert_location",
    "fsync_dir",
    "gpu_env",
    "gpu_index",
    "inflate_expert_location",
    "parse_env",
    "render_env",
    "run_hook",
    "write_file",
]
