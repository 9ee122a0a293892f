"""deploy/: the Prometheus alerting rules pass promtool's checks and their unit tests, every rule
has a case that fires and one that does not, and the Grafana dashboard is importable JSON whose
every query parses. That every query returns data from a real cluster is
tests/e2e/test_up_discovery.py's test_dashboard_queries_all_return_data_from_a_kvferry_up_cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from kvferry.testing.prometheus import check_exprs, dashboard_queries, promtool_binary

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "kvferry-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "kvferry-alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "kvferry.json"
DOC = REPO / "docs" / "observability.md"


def _alerts() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def _promtool(*args: str) -> subprocess.CompletedProcess:
    exe = promtool_binary()
    assert exe is not None
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)


def test_alert_rules_pass_promtool_check_and_their_unit_tests(prometheus_available) -> None:
    r = _promtool("check", "rules", RULES.name)
    assert r.returncode == 0 and f"SUCCESS: {len(_alerts())} rules found" in r.stdout, r.stdout + r.stderr
    r = _promtool("test", "rules", RULE_TESTS.name)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_alert_rule_has_a_unit_test_that_fires_and_one_that_does_not() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fires if t.get("exp_alerts") else quiet).add(t["alertname"])
    alerts = set(_alerts())
    assert alerts - fires == set(), f"rules with no case where they fire: {alerts - fires}"
    assert alerts - quiet == set(), f"rules with no case where they stay quiet: {alerts - quiet}"
    assert (fires | quiet) <= alerts, f"cases for rules that do not exist: {(fires | quiet) - alerts}"


def test_dashboard_is_importable_json_and_every_query_parses(prometheus_available) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvferry" and dash["title"]
    (ds,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds["name"] == "DS_PROMETHEUS" and ds["query"] == "prometheus"  # picked at import, switchable after
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]), "panel ids must be unique"
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"]), p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["description"], p["title"]
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) >= len(panels)
    check_exprs(queries)


def test_dashboard_panels_and_alert_rules_are_each_explained_in_the_docs() -> None:
    doc = DOC.read_text()
    panels = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    missing = [t for t in panels if f"**{t}**" not in doc] + [a for a in _alerts() if f"`{a}`" not in doc]
    assert not missing, f"docs/observability.md does not explain: {missing}"


@pytest.mark.parametrize("bad", ["sum(rate(x[1m])", "rate(x)"])
def test_dashboard_query_check_names_a_query_that_does_not_parse(prometheus_available, bad: str) -> None:
    with pytest.raises(AssertionError, match="expr_0: broken"):
        check_exprs({"broken": bad})
