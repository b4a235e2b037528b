"""JSON merge patch (RFC 7386) and JSON patch (RFC 6902), as PATCH requests use them."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from support.fakeapi.errors import ApiStatusError
from support.fakeapi.fields import MISSING


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = json_merge_patch(out.get(k), v)
    return out


def _pointer(doc: Any, ptr: str) -> tuple[Any, str]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in ptr.split("/")[1:]]
    cur = doc
    for p in parts[:-1]:
        cur = cur[int(p)] if isinstance(cur, list) else cur[p]
    return cur, parts[-1]


def json_patch(doc: Any, ops: Sequence[Mapping[str, Any]]) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test)."""
    out = copy.deepcopy(doc)
    for op in ops:
        try:
            parent, last = _pointer(out, str(op["path"]))
            kind = op["op"]
            if kind == "test":
                cur = parent[int(last)] if isinstance(parent, list) else parent.get(last, MISSING)
                if cur != op.get("value"):
                    raise ApiStatusError(422, "Invalid", f"test operation failed at {op['path']}")
            elif kind == "remove":
                if isinstance(parent, list):
                    parent.pop(int(last))
                else:
                    del parent[last]
            elif kind in ("add", "replace"):
                if isinstance(parent, list):
                    if last == "-":
                        parent.append(op["value"])
                    elif kind == "add":
                        parent.insert(int(last), op["value"])
                    else:
                        parent[int(last)] = op["value"]
                else:
                    if kind == "replace" and last not in parent:
                        raise ApiStatusError(422, "Invalid", f"replace of missing {op['path']}")
                    parent[last] = op["value"]
            else:
                raise ApiStatusError(400, "BadRequest", f"unsupported JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiStatusError(422, "Invalid", f"JSON patch {op}: {exc}") from exc
    return out
