"""deploy/monitoring: the Prometheus alert rules and the Grafana dashboard.

Every metric name (and every ``outcome``/``state`` label value) they use is one that a real
``hpc-bridge check`` pass writes to HPC_METRICS_FILE; the dashboard is importable JSON whose
queries all go to the ``${datasource}`` variable; every alert has a unit test that makes it fire;
and, where ``promtool`` is installed, the rules and the dashboard's queries pass
``promtool check rules`` and the rules pass ``promtool test rules``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.bridge import REPO, bridge_environ, run_bridge

MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "hpc-bridge.rules.yml"
RULE_TESTS = MONITORING / "hpc-bridge.rules.test.yml"
DASHBOARD = MONITORING / "hpc-bridge.dashboard.json"

METRIC = re.compile(r"\bhpc_bridge_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(hpc_bridge_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
SAMPLE = re.compile(r"^([a-z_:][a-z0-9_:]*)(?:\{(.*)\})? \S+$")
#: Labels Prometheus adds when it scrapes node_exporter, not the bridge.
SCRAPE_LABELS = {"instance", "job"}
#: Counted from the ledger, so a prune (HPC_RETENTION_DAYS) makes them drop: not for rate()/increase().
LEDGER_COUNTERS = {"hpc_bridge_requests_total", "hpc_bridge_continuations_total"}


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))  # rows hold panels


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = [target["expr"] for panel in all_panels(dashboard["panels"]) for target in panel.get("targets", [])]
    queries += [var["definition"] for var in dashboard["templating"]["list"] if var["type"] == "query"]
    return queries


def written_metrics(text: str) -> tuple[set[str], dict[tuple[str, str], set[str]]]:
    """The series names a metrics file declares or has samples of, and each (name, label)'s values."""
    names: set[str] = set()
    values: dict[tuple[str, str], set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
            continue
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels = match.group(1), match.group(2) or ""
        names.add(name)
        for label, value in re.findall(r'([a-z_]+)="([^"]*)"', labels):
            values.setdefault((name, label), set()).add(value)
    return names, values


@pytest.fixture
def metrics_text(tmp_path: Path, broker_url: str, standin: Any, queues: Any) -> str:
    """What a real ``hpc-bridge check`` pass writes to HPC_METRICS_FILE."""
    metrics = tmp_path / "metrics" / "hpc_bridge.prom"
    env = bridge_environ(broker_url, standin, queues, tmp_path / "spool", HPC_METRICS_FILE=str(metrics))
    result = run_bridge(env, "check")
    assert result.returncode == 0, result.stderr
    text = metrics.read_text()
    list(text_string_to_metric_families(text))  # Prometheus's own client parses it
    return text


def unknown_references(expr: str, names: set[str], values: dict[tuple[str, str], set[str]]) -> list[str]:
    """What ``expr`` uses that the bridge does not write: metric names and label values."""
    problems = [f"metric {name}" for name in METRIC.findall(expr) if name not in names]
    for name, matchers in SELECTOR.findall(expr):
        for label, op, value in MATCHER.findall(matchers):
            if label in SCRAPE_LABELS or op.startswith("!"):
                continue
            known = values.get((name, label))
            if known is None:
                problems.append(f"label {label} of {name}")
                continue
            wanted = value.split("|") if op == "=~" else [value]
            assert all(re.fullmatch(r"[a-z_-]+", w) for w in wanted), f"only plain alternatives: {value!r}"
            problems += [f'{name}{{{label}="{w}"}}' for w in wanted if w not in known]
    return problems


@pytest.mark.broker
def test_rules_and_dashboard_use_only_what_the_bridge_writes(
    metrics_text: str, rules: list[dict[str, Any]], dashboard: dict[str, Any]
) -> None:
    names, values = written_metrics(metrics_text)
    assert "hpc_bridge_oldest_open_request_age_seconds" in names and "hpc_bridge_metrics_timestamp_seconds" in names
    assert values[("hpc_bridge_build_info", "version")] and values[("hpc_bridge_requests_total", "outcome")]
    for rule in rules:
        assert METRIC.search(rule["expr"]), rule["alert"]
        assert unknown_references(rule["expr"], names, values) == [], rule["alert"]
    used = set()
    for query in dashboard_queries(dashboard):
        assert METRIC.search(query), query
        assert unknown_references(query, names, values) == [], query
        used.update(METRIC.findall(query))
    # The dashboard shows every metric the bridge writes (a histogram through its buckets).
    shown = {n for n in names if not n.endswith(("_sum", "_count")) and n != "hpc_bridge_reply_latency_seconds"}
    assert shown - used - {"hpc_bridge_reconciliations_total"} == set()


def test_the_check_catches_a_misspelt_metric_or_label_value() -> None:
    names, values = written_metrics(
        "# TYPE hpc_bridge_requests_total counter\n"
        'hpc_bridge_requests_total{outcome="dead_lettered"} 0\n'
        "# TYPE hpc_bridge_reply_latency_seconds histogram\n"
    )
    assert "hpc_bridge_reply_latency_seconds_bucket" in names
    assert unknown_references('hpc_bridge_requests_total{outcome="dead_lettered",instance=~"$i"}', names, values) == []
    assert unknown_references('hpc_bridge_requests_total{outcome="dead_letters"}', names, values) == [
        'hpc_bridge_requests_total{outcome="dead_letters"}'
    ]
    assert (
        unknown_references('hpc_bridge_request_total{outcome=~"a|b"}', names, values)[0]
        == "metric hpc_bridge_request_total"
    )
    assert unknown_references('hpc_bridge_requests_total{kind="x"}', names, values) == [
        "label kind of hpc_bridge_requests_total"
    ]


def test_rules_are_alerts_with_severity_and_text(rules: list[dict[str, Any]]) -> None:
    assert len(rules) >= 6
    for rule in rules:
        assert re.fullmatch(r"HpcBridge[A-Za-z]+", rule["alert"]), rule
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        for counter in LEDGER_COUNTERS:  # a prune would look like a counter reset
            assert not re.search(rf"\b(rate|irate|increase)\(\s*{counter}\b", rule["expr"]), rule["alert"]
    assert len({rule["alert"] for rule in rules}) == len(rules)


def test_every_alert_has_a_unit_test_that_makes_it_fire(rules: list[dict[str, Any]]) -> None:
    document = yaml.safe_load(RULE_TESTS.read_text())
    assert document["rule_files"] == [RULES.name]
    fired = {
        case["alertname"]
        for test in document["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for test in document["tests"]
        for case in test.get("alert_rule_test", [])
        if not case.get("exp_alerts")
    }
    alerts = {rule["alert"] for rule in rules}
    assert fired == alerts and quiet == alerts


def test_dashboard_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    panels = list(all_panels(dashboard["panels"]))
    assert len({panel["id"] for panel in panels}) == len(panels) >= 8
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert 'instance=~"$instance"' in target["expr"], panel["title"]
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert "${DS_" not in DASHBOARD.read_text(), "no import-time inputs: the variable picks the data source"


# --- promtool (Debian's prometheus package ships it) -----------------------------------------------

PROMTOOL = shutil.which("promtool")


def promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, "promtool is missing: deploy/dev/setup.sh installs it (Debian's prometheus package)"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_promtool_parses_the_dashboards_queries(tmp_path: Path, dashboard: dict[str, Any]) -> None:
    """Each query, with the instance variable filled in, as a recording rule: promtool parses it."""
    queries = [q for q in dashboard_queries(dashboard) if not q.startswith("label_values(")]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{n}", "expr": q.replace("$instance", ".*")}
                    for n, q in enumerate(queries)
                ],
            }
        ]
    }
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", "dashboard.rules.yml", cwd=tmp_path)
    assert checked.returncode == 0 and f"{len(queries)} rules found" in checked.stdout, checked.stdout + checked.stderr
    # and promtool does reject a broken query, so the check above means something
    (tmp_path / "broken.rules.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(hpc_bridge_jobs"}]}]})
    )
    assert promtool("check", "rules", "broken.rules.yml", cwd=tmp_path).returncode != 0


def test_oldest_open_request_age_counts_only_unanswered_requests() -> None:
    from bridge.ledger import RequestRecord, RequestState
    from bridge.ops.metrics import render

    def age(*records: RequestRecord) -> float:
        (line,) = [x for x in render(records, outbox=0, now=10_000.0).splitlines() if x.startswith("hpc_bridge_oldest")]
        return float(line.split()[1])

    def record(corr: str, state: RequestState, created_at: float) -> RequestRecord:
        return RequestRecord(correlation_id=corr, key=corr, reply_to="q", state=state, created_at=created_at)

    assert age() == 0
    replied = record("a", RequestState.REPLIED, 1_000.0)
    rejected = record("b", RequestState.REJECTED, 2_000.0)
    assert age(replied, rejected) == 0
    running = record("c", RequestState.SUBMITTED, 7_500.0)
    queued = record("d", RequestState.RECEIVED, 9_000.0)
    assert age(replied, running, queued, rejected) == 2_500.0
    assert age(queued) == 1_000.0
