"""Unknown keys are refused: the one check every reader of a user's document calls.

A misspelt key (``nic:`` for ``nics:``, ``tokensPerGpux``, ``sustainSec``) would otherwise
be dropped and its default used in silence. Every mapping of every file and custom resource
mixfleet reads - Fleet, ModelDeployment, node inventory, model, solver policy, client and
controller configuration, calibration - goes through :func:`check_keys`, at every level, so
the error names the full path of the key (``spec.nodes[2].nic``) and the closest known key.

Pure: no I/O.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Any

from policies.errors import InputError
from policies.limits import key_path


def closest_key(key: object, known: Collection[str]) -> str | None:
    """The known key ``key`` was most likely meant to be, or None when none is close.

    A key that differs only in case or ``-``/``_`` wins first, then the one known key that
    begins with the key or that the key extends by at most two characters (``a2a`` ->
    ``a2aBackend``, ``tokensPerGpux`` -> ``tokensPerGpu``), then the closest by
    :func:`difflib.get_close_matches` (ratio at least 0.6).
    """
    text = str(key)
    names = sorted(known)
    folded = {_fold(k): k for k in names}
    wanted = _fold(text)
    if wanted in folded:
        return folded[wanted]
    prefixed = [
        k
        for f, k in folded.items()
        if min(len(f), len(wanted)) >= 3
        and (f.startswith(wanted) or (wanted.startswith(f) and len(wanted) - len(f) <= 2))
    ]
    if len(prefixed) == 1:  # a2a -> a2aBackend, tokensPerGpux -> tokensPerGpu
        return prefixed[0]
    close = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
    if close:
        return close[0]
    close = difflib.get_close_matches(wanted, list(folded), n=1, cutoff=0.6)
    return folded[close[0]] if close else None


def _fold(text: str) -> str:
    return text.casefold().replace("-", "").replace("_", "")


def unknown_key_error(
    key: object, known: Collection[str], path: str, *, what: str = "field"
) -> InputError:
    """The error for ``key`` under ``path``: its full path, the closest known key, the fix.

    Args:
        key: the unknown key.
        known: the keys accepted at this level.
        path: field path of the mapping that holds ``key`` (empty for a document's top).
        what: what the keys are, for the message (``field``, ``GPU field``...).
    """
    near = closest_key(key, known)
    hint = f"; did you mean {near!r}?" if near is not None else "."
    fix = f"rename it to {near!r}" if near is not None else "remove it or correct its spelling"
    listed = ", ".join(sorted(known))
    return InputError(
        f"unknown {what} {str(key)!r}{hint} To fix: {fix} (known here: {listed})",
        field=key_path(path, key),
    )


def check_keys(
    doc: Mapping[Any, Any], known: Collection[str], path: str, *, what: str = "field"
) -> None:
    """Refuse the first key of ``doc`` that is not in ``known`` (in the document's order).

    Args:
        doc: one mapping of the document.
        known: the keys accepted at this level.
        path: field path of ``doc`` (``spec.nodes[2]``); empty for the document's top.
        what: what the keys are, for the message.

    Raises:
        InputError: naming the full path of the key and the closest known key.
    """
    for key in doc:
        if key not in known:
            raise unknown_key_error(key, known, path, what=what)


def renamed_keys(
    doc: Mapping[str, Any], legacy: Mapping[str, str], path: str, warnings: list[str]
) -> Mapping[str, Any]:
    """``doc`` with deprecated keys read as their new names, one message per renamed key
    appended to ``warnings`` (run before :func:`check_keys`, which then sees new names only).

    Args:
        doc: one mapping of the document.
        legacy: old key -> new key.
        path: field path of ``doc``, for the messages.
        warnings: deprecation messages are appended here, for the caller to show.

    Raises:
        InputError: a key is given under both its old and its new name.
    """
    if not any(k in doc for k in legacy):
        return doc
    out = dict(doc)
    for old, new in legacy.items():
        if old not in out:
            continue
        if new in out:
            raise InputError(
                f"gives both {old!r} (deprecated) and {new!r}. To fix: keep only {new!r}",
                field=key_path(path, old),
            )
        unit = ""
        if new.endswith(("_gbits_per_s", "_gbytes_per_s")):
            unit = f" ({'gigabits' if new.endswith('_gbits_per_s') else 'gigabytes'} per second)"
        warnings.append(
            f"{key_path(path, old)}: deprecated key, read as {new!r}{unit}. "
            f"To fix: rename it to {new!r}"
        )
        out[new] = out.pop(old)
    return out
