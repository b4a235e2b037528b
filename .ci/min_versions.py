"""The lowest dependency versions pyproject.toml allows, as pip constraints, and an import check.

``python .ci/min_versions.py constraints`` prints one ``name==floor`` line for every
``name>=floor`` requirement of ``[project].dependencies`` and of the extras named after it
(``dev`` by default), so ``pip install -c`` of that output installs exactly the declared floors.

``python .ci/min_versions.py check CONSTRAINTS FREEZE`` fails when ``pip freeze`` shows a
constrained package at another version than its floor.

``python .ci/min_versions.py imports`` imports every module of the installed packages (the code
behind the ``mixfleetctl``, ``mixfleet-agent`` and ``mixfleet-operator`` console scripts
included); a module that needs only an optional extra (torch, cupy, amdsmi) may be missing it.
Used by ``.ci/min_versions.sh``.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("policies", "apis", "controlplane", "agents", "operators")
OPTIONAL = frozenset({"torch", "cupy", "amdsmi"})
_FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)")


def constraints(extras: list[str]) -> list[str]:
    """``name==floor`` for every ``name>=floor`` requirement of the project and ``extras``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    out = []
    for req in reqs:
        match = _FLOOR.match(req)
        if match:
            out.append(f"{match.group(1)}=={match.group(2)}")
    return out


def import_all() -> int:
    """Import every module of :data:`PACKAGES`; print and count the failures."""
    failures = 0
    count = 0
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            if info.name.endswith(".__main__"):  # importing it runs the command
                continue
            try:
                importlib.import_module(info.name)
                count += 1
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.split(".")[0] in OPTIONAL:
                    print(f"skip {info.name}: needs optional {exc.name}")
                    continue
                failures += 1
                print(f"FAIL {info.name}: {type(exc).__name__}: {exc}")
            except Exception as exc:  # any import-time error is what this check is for
                failures += 1
                print(f"FAIL {info.name}: {type(exc).__name__}: {exc}")
    print(f"imported {count} modules, {failures} failed")
    return 1 if failures else 0


def _release(version: str) -> tuple[int, ...]:
    """``8`` -> ``(8,)``, ``8.0.0`` -> ``(8,)``: release numbers without trailing zeros."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def check(constraints_file: str, freeze_file: str) -> int:
    """Fail when a constrained package is installed at another version than its floor."""

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    frozen = {}
    for line in Path(freeze_file).read_text().splitlines():
        name, _, version = line.partition("==")
        if version:
            frozen[norm(name)] = version.strip()
    bad = []
    for line in Path(constraints_file).read_text().splitlines():
        name, _, floor = line.partition("==")
        got = frozen.get(norm(name))
        if got is not None and _release(got) != _release(floor):
            bad.append(f"{name} {got} (floor {floor})")
    if bad:
        print(f"not installed at the declared floor: {', '.join(bad)}")
        return 1
    print(f"{len(frozen)} packages installed; every declared floor installed exactly")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["constraints"]:
        print("\n".join(constraints(argv[1:] or ["dev"])))
        return 0
    if argv[:1] == ["imports"]:
        return import_all()
    if argv[:1] == ["check"] and len(argv) == 3:
        return check(argv[1], argv[2])
    print(
        "usage: min_versions.py constraints [EXTRA...] | imports | check CONSTRAINTS FREEZE",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
