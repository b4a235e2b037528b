"""Every shell block of README.md and docs/**/*.md runs, unless it is marked as one that cannot.

A block fenced ```` ```bash ````, ```` ```sh ````, ```` ```shell ```` or ```` ```console ````
is a shell block. Each one runs under ``bash -euo pipefail`` in its own temporary directory
that holds a copy of the repository's files (so relative paths such as
``examples/fleets/mixed-24.yaml`` work and nothing it writes reaches the checkout) and a link
to the checkout's ``.venv``, whose ``bin`` comes first on PATH (so both ``mixfleetctl`` and
``.venv/bin/mixfleetctl`` work). In a ``console`` block with ``$ `` prompts only the prompted
lines (and their ``\\`` continuations) run; the rest is output.

A block that needs a GPU, a cluster, a running server, a second terminal, or more than about
a minute is marked on the line right above its fence::

    <!-- doc-test: skip (needs a Kubernetes cluster) -->

The reason is required. Blocks that install (``pip install``, ``make``) must be marked too:
they would change the checkout's ``.venv``. The rule is documented for writers in
docs/architecture.md, section "Contributing: shell blocks in the docs".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
BLOCK_TIMEOUT_S = 600.0
"""A block still running after this many seconds has hung: a hang guard, not a speed limit
(the "about a minute" rule above is for writers; a busy machine may take several times
longer, and no test asserts how long a block takes)."""
WORKERS = 2
_FENCE = re.compile(r"^\s*(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"<!--\s*doc-test:(?P<body>.*?)-->", re.DOTALL)
_SKIP = re.compile(r"^\s*skip\s*\((?P<reason>.*\S.*)\)\s*$")
_SHORTEN = re.compile(r"^\s*shorten\s*\((?P<old>.+?)\s+->\s+(?P<new>.+)\)\s*$")
_INSTALLS = re.compile(r"(^|[\s;&|(])(pip3?\s+install|make)(\s|$)", re.MULTILINE)
HOW_TO_MARK = (
    "If it cannot run here (GPU, cluster, running server, second terminal, more than a "
    "minute, or it installs), put this line right above its opening fence:\n"
    "    <!-- doc-test: skip (why it cannot run here) -->\n"
    "(rule: docs/architecture.md, section 'Contributing: shell blocks in the docs')"
)


@dataclass(frozen=True)
class Block:
    """One fenced block.

    Attributes:
        path: the markdown file.
        line: 1-based line of the opening fence.
        lang: the fence's info word (``bash``, ``console``...; "" when none).
        text: the block's content.
        skip: the skip reason when marked, else None.
        marker_error: what is wrong with a ``doc-test`` comment right above it, else None.
        shorten: ``(old, new)``: the test runs the block with ``old`` replaced by ``new``.
    """

    path: Path
    line: int
    lang: str
    text: str
    skip: str | None
    marker_error: str | None
    shorten: tuple[str, str] | None = None

    @property
    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


Marker = tuple[str | None, str | None, tuple[str, str] | None]


def _marker(lines: list[str], fence_index: int) -> Marker:
    """``(skip reason, marker error, shorten)`` from the nearest non-blank line above the
    fence."""
    k = fence_index - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0:
        return None, None, None
    m = _MARKER.search(lines[k])
    if m is None:
        return None, None, None
    skip = _SKIP.match(m.group("body"))
    if skip is not None:
        return skip.group("reason").strip(), None, None
    short = _SHORTEN.match(m.group("body"))
    if short is not None:
        return None, None, (short.group("old"), short.group("new"))
    error = (
        f"doc-test comment {lines[k].strip()!r} is neither 'skip (REASON)' nor "
        "'shorten (OLD -> NEW)'"
    )
    return None, error, None


def extract(path: Path, text: str) -> list[Block]:
    """Every fenced block of ``text`` (markdown read from ``path``)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence = m.group("fence")
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        skip, error, shorten = _marker(lines, i)
        body = "\n".join(lines[i + 1 : end])
        blocks.append(Block(path, i + 1, m.group("lang").lower(), body, skip, error, shorten))
        i = end + 1
    return blocks


def script_of(block: Block) -> str:
    """The commands of a shell block (``console``: the ``$ `` lines when there are any), with
    its ``shorten`` replacement made."""
    text = block.text
    if block.shorten is not None:
        text = text.replace(*block.shorten)
    lines = text.splitlines()
    if block.lang != "console" or not any(ln.lstrip().startswith("$ ") for ln in lines):
        return text
    out: list[str] = []
    continued = False
    for ln in lines:
        stripped = ln.lstrip()
        if stripped.startswith("$ "):
            out.append(stripped[2:])
        elif continued:
            out.append(ln)
        else:
            continue
        continued = ln.rstrip().endswith("\\")
    return "\n".join(out)


def doc_files() -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def shell_blocks() -> list[Block]:
    return [
        b for p in doc_files() for b in extract(p, p.read_text(encoding="utf-8"))
        if b.lang in SHELL_LANGS
    ]  # fmt: skip


def _copy_ignore(directory: str, names: list[str]) -> set[str]:
    skipped = {".git", ".venv", "build", ".conformance", "__pycache__", ".mypy_cache"}
    skipped |= {".pytest_cache", ".ruff_cache", ".hypothesis", ".import_linter_cache", "out"}
    return {n for n in names if n in skipped or n.endswith(".egg-info")}


def make_workspace(repo_copy: Path, where: Path) -> Path:
    """A directory with links to every entry of ``repo_copy`` and to the checkout's .venv."""
    where.mkdir(parents=True)
    for entry in repo_copy.iterdir():
        (where / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (where / ".venv").symlink_to(ROOT / ".venv", target_is_directory=True)
    (where / "home").mkdir()
    return where


@dataclass(frozen=True)
class Outcome:
    block: Block
    returncode: int | None  # None: timed out
    output: str
    seconds: float

    def message(self) -> str:
        what = (
            f"hung (still running after {BLOCK_TIMEOUT_S:.0f} s)"
            if self.returncode is None
            else f"failed (exit {self.returncode})"
        )
        tail = "\n".join(self.output.splitlines()[-40:])
        return (
            f"{self.block.where}: ```{self.block.lang} block {what} after {self.seconds:.0f} s\n"
            f"--- the block ---\n{script_of(self.block)}\n--- its output (last 40 lines) ---\n"
            f"{tail}\n--- To fix: correct the doc or the code so that it runs. {HOW_TO_MARK}"
        )


def run_block(block: Block, workspace: Path, timeout_s: float = BLOCK_TIMEOUT_S) -> Outcome:
    """Run one block in ``workspace`` (see :func:`make_workspace`)."""
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(ROOT / ".venv")
    env["HOME"] = str(workspace / "home")
    env["MPLBACKEND"] = "Agg"
    env.pop("PYTHONPATH", None)
    started = time.monotonic()
    try:
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script_of(block)],
            cwd=workspace,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"")
        text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        return Outcome(block, None, text, time.monotonic() - started)
    return Outcome(block, run.returncode, run.stdout + run.stderr, time.monotonic() - started)


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The repository's files (no .git, .venv, caches), copied once for every block."""
    where = tmp_path_factory.mktemp("doc-blocks") / "repo"
    shutil.copytree(ROOT, where, ignore=_copy_ignore, symlinks=True)
    yield where


# ---------------------------------------------------------------- the extractor itself


SAMPLE = """\
Intro.

<!-- doc-test: skip (needs a GPU host) -->
```bash
nvidia-smi
```

```console
$ mixfleetctl --version
mixfleetctl 0.1.0
$ echo a \\
    b
a b
```

<!-- doc-test: maybe later -->
```sh
true
```

<!-- doc-test: shorten (--time-limit 30 -> --time-limit 5) -->
```bash
mixfleetctl plan solve --time-limit 30
```

```yaml
not: shell
```
"""


def test_extractor_reads_fences_markers_and_prompts() -> None:
    blocks = extract(Path("sample.md"), SAMPLE)
    assert [(b.line, b.lang) for b in blocks] == [
        (4, "bash"),
        (8, "console"),
        (17, "sh"),
        (22, "bash"),
        (26, "yaml"),
    ]
    assert blocks[0].skip == "needs a GPU host" and blocks[0].marker_error is None
    assert blocks[1].skip is None
    assert script_of(blocks[1]) == "mixfleetctl --version\necho a \\\n    b"
    assert blocks[2].skip is None and "neither 'skip (REASON)'" in (blocks[2].marker_error or "")
    assert script_of(blocks[3]) == "mixfleetctl plan solve --time-limit 5"


def test_a_failing_block_names_its_file_line_and_how_to_mark_it(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    block = extract(
        ROOT / "docs" / "example.md", "text\n\n```bash\necho hi\nfalse\necho unreached\n```\n"
    )[0]
    outcome = run_block(block, make_workspace(tmp_path / "repo", tmp_path / "ws"))
    assert outcome.returncode == 1
    message = outcome.message()
    assert message.startswith("docs/example.md:3: ```bash block failed (exit 1)")
    assert "hi" in message and "unreached" not in outcome.output
    assert "<!-- doc-test: skip (why it cannot run here) -->" in message


# ---------------------------------------------------------------- the docs


def test_markers_are_well_formed_and_sit_on_shell_blocks() -> None:
    problems = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        blocks = extract(path, text)
        inside = {n for b in blocks for n in range(b.line, b.line + b.text.count("\n") + 2)}
        marked = {b.line for b in blocks if b.skip or b.shorten or b.marker_error}
        for b in blocks:
            if b.marker_error:
                problems.append(f"{b.where}: {b.marker_error}")
            elif (b.skip or b.shorten) and b.lang not in SHELL_LANGS:
                problems.append(f"{b.where}: a doc-test marker on a ```{b.lang} block (never run)")
        for n, line in enumerate(text.splitlines(), 1):
            if n in inside or not line.lstrip().startswith("<!--") or "doc-test:" not in line:
                continue
            if not any(0 < m - n <= 3 for m in marked):
                problems.append(f"{_rel(path)}:{n}: doc-test comment not right above a fence")
    assert not problems, "\n".join(problems)


def test_blocks_that_install_are_marked() -> None:
    bad = [b.where for b in shell_blocks() if b.skip is None and _INSTALLS.search(script_of(b))]
    assert not bad, (
        f"these blocks run pip install or make, which would change the checkout's .venv: "
        f"{bad}. {HOW_TO_MARK}"
    )


@pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "mixfleetctl").exists(), reason="needs make install"
)
@pytest.mark.timeout(3 * BLOCK_TIMEOUT_S)
@pytest.mark.slow  # every CLI block in its own processes: make test-all (CI), not make test
def test_every_unmarked_shell_block_runs(repo_copy: Path) -> None:
    runnable = [
        b for b in shell_blocks()
        if b.skip is None and b.marker_error is None and not _INSTALLS.search(script_of(b))
    ]  # fmt: skip
    assert runnable, "no runnable shell block found: the extractor is broken"
    spaces = [
        make_workspace(repo_copy, repo_copy.parent / f"block-{k}") for k in range(len(runnable))
    ]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        outcomes = list(pool.map(run_block, runnable, spaces))
    failed = [o.message() for o in outcomes if o.returncode != 0]
    assert not failed, (
        f"{len(failed)} of {len(runnable)} doc shell blocks failed:\n\n" + "\n\n".join(failed)
    )
