"""Label selectors (equality, set-based, existence) and the ``metadata.name`` /
``metadata.namespace`` field selectors of list and watch requests."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from support.fakeapi.errors import ApiStatusError, Json


def _requirement(text: str) -> Callable[[Mapping[str, str]], bool]:
    t = text.strip()
    m = re.match(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$", t)
    if m:
        key, op = m.group(1), m.group(2)
        values = {v.strip() for v in m.group(3).split(",") if v.strip()}

        def set_based(labels: Mapping[str, str]) -> bool:
            return (labels.get(key) in values) == (op == "in")

        return set_based
    m = re.match(r"^([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)$", t)
    if m:
        key, op, value = m.groups()

        def equality(labels: Mapping[str, str]) -> bool:
            return (labels.get(key) == value) == (op != "!=")

        return equality
    m = re.match(r"^(!?)([\w./-]+)$", t)
    if m:
        neg, key = m.groups()

        def existence(labels: Mapping[str, str]) -> bool:
            return (key in labels) != bool(neg)

        return existence
    raise ApiStatusError(400, "BadRequest", f"unable to parse requirement: {t!r}")


def parse_selector(text: str) -> Callable[[Mapping[str, str]], bool]:
    """A label selector (``a=b,c!=d,e in (x,y),f notin (z),g,!h``) as a predicate.

    Raises:
        ApiStatusError: 400 for a malformed selector.
    """
    parts = re.split(r",(?![^()]*\))", text.strip()) if text.strip() else []
    terms = [_requirement(t) for t in parts]

    def selector(labels: Mapping[str, str]) -> bool:
        return all(term(labels) for term in terms)

    return selector


def field_match(obj: Json, selector: str) -> bool:
    """Whether an object matches a field selector (``metadata.name=x,metadata.namespace!=y``)."""
    for term in [t for t in selector.split(",") if t]:
        key, _, value = term.partition("=")
        value = value.lstrip("=")
        neg = key.endswith("!")
        key = key.rstrip("!")
        actual = {
            "metadata.name": obj["metadata"].get("name"),
            "metadata.namespace": obj["metadata"].get("namespace", ""),
        }.get(key)
        if (actual == value) == neg:
            return False
    return True
