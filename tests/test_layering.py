"""The package's layers, checked from the source: broker/, shards/ and workers/ meet only over
sockets, so each imports gradbus.codecs and nothing else of gradbus; codecs/ is the bottom and
imports nothing of gradbus outside itself. gradbus/ (API, CLI, launcher) sits on top."""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# top-level folder -> the gradbus subpackages its modules may import
ALLOWED = {
    "broker": {"gradbus.broker", "gradbus.codecs"},
    "shards": {"gradbus.shards", "gradbus.codecs"},
    "workers": {"gradbus.workers", "gradbus.codecs"},
    "codecs": {"gradbus.codecs"},
}
PACKAGE = {"broker": "gradbus.broker", "shards": "gradbus.shards",
           "workers": "gradbus.workers", "codecs": "gradbus.codecs"}


def _imports(path: pathlib.Path, package: str):
    """Yield (line, absolute module name) for every gradbus import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:      # relative: resolve against the module's own package
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "gradbus":   # ``from gradbus import x`` names submodules or the facade
                for alias in node.names:
                    yield node.lineno, f"gradbus.{alias.name}"
            else:
                yield node.lineno, mod


def _violations(folder: str) -> list[str]:
    allowed = ALLOWED[folder]
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, mod in _imports(path, PACKAGE[folder]):
            if mod != "gradbus" and not mod.startswith("gradbus."):
                continue
            if mod == "gradbus" or not any(mod == a or mod.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_layer_imports_only_what_it_may(folder):
    assert _violations(folder) == []


def test_checker_sees_a_violation(tmp_path, monkeypatch):
    """The checker itself: a module in workers/ importing the broker is reported."""
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "bad.py").write_text(
        "from gradbus.broker import core\nfrom gradbus.codecs import wire\n"
        "from .. import shards\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations("workers") == ["workers/bad.py:1 imports gradbus.broker",
                                      "workers/bad.py:3 imports gradbus.shards"]


def test_test_modules_share_rigs_only_through_rigs_py():
    """Shared rigs and helpers live in tests/rigs.py and fixtures in conftest.py: no test module
    imports another test module or conftest (test_harness checks conftest's own leak checks)."""
    bad = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for line, mod in _imports(path, "tests"):
            name = mod.rsplit(".", 1)[-1]
            if (name.startswith("test_") or (name == "conftest" and path.name != "test_harness.py")):
                bad.append(f"{path.name}:{line} imports {mod}")
    assert bad == []


def test_setup_cfg_lists_every_package():
    """A wheel holds only the packages setup.cfg lists (an editable install finds the others
    anyway, so nothing else would notice): every folder with an ``__init__.py`` under a mapped
    folder is listed, and nothing else is."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    mapping = dict(line.split(" = ") for line in cfg["options"]["package_dir"].strip().splitlines())
    found = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found == listed


def test_a_process_start_imports_no_heavy_optional_module():
    """What every broker, shard and client process imports at start leaves out the modules
    that cost most of a second to import and are needed only on some paths (ml_dtypes for the
    numpy bf16 cast, numba for the fast loops, torch, cupy): a 2-shard cluster started in 4.7 s
    with ml_dtypes imported at start, 1.9 s without."""
    import subprocess
    code = ("import sys, gradbus, gradbus.cli, gradbus.broker.server, gradbus.shards.server, "
            "gradbus.workers.client\n"
            "print(' '.join(m for m in ('ml_dtypes', 'numba', 'torch', 'cupy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == ""
