"""Runnable examples in the docs: every ```python runnable``` block of README.md and docs/*.md runs.

Each block runs in a fresh Python process (warnings as errors), in an empty temporary
directory, with ``GRADBUS_BROKER`` set to the URL of a fresh in-process cluster (a broker and 2
shards) and no other ``GRADBUS_*`` variable, so ``gradbus.connect()`` finds that cluster.
Other fenced blocks are not run. Blocks run a few at a time; each test reports one block.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import gradbus
from gradbus.cluster import in_process

from .conftest import wait_for

ROOT = pathlib.Path(__file__).resolve().parent.parent
SDK = ROOT / "docs" / "sdk.md"
README = ROOT / "README.md"
BLOCK_TIMEOUT = 90.0          # seconds per block
WORKERS = min(4, (os.cpu_count() or 1) + 1)   # blocks run at once
#: modules from optional extras: a block importing one that is not installed is skipped
OPTIONAL = {"torch", "sklearn", "cupy", "numba"}
#: what makes a block slow (its own cluster, torch): those are started first
HEAVY = ("LocalCluster", "in_process", "torch")
WARNINGS = ["-W", "error",
            "-W", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"]

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")
_IMPORT = re.compile(r"^\s*(?:import\s+([\w.]+(?:\s*,\s*[\w.]+)*)|from\s+([\w.]+)\s+import)", re.M)


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(line of the opening fence, info string, code)`` of every fenced code block
    (CommonMark: backtick or tilde fences, closed by a fence of the same character at least as
    long; a block left open runs to the end)."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or (m.group(2)[0] == "`" and "`" in m.group(3)):
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        start, body = i + 1, []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (close and close.group(2)[0] == fence[0] and len(close.group(2)) >= len(fence)
                    and not close.group(3).strip()):
                break
            line = lines[i]
            strip = len(line) - len(line.lstrip(" "))
            body.append(line[min(indent, strip):])
            i += 1
        out.append((start, info, "\n".join(body) + "\n"))
        i += 1
    return out


def is_runnable(info: str) -> bool:
    words = info.split()
    return len(words) >= 2 and words[0] == "python" and "runnable" in words[1:]


def runnable_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    return [(line, code) for line, info, code in fenced_blocks(path.read_text(encoding="utf-8"))
            if is_runnable(info)]


def _doc_files() -> list[pathlib.Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _collect():
    params = []
    for path in _doc_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, code in runnable_blocks(path):
            params.append(pytest.param(rel, line, code, id=f"{rel}:{line}"))
    return params


def _missing_optional(code: str) -> list[str]:
    mods = set()
    for m in _IMPORT.finditer(code):
        names = m.group(1).split(",") if m.group(1) else [m.group(2)]
        for name in names:
            mods.add(name.strip().split(".")[0])
    return sorted(m for m in mods & OPTIONAL if importlib.util.find_spec(m) is None)


@pytest.fixture
def no_leaked_threads():
    """Blocks run on a pool while other tests of this module wait (see ``block_runs``), so the
    per-test thread check of conftest.py would see their clusters' threads: ``block_runs``
    checks once, after the pool is done."""
    yield


@pytest.fixture(scope="module")
def block_runs(request):
    """Starts every block this session selected on a pool of ``WORKERS`` threads (a block spends
    most of its time waiting on its cluster or on imports); ``{(doc, line): Future}``."""
    before = _gradbus_threads()
    wanted = [item.callspec.params for item in request.session.items
              if getattr(item, "originalname", None) == "test_runnable_block"
              and item.module is sys.modules[__name__]]
    wanted.sort(key=lambda p: not any(w in p["code"] for w in HEAVY))   # long ones first
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="docs-block")
    runs = {(p["doc"], p["line"]): pool.submit(_run_block, p["code"]) for p in wanted}
    yield runs
    for fut in runs.values():
        fut.cancel()
    pool.shutdown(wait=True)
    wait_for(lambda: not (_gradbus_threads() - before), 10.0, "the clusters' threads to end")


def _gradbus_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("gradbus-")}


def _run_block(code: str) -> tuple[str, str]:
    """``(outcome, output)``: outcome is "ok", "skip", "timeout" or "exit N"."""
    missing = _missing_optional(code)
    if missing:
        return "skip", f"needs {', '.join(missing)}"
    with tempfile.TemporaryDirectory(prefix="gradbus-docs-") as tmp, in_process(2) as cluster:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADBUS_")}
        env["GRADBUS_BROKER"] = cluster.url
        script = pathlib.Path(tmp) / "example.py"
        script.write_text(code, encoding="utf-8")
        try:
            r = subprocess.run([sys.executable, *WARNINGS, str(script)], cwd=tmp, env=env,
                               capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired as e:
            return "timeout", _text(e.stdout) + _text(e.stderr)
    out = f"--- stdout ---\n{r.stdout}--- stderr ---\n{r.stderr}"
    return ("ok" if r.returncode == 0 else f"exit {r.returncode}"), out


@pytest.mark.parametrize("doc,line,code", _collect())
def test_runnable_block(doc, line, code, block_runs):
    outcome, output = block_runs[(doc, line)].result()
    if outcome == "skip":
        pytest.skip(output)
    if outcome == "timeout":
        pytest.fail(f"{doc}:{line}: still running after {BLOCK_TIMEOUT:.0f}s\n{_show(code)}\n"
                    f"--- output ---\n{output}", pytrace=False)
    if outcome != "ok":
        pytest.fail(f"{doc}:{line}: {outcome.replace('exit', 'exited with')}\n{_show(code)}\n"
                    f"{output}", pytrace=False)


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _show(code: str) -> str:
    return "--- block ---\n" + "\n".join(f"{n:3d}  {s}" for n, s in
                                         enumerate(code.splitlines(), 1))


@pytest.mark.parametrize("path", [README, SDK], ids=lambda p: p.name)
def test_each_doc_has_runnable_blocks(path):
    assert runnable_blocks(path), f"{path.relative_to(ROOT)} has no ```python runnable block"


def test_sdk_reference_mentions_every_public_name():
    text = SDK.read_text(encoding="utf-8")
    missing = [n for n in gradbus.__all__ if not re.search(rf"(?<![\w]){re.escape(n)}(?![\w])",
                                                           text)]
    assert not missing, f"docs/sdk.md does not mention {missing}"


def test_fence_parsing():
    text = "\n".join([
        "```python runnable", "print(1)", "```",
        "```python", "print(2)", "```",
        "````python runnable", "```", "print(3)", "````",
        "~~~ python  runnable extra", "print(4)", "~~~",
        "  ```bash runnable", "  echo 5", "  ```",
        "- item:", "  ```python runnable", "  print(6)", "  ```",
        "```pythonrunnable", "print(7)", "```",
    ])
    got = [(line, code) for line, info, code in fenced_blocks(text) if is_runnable(info)]
    assert got == [(1, "print(1)\n"), (7, "```\nprint(3)\n"), (11, "print(4)\n"),
                   (18, "print(6)\n")]
