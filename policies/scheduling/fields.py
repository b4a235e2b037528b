"""The deployment spec's scheduling fields in documents: ``priority``, ``minGpus``,
``maxGpus``, ``objective``, ``sloStepTimeMs``, ``memoryFraction``, ``namespace``.

:mod:`policies.spec.build` reads, checks and writes them through these functions (kept here so
the scheduler's inputs are defined next to the scheduler). Imports nothing of
:mod:`policies.spec.build`.

Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from policies.errors import InputError
from policies.limits import MAX_WIRE_INT32, bounded_int
from policies.scheduling.types import OBJECTIVES

#: Document key -> DeploymentSpec attribute.
KEYS = {
    "priority": "priority",
    "minGpus": "min_gpus",
    "maxGpus": "max_gpus",
    "objective": "objective",
    "sloStepTimeMs": "slo_step_time_ms",
    "memoryFraction": "memory_fraction",
    "namespace": "namespace",
}
_DEFAULTS: dict[str, Any] = {
    "priority": 0,
    "min_gpus": 0,
    "max_gpus": 0,
    "objective": "throughput",
    "slo_step_time_ms": 0.0,
    "memory_fraction": 1.0,
    "namespace": "default",
}
_NS_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
MAX_PRIORITY = 1_000_000
"""Largest ``priority`` accepted (either sign)."""


def fields_from_doc(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The scheduling fields of a ``spec`` mapping as DeploymentSpec keyword arguments
    (absent keys take the defaults; checked by :func:`check_fields`)."""
    out = dict(_DEFAULTS)
    for key, attr in KEYS.items():
        if spec.get(key) is not None:
            out[attr] = spec[key]
    return out


def fields_to_doc(spec: Any) -> dict[str, Any]:
    """The scheduling fields of a DeploymentSpec away from their defaults, as document keys."""
    return {
        key: getattr(spec, attr)
        for key, attr in KEYS.items()
        if getattr(spec, attr) != _DEFAULTS[attr]
    }


def check_fields(spec: Any, path: str = "spec") -> None:
    """Validate the scheduling fields of a DeploymentSpec.

    Raises:
        InputError: naming the field and how to fix it.
    """
    bounded_int(spec.priority, f"{path}.priority", minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY)
    lo = bounded_int(spec.min_gpus, f"{path}.minGpus", minimum=0, maximum=MAX_WIRE_INT32)
    hi = bounded_int(spec.max_gpus, f"{path}.maxGpus", minimum=0, maximum=MAX_WIRE_INT32)
    if hi and lo > hi:
        raise InputError(
            f"minGpus {lo} is above maxGpus {hi}. To fix: lower minGpus or raise maxGpus "
            "(0 = no limit)",
            field=f"{path}.minGpus",
        )
    if spec.objective not in OBJECTIVES:
        raise InputError(
            f"must be one of {', '.join(OBJECTIVES)}, got {spec.objective!r}",
            field=f"{path}.objective",
        )
    slo = spec.slo_step_time_ms
    if (
        isinstance(slo, bool)
        or not isinstance(slo, int | float)
        or not math.isfinite(slo)
        or slo < 0
    ):
        raise InputError(f"must be a number >= 0 (ms), got {slo!r}", field=f"{path}.sloStepTimeMs")
    if spec.objective == "slo" and not slo:
        raise InputError(
            "objective slo needs a step-time target. To fix: set sloStepTimeMs (e.g. 50)",
            field=f"{path}.sloStepTimeMs",
        )
    f = spec.memory_fraction
    if isinstance(f, bool) or not isinstance(f, int | float) or not (0.0 < f <= 1.0):
        raise InputError(
            f"must be a number in (0, 1], got {f!r}. To fix: 1 keeps GPUs exclusive; 0.5 "
            "shares each GPU with others that declare a fraction",
            field=f"{path}.memoryFraction",
        )
    check_namespace(spec.namespace, f"{path}.namespace")


def check_namespace(namespace: Any, field: str) -> str:
    """``namespace`` when it is a valid quota namespace (a Kubernetes namespace name).

    Raises:
        InputError: naming ``field``.
    """
    if not isinstance(namespace, str) or not _NS_RE.match(namespace):
        raise InputError(
            f"{namespace!r} is not a valid namespace. To fix: use lower-case letters, "
            "digits and '-', at most 63 characters",
            field=field,
        )
    return namespace


_QUOTA_RE = re.compile(r"^([^=]*)=([0-9]+)$")


def parse_quotas(items: Sequence[str], flag: str) -> dict[str, int]:
    """``NAMESPACE=GPUS`` command-line items (``flag``, repeatable) as namespace -> most GPUs
    its deployments may hold together. Each namespace must be one a spec can name
    (:func:`check_namespace`) and appear once.

    Raises:
        InputError: naming ``flag`` and the item.
    """
    out: dict[str, int] = {}
    for item in items:
        m = _QUOTA_RE.match(item)
        if m is None or not m.group(1):
            raise InputError(
                f"{item!r} is not NAMESPACE=GPUS. To fix: write e.g. {flag} team-a=16", field=flag
            )
        ns, gpus = m.group(1), m.group(2)
        if not _NS_RE.match(ns):
            raise InputError(
                f"{ns!r} (in {item!r}) is not a valid namespace, so no deployment could be in "
                "it. To fix: use lower-case letters, digits and '-', at most 63 characters",
                field=flag,
            )
        if ns in out:
            raise InputError(f"namespace {ns!r} is given twice. To fix: keep one", field=flag)
        out[ns] = bounded_int(int(gpus), flag, minimum=0, maximum=MAX_WIRE_INT32)
    return out
