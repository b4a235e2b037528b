"""The Kubernetes API calls each mixfleet component makes, read from its source, and the RBAC
verbs they need.

:func:`component_calls` walks the syntax trees of a component's modules (and of the
``apis.kube`` helpers they import) for calls of :class:`apis.kube.client.Kube` methods on the
resource constants of :mod:`apis.kube.client` and for :class:`operators.informer.Informer`
constructions (an informer lists and watches). A ``Kube`` method called on something that is
not such a constant is reported too (:attr:`Calls.unresolved`), so that a new kind of call
cannot hide from the RBAC test. :func:`request_need` maps one request recorded by the fake
API server to the same terms, for checking the static reading against what ran.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from apis.kube import client

ROOT = Path(__file__).resolve().parents[2]

#: Resource constants of apis.kube.client by name.
RESOURCES: dict[str, client.Resource] = {
    name: value for name, value in vars(client).items() if isinstance(value, client.Resource)
}
#: Kube method -> the RBAC verbs a call needs (a server-side apply may create the object).
METHOD_VERBS: dict[str, tuple[str, ...]] = {
    "get": ("get",),
    "list": ("list",),
    "watch": ("watch",),
    "create": ("create",),
    "apply": ("patch", "create"),
    "merge_patch": ("patch",),
    "replace": ("update",),
    "delete": ("delete",),
}
#: Where each component's own code lives.
COMPONENT_SOURCES: dict[str, tuple[str, ...]] = {
    "controller": ("controlplane/store/kubernetes", "controlplane/cli/ha.py"),
    "operator": ("operators",),
}
#: ``Kube`` calls on a variable resource that the scan resolves otherwise: the informer's
#: list and watch of the resource it was built for (its ``Informer(...)`` calls).
DYNAMIC_SITES = frozenset({("operators/informer.py", "list"), ("operators/informer.py", "watch")})


@dataclass(frozen=True, order=True)
class Need:
    """One RBAC permission a component needs.

    Attributes:
        group: API group ("" for core).
        resource: plural, with ``/status`` for the subresource.
        verb: RBAC verb.
        namespaced: the resource lives in namespaces.
    """

    group: str
    resource: str
    verb: str
    namespaced: bool


@dataclass
class Calls:
    """What a component's source calls.

    Attributes:
        needs: the permissions, with the call sites (``path:line``) that need each.
        unresolved: ``path:line method`` of Kube calls the scan could not resolve.
    """

    needs: dict[Need, list[str]] = field(default_factory=dict)
    unresolved: list[str] = field(default_factory=list)

    def add(self, res: client.Resource, method: str, sub: str | None, site: str) -> None:
        for verb in METHOD_VERBS[method]:
            if sub and verb == "create":
                continue  # an apply to /status never creates
            name = f"{res.plural}/{sub}" if sub else res.plural
            need = Need(res.group, name, verb, res.namespaced)
            self.needs.setdefault(need, []).append(site)


def _files(paths: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        full = ROOT / p
        out += sorted(full.rglob("*.py")) if full.is_dir() else [full]
    return out


def _kube_helpers(trees: Iterable[ast.AST]) -> set[str]:
    """``apis/kube/*.py`` modules (other than the client) that the trees import."""
    out: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("apis.kube."):
                mod = node.module or ""
                if mod != "apis.kube.client":
                    out.add(mod.replace(".", "/") + ".py")
    return out


def _scan(tree: ast.AST, rel: str, calls: Calls) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        site = f"{rel}:{node.lineno}"
        if isinstance(f, ast.Name) and f.id == "Informer" and len(node.args) >= 2:
            arg = node.args[1]
            if isinstance(arg, ast.Name) and arg.id in RESOURCES:
                for method in ("list", "watch"):
                    calls.add(RESOURCES[arg.id], method, None, site)
            continue
        if not isinstance(f, ast.Attribute) or f.attr not in METHOD_VERBS or not node.args:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Name) and arg.id in RESOURCES:
            sub = next(
                (
                    str(kw.value.value)
                    for kw in node.keywords
                    if kw.arg == "subresource" and isinstance(kw.value, ast.Constant)
                ),
                None,
            )
            calls.add(RESOURCES[arg.id], f.attr, sub, site)
        elif (rel, f.attr) not in DYNAMIC_SITES and _looks_like_kube(f.value):
            calls.unresolved.append(f"{site} {f.attr}")


def _looks_like_kube(receiver: ast.expr) -> bool:
    """A receiver named like a Kube client (``kube``, ``self.kube``, ``self._kube``...)."""
    name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
    return "kube" in str(name) or str(name) in ("_pointer", "lk", "admin")


def component_calls(component: str) -> Calls:
    """The API calls of ``controller`` (its Kubernetes store and leader election) or
    ``operator``, from their source."""
    files = _files(COMPONENT_SOURCES[component])
    trees = {f: ast.parse(f.read_text()) for f in files}
    for helper in sorted(_kube_helpers(trees.values())):
        path = ROOT / helper
        if path not in trees and path.exists():
            trees[path] = ast.parse(path.read_text())
    calls = Calls()
    for path, tree in sorted(trees.items()):
        _scan(tree, path.relative_to(ROOT).as_posix(), calls)
    return calls


def request_need(method: str, path: str, query: dict[str, str]) -> Need | None:
    """The permission one HTTP request needs (None for a path that names no resource)."""
    parts = [p for p in path.strip("/").split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespaced = len(rest) >= 2 and rest[0] == "namespaces"
    if namespaced:
        rest = rest[2:]
    if not rest:
        return None
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {
        "GET": ("watch" if query.get("watch") in ("true", "1") else "list") if not named else "get",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if named else "deletecollection",
    }[method]
    known = {(r.group, r.plural): r.namespaced for r in RESOURCES.values()}
    return Need(group, resource, verb, known.get((group, rest[0]), namespaced))
