"""Loading a user's YAML or JSON document within the limits of :mod:`policies.limits`.

One reader for every document a user or a caller hands over: the CLI's files (fleets, model
configs, loads, plans, deployments), the agent's static fleet file, the controller's token
file and the JSON fields of gRPC messages (``model_config_json``, ``load_json``,
``fleet_json``). In order:

1. size: a file is refused from its size before it is read (:func:`read_limited`);
2. encoding: UTF-8 or refused with the byte offset (:func:`policies.limits.decode_utf8`);
3. nesting: JSON is measured before it is parsed (:func:`policies.limits.json_depth`);
   YAML is built from the parser's event stream by :func:`load_yaml`, which counts depth and
   documents as it goes and refuses aliases (an alias bomb expands a few hundred bytes
   into gigabytes) and tags other than the standard scalar ones;
4. numbers: JSON's ``NaN``/``Infinity`` are refused, and so are YAML integers beyond int64;
   YAML's ``.nan``/``.inf`` (and JSON's ``1e400``) are left to the document's parser, which
   refuses them naming the field (``load[3][7]: must be a finite number``).

Building YAML from events also makes it about ten times faster than ``yaml.safe_load`` (whose
node graph carries two marks per node): a 3.5 MB fleet loads in about 1 s instead of 10.
Every refusal is an :class:`~policies.errors.InputError` naming the document, the line when
there is one, the limit, and the fix.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, BinaryIO, Literal

import yaml
from yaml import events as ev
from yaml.constructor import SafeConstructor
from yaml.nodes import ScalarNode
from yaml.resolver import Resolver

from policies.errors import InputError
from policies.limits import (
    MAX_ABS_INTEGER,
    MAX_DOCUMENT_BYTES,
    MAX_NESTING_DEPTH,
    MAX_YAML_BYTES,
    check_size,
    decode_utf8,
    depth_error,
    json_depth,
    mib,
)

Syntax = Literal["json", "yaml"]
_Parser: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER = Resolver()
_CONSTRUCTOR = SafeConstructor()
_COLLECTION_TAGS = (None, "!", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


def read_limited(path: str | Path, kind: str, what: str) -> bytes:
    """The bytes of a user's file (``-`` = standard input), refused when over the size limit
    of ``kind`` before more than the limit is read.

    Args:
        path: the file.
        kind: a key of :data:`policies.limits.MAX_DOCUMENT_BYTES`.
        what: what the file is, for messages (``fleet``, ``token``...).

    Raises:
        InputError: missing, a directory, unreadable, or over the limit.
    """
    limit = MAX_DOCUMENT_BYTES[kind]
    if str(path) == "-":
        data = _read_at_most(sys.stdin.buffer, limit + 1)
        check_size(len(data), kind, f"{what} on stdin")
        return data
    p = Path(path)
    where = f"{what} file {str(p)!r}"
    try:
        with p.open("rb") as f:
            check_size(os.fstat(f.fileno()).st_size, kind, where)
            data = _read_at_most(f, limit + 1)  # a file that grows meanwhile, or a pipe
    except FileNotFoundError as exc:
        raise InputError(
            f"{where} does not exist. To fix: check the path (relative paths start at "
            f"{str(Path.cwd())!r})"
        ) from exc
    except IsADirectoryError as exc:
        raise InputError(f"{what} path {str(p)!r} is a directory, not a file") from exc
    except PermissionError as exc:
        raise InputError(
            f"cannot read {where}: permission denied. To fix: make it readable (chmod) or "
            "copy it somewhere you can read"
        ) from exc
    except OSError as exc:
        raise InputError(f"cannot read {where}: {exc.strerror or exc}") from exc
    check_size(len(data), kind, where)
    return data


def _read_at_most(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes of ``f``, in 1 MiB reads (``f.read(n)`` would allocate ``n`` bytes
    at once whatever the file's size)."""
    chunks: list[bytes] = []
    left = n
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def load_json(text: str, where: str, *, field: str = "") -> Any:
    """Parse one JSON document within the nesting limit.

    Raises:
        InputError: too deep, a syntax error (with line and column), or NaN/Infinity.
    """
    depth = json_depth(text)
    if depth > MAX_NESTING_DEPTH:
        raise depth_error(where, f"more than {MAX_NESTING_DEPTH}", field=field)
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}. "
            "To fix: correct the syntax there",
            field=field,
        ) from exc
    except RecursionError as exc:  # unbalanced brackets the depth scan could not pair
        raise depth_error(where, "too many", field=field) from exc
    except ValueError as exc:  # NaN / Infinity, or an integer of more than 4,300 digits
        raise InputError(f"{where}: {exc}. To fix: write finite numbers only", field=field) from exc


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def load_yaml(text: str, where: str, *, field: str = "", max_documents: int = 1) -> list[Any]:
    """Parse the YAML documents of ``text`` (empty documents dropped) within the limits.

    Args:
        text: the YAML text.
        where: the document, for messages.
        field: the field to name in errors (a message field); empty for a file.
        max_documents: most documents accepted (1 for every file but ``deploy apply``'s).

    Raises:
        InputError: a syntax error, an alias, an unknown tag, nesting deeper than
            :data:`~policies.limits.MAX_NESTING_DEPTH`, more documents than allowed, an
            integer beyond int64, or a list or mapping as a key; each with its line.
    """
    if len(text) > MAX_YAML_BYTES:
        raise InputError(
            f"{where} is {len(text):,} characters of YAML, over the {mib(MAX_YAML_BYTES)} limit "
            "for YAML. To fix: write it as JSON (a .json file), which is read much faster",
            field=field,
        )
    builder = _Builder(where, field, max_documents)
    try:
        for event in yaml.parse(text, Loader=_Parser):
            builder.feed(event)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "syntax error"
        raise InputError(
            f"{where} is not valid YAML: {problem}{at}. To fix: correct the syntax there "
            "(indentation, a missing ':' or an unclosed bracket)",
            field=field,
        ) from exc
    except yaml.YAMLError as exc:
        raise InputError(f"{where} is not valid YAML: {exc}", field=field) from exc
    return builder.documents


def load_document(text: str, where: str, syntax: Syntax, *, field: str = "") -> Any:
    """One JSON or YAML document (YAML also reads JSON); None for an empty YAML file.

    Raises:
        InputError: as :func:`load_json` / :func:`load_yaml`.
    """
    if syntax == "json":
        return load_json(text, where, field=field)
    docs = load_yaml(text, where, field=field)
    return docs[0] if docs else None


def load_json_field(raw: bytes, kind: str, field: str) -> Any:
    """A JSON document carried in a bytes field of a gRPC message, within the limits.

    Raises:
        InputError: naming ``field``: too large, not UTF-8, too deep, or not JSON.
    """
    check_size(len(raw), kind, "the document", field=field)
    return load_json(decode_utf8(raw, "the document", field=field), "the document", field=field)


class _Builder:
    """Python values from a YAML event stream (see :func:`load_yaml`)."""

    def __init__(self, where: str, field: str, max_documents: int) -> None:
        self.where = where
        self.field = field
        self.max_documents = max_documents
        self.documents: list[Any] = []
        self.started = 0
        # open collections: a list, or a _Frame [dict, pending key or _NO_KEY]
        self.stack: list[Any] = []
        self.cache: dict[tuple[str, Any, Any], Any] = {}

    def fail(self, event: Any, problem: str, fix: str) -> InputError:
        mark = getattr(event, "start_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return InputError(f"{self.where}: {problem}{at}. To fix: {fix}", field=self.field)

    def feed(self, event: Any) -> None:
        kind = type(event)
        if kind is ev.ScalarEvent:
            self.add(self.scalar(event), event)
        elif kind is ev.MappingStartEvent or kind is ev.SequenceStartEvent:
            self.open(event, kind is ev.MappingStartEvent)
        elif kind is ev.SequenceEndEvent:
            self.add(self.stack.pop(), event)
        elif kind is ev.MappingEndEvent:
            self.add(self.stack.pop()[0], event)
        elif kind is ev.AliasEvent:
            raise self.fail(
                event,
                f"alias *{event.anchor} refused (aliases are not accepted in user files)",
                "write the repeated part out in full",
            )
        elif kind is ev.DocumentStartEvent:
            self.started += 1
            if self.started > self.max_documents:
                limit = self.max_documents
                raise self.fail(
                    event,
                    f"more than {limit} YAML document{'s' if limit > 1 else ''} ('---')",
                    f"give at most {limit} per file (split the file)"
                    if limit > 1
                    else "give one document per file (drop the extra '---' sections)",
                )
            self.documents.append(None)
        elif kind is ev.StreamEndEvent:
            self.documents = [d for d in self.documents if d is not None]

    def open(self, event: Any, mapping: bool) -> None:
        if event.tag not in _COLLECTION_TAGS:
            raise self.fail(event, f"tag {event.tag!r} refused", "drop the tag")
        if len(self.stack) >= MAX_NESTING_DEPTH:
            raise depth_error(self.where, f"more than {MAX_NESTING_DEPTH}", field=self.field)
        self.stack.append(_Frame([{}, _NO_KEY]) if mapping else [])

    def add(self, value: Any, event: Any) -> None:
        if not self.stack:
            self.documents[-1] = value
            return
        top = self.stack[-1]
        if type(top) is not _Frame:
            top.append(value)
            return
        if top[1] is _NO_KEY:
            if isinstance(value, dict | list):
                raise self.fail(event, "a list or mapping as a key", "use a string key")
            top[1] = value
        else:
            top[0][top[1]] = value
            top[1] = _NO_KEY

    def scalar(self, event: Any) -> Any:
        key = (event.value, event.implicit, event.tag)
        value = self.cache.get(key, _NO_KEY)
        if value is not _NO_KEY:
            return value
        tag = event.tag
        if tag is None or tag == "!":
            tag = _RESOLVER.resolve(ScalarNode, event.value, event.implicit)  # type: ignore[no-untyped-call]
        build = _CONSTRUCTOR.yaml_constructors.get(tag)
        if build is None or tag.endswith((":merge", ":value")):
            raise self.fail(
                event,
                f"{'a merge key (<<)' if tag.endswith(':merge') else f'tag {tag!r}'} refused",
                "write the mapping out in full, with plain values",
            )
        try:
            value = build(_CONSTRUCTOR, ScalarNode(tag, event.value, style=event.style))
        except (ValueError, yaml.YAMLError) as exc:
            raise self.fail(event, f"bad value {event.value[:40]!r} ({exc})", "correct it") from exc
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ABS_INTEGER:
            raise self.fail(
                event,
                f"integer {event.value[:40]} is beyond 64 bits",
                "give a number in range",
            )
        if len(self.cache) < 4096:
            self.cache[key] = value
        return value


class _Frame(list):  # type: ignore[type-arg]
    """An open mapping: [dict, pending key]."""


_NO_KEY: Any = object()
