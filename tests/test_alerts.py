"""The alert rules (docker/alerts.yml) and the Prometheus and Alertmanager configurations, checked
by Prometheus's own tools: ``promtool check rules``, ``promtool test rules`` on the unit tests in
tests/alerts_test.yml (series written out per alert), ``promtool check config`` and
``amtool check-config``. Skipped, with a message, where the tools are not installed (.ci/run
installs Debian's prometheus where apt is there)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
RULES = DOCKER / "alerts.yml"
UNIT_TESTS = ROOT / "tests" / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")


def _run(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


def _alerts(path=RULES) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


@needs_promtool
def test_promtool_checks_the_rules():
    r = _run(PROMTOOL, "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout


@needs_promtool
def test_the_rules_pass_their_unit_tests():
    r = _run(PROMTOOL, "test", "rules", str(UNIT_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
@pytest.mark.parametrize("change", ["a longer for:", "another threshold", "a lost label"])
def test_the_unit_tests_catch_a_changed_rule(tmp_path, change):
    doc = yaml.safe_load(RULES.read_text())
    rules = {r["alert"]: r for g in doc["groups"] for r in g["rules"]}
    if change == "a longer for:":
        rules["GradbusPartitionDown"]["for"] = "1m"
    elif change == "another threshold":
        rules["GradbusCheckpointTooOld"]["expr"] = rules["GradbusCheckpointTooOld"][
            "expr"].replace("3 *", "5 *")
    else:
        rules["GradbusShardSilent"]["labels"] = {}
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "alerts.yml").write_text(yaml.safe_dump(doc))
    (tmp_path / "tests").mkdir()
    shutil.copy(UNIT_TESTS, tmp_path / "tests" / "alerts_test.yml")
    r = _run(PROMTOOL, "test", "rules", "tests/alerts_test.yml", cwd=tmp_path)
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr, r.stdout


def test_every_alert_is_unit_tested_labelled_and_documented():
    alerts = _alerts()
    names = [r["alert"] for r in alerts]
    assert len(names) == len(set(names)) >= 7
    tested = {t["alertname"] for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"]}
    assert tested == set(names)
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:     # each shown firing
        assert any(t["exp_alerts"] for t in case["alert_rule_test"]), case
    doc = (ROOT / "docs" / "operations.md").read_text()
    for r in alerts:
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert {"summary", "description"} <= set(r["annotations"]), r["alert"]
        assert f"`{r['alert']}`" in doc, f"{r['alert']} is not in docs/operations.md"


@needs_promtool
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-local.yml"])
def test_promtool_checks_the_prometheus_configurations(config):
    r = _run(PROMTOOL, "check", "config", str(DOCKER / config))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout      # alerts.yml, beside it


@pytest.mark.skipif(shutil.which("amtool") is None,
                    reason="amtool is not installed (Debian: apt-get install "
                           "prometheus-alertmanager)")
def test_amtool_checks_the_alertmanager_configuration():
    r = _run("amtool", "check-config", str(DOCKER / "alertmanager.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
