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

from .rigs import wait_for

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


# -- what the docs say about the project itself ---------------------------------------------
PROTOCOL = ROOT / "docs" / "protocol.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
#: the packages whose code builds and reads message headers
_PACKAGES = ("broker", "shards", "workers", "gradbus")


def _prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m and (fence is None or (m.group(2)[0] == fence[0] and len(m.group(2)) >= len(fence)
                                    and not m.group(3).strip())):
            fence = m.group(2) if fence is None else None
            continue
        if fence is None:
            out.append(line)
    return out


def _slug(title: str) -> str:
    """The anchor a heading gets on GitHub: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _section(text: str, number: int) -> str:
    """Section ``number`` (``## N.`` up to the next ``## ``) of a markdown text."""
    m = re.search(rf"^## {number}\. .*?(?=^## )", text, re.M | re.S)
    assert m, f"no section {number}"
    return m.group(0)


def _subsections(section: str) -> list[tuple[str, str]]:
    """``(heading, body)`` of every ``### `` subsection of a section."""
    parts = re.split(r"^(### .*)$", section, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def _message_kinds() -> set[str]:
    from gradbus.codecs import wire
    kinds = set(wire.FRONTEND_KINDS | wire.BACKEND_KINDS | wire.SHARD_KINDS | wire.CLIENT_KINDS)
    return kinds | set(getattr(wire, "SCHEMA", {}))


def _kind_subsection(section: str, kind: str) -> str:
    """The body of the section 6 subsection whose heading names ``kind`` (upper case)."""
    bodies = [body for head, body in _subsections(section)
              if re.search(rf"(?<![\w]){kind.upper()}(?![\w])", head)]
    assert bodies, f"protocol.md section 6 has no subsection for {kind.upper()}"
    return "\n".join(bodies)


def test_protocol_describes_every_message_kind():
    sec = _section(PROTOCOL.read_text(encoding="utf-8"), 6)
    kinds = _message_kinds()
    assert len(kinds) >= 30, kinds
    overview = {m.group(1).lower() for m in re.finditer(r"^\| ([A-Z_]+) \|", sec, re.M)}
    assert not kinds - overview, f"section 6's table lacks {sorted(kinds - overview)}"
    for kind in sorted(kinds):
        _kind_subsection(sec, kind)


def test_protocol_names_every_required_field():
    from gradbus.codecs import wire
    schema = getattr(wire, "SCHEMA", None)
    if schema is None:
        pytest.skip("codecs/wire.py has no SCHEMA table")
    sec = _section(PROTOCOL.read_text(encoding="utf-8"), 6)
    missing = [f"{kind.upper()}.{name}" for kind, fields in sorted(schema.items())
               for name, (_, required) in fields.items()
               if required and f"`{name}`" not in _kind_subsection(sec, kind)]
    assert not missing, f"protocol.md section 6 does not describe {missing}"


def _packed_fields() -> dict[str, set[str]]:
    """``{kind: {field, ...}}`` for every ``wire.pack(wire.KIND, ..., field=...)`` in the code
    that builds headers (the field names its keyword arguments give)."""
    import ast

    from gradbus.codecs import wire
    out: dict[str, set[str]] = {}
    for pkg in _PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "pack" and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "wire" and node.args
                        and isinstance(node.args[0], ast.Attribute)
                        and isinstance(node.args[0].value, ast.Name)
                        and node.args[0].value.id == "wire"):
                    continue
                kind = getattr(wire, node.args[0].attr, None)
                if isinstance(kind, str):
                    out.setdefault(kind, set()).update(k.arg for k in node.keywords if k.arg)
    return out


def test_protocol_names_every_field_the_code_packs():
    packed = _packed_fields()
    assert len(packed) >= 20, f"found headers of only {sorted(packed)}"
    sec = _section(PROTOCOL.read_text(encoding="utf-8"), 6)
    missing = [f"{kind.upper()}.{name}" for kind, names in sorted(packed.items())
               for name in sorted(names) if f"`{name}`" not in _kind_subsection(sec, kind)]
    assert not missing, f"protocol.md section 6 does not describe {missing}"


def test_protocol_lists_every_error_code():
    from gradbus.codecs.errors import Code
    sec = _section(PROTOCOL.read_text(encoding="utf-8"), 7)
    rows = set(re.findall(r"^\| `([A-Z_]+)` \|", sec, re.M))
    assert not {c.value for c in Code} - rows, \
        f"protocol.md section 7 lacks {sorted({c.value for c in Code} - rows)}"
    assert not rows - {c.value for c in Code}, f"section 7 names unknown codes {rows}"


def test_protocol_is_the_specification():
    text = PROTOCOL.read_text(encoding="utf-8")
    status = next(line for line in text.splitlines() if line.startswith("* Status:"))
    assert "normative" in status and ".py" not in status, status
    assert "SCHEMA" not in text and "is normative" not in text.replace(
        "Status: normative", ""), "protocol.md defers to code"


def _links(path: pathlib.Path) -> list[str]:
    return [m.group(1) for line in _prose_lines(path.read_text(encoding="utf-8"))
            for m in _LINK.finditer(line)]


def test_doc_links_name_existing_files_and_headings():
    broken = []
    for doc in _doc_files():
        for target in _links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):    # http:, mailto:, ...
                continue
            ref, _, anchor = target.partition("#")
            dest = (doc.parent / ref).resolve() if ref else doc
            where = f"{doc.relative_to(ROOT)}: {target}"
            if ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{where} (outside the project)")
            elif not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_name_existing_benchmarks():
    missing = sorted({f"{doc.relative_to(ROOT)}: {m}" for doc in _doc_files()
                      for m in re.findall(r"\bbench/[\w-]+\.py\b", doc.read_text(encoding="utf-8"))
                      if not (ROOT / m).exists()})
    assert not missing, f"docs name benchmarks that do not exist: {missing}"


def test_docs_refer_to_nothing_outside_the_project():
    """No machine path and no path climbing out of the repository (links are checked to stay
    inside it by test_doc_links_name_existing_files_and_headings)."""
    bad = re.compile(r"(?<![\w.])\.\./\.\.|(?:^|[\s`(\"'])/(?:work|home|root|Users)/")
    found = [f"{doc.relative_to(ROOT)}:{n}: {line.strip()}" for doc in _doc_files()
             for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
             if bad.search(line)]
    assert not found, "\n".join(found)


def test_performance_sections_are_dated():
    text = PERFORMANCE.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 4
    undated = [s.splitlines()[0] for s in sections if not re.search(r"\b20\d\d-\d\d-\d\d\b", s)]
    assert not undated, f"performance.md sections without a date: {undated}"
    assert re.search(r"python bench/throughput\.py", text)


def test_slugs_and_sections():
    assert _slug("12. Codec chains") == "12-codec-chains"
    assert _slug("Ops requests: `gradbus.admin`") == "ops-requests-gradbusadmin"
    text = "## 6. A\n### 6.1 HELLO, WELCOME\nx\n### 6.2 PUSH\ny\n## 7. B\n"
    sec = _section(text, 6)
    assert [h for h, _ in _subsections(sec)] == ["### 6.1 HELLO, WELCOME", "### 6.2 PUSH"]
    assert _kind_subsection(sec, "welcome").strip() == "x"
    assert _prose_lines("a\n```\n# no\n```\n# yes\n") == ["a", "# yes"]
