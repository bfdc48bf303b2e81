"""Every repository path the docs name in code spans (`shards/server.py`, `gradbus/cli/`) is
there: a module that moved or became a package makes its old name in the docs a failure."""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_SPAN = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?)`")


def _named_paths(text: str) -> set[str]:
    """Code spans that read as a path below one of the repository's top-level folders."""
    out = set()
    for span in _SPAN.findall(text):
        top = span.split("/", 1)[0]
        if "/" in span and not top.startswith(".") and (ROOT / top).is_dir():
            out.add(span)
    return out


def test_named_paths_are_found_in_spans():
    text = "see `gradbus/cli/__init__.py`, `docs/`, `a.b`, `DIR/<id>/` and `nothere/x.py`"
    assert _named_paths(text) == {"gradbus/cli/__init__.py", "docs/"}


def test_every_path_the_docs_name_exists():
    missing = [f"{doc.relative_to(ROOT)}: {p}" for doc in DOCS
               for p in sorted(_named_paths(doc.read_text(encoding="utf-8")))
               if not os.path.exists(ROOT / p)]
    assert not missing, "the docs name paths that are not in the repository:\n" + "\n".join(missing)
