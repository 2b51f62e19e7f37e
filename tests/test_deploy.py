"""The deployment files in deploy/: they parse, they name only metrics that exist, and they agree.

The metric names are taken from the real code (``DetectorMetrics`` and ``AgentMetrics``), so a
renamed metric breaks this test instead of silently breaking an alert or a dashboard panel. The
alert rules' behaviour is tested by ``promtool test rules`` when promtool is on PATH, and the
Alertmanager configuration by ``amtool check-config`` when amtool is (tests/test_alertmanager.py
runs it for real).

Both deployments run two detectors side by side (replicas 0 and 1): the compose file and the
Kubernetes StatefulSet must start each with its own ``--replica`` and store, and Prometheus must
label each target with its replica. The alerts about the watched system merge the replicas in the
rule (one alert per system, which outlives either detector); the alerts about one detector keep
``instance`` and ``replica``, and Prometheus relabels no alert it sends.

The deployments run mutual TLS: the compose file, the Kubernetes manifests and the Prometheus
scrape config must name the certificate files that deploy/tls/make-certs.sh (compose) or
cert-manager (Kubernetes) make, and, when openssl is on PATH, the certificates the script makes
must work with the real detector: each identity can do what it is for, and no more.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import ssl
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from control_streams import register as register_stream
from cryptography import x509

from stablewatch.agents.certificates import channel_credentials
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.rpc.metrics import RpcAgentMetrics
from stablewatch.cli.client import DetectorClient, DetectorError
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.limits import REFUSAL_REASONS
from stablewatch.detector.service.metrics import DetectorMetrics
from stablewatch.testing.detector import Running

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/ (it belongs in the dev extra)")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "stablewatch-dashboard.json"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"
KUBERNETES_PROMETHEUS = PROMETHEUS / "kubernetes.yml"
KUBERNETES = DEPLOY / "kubernetes"
MAKE_CERTS = DEPLOY / "tls" / "make-certs.sh"
SPARK = DEPLOY / "spark"
# What make-certs.sh writes for the services, and where compose mounts it.
TLS_MOUNT = "/tls"
DETECTOR_TLS = [
    "--tls-cert",
    "/tls/detector.pem",
    "--tls-key",
    "/tls/detector-key.pem",
    "--tls-client-ca",
    "/tls/ca.pem",
]
PROMETHEUS_TLS = {"ca_file": "/tls/ca.pem", "cert_file": "/tls/prometheus.pem", "key_file": "/tls/prometheus-key.pem"}
# Where deploy/prometheus/kubernetes.yml expects the Secret stablewatch-prometheus-tls.
K8S_PROMETHEUS_TLS = "/etc/prometheus/stablewatch-tls"
# The two detectors of the compose file, by replica number.
DETECTORS = {0: "detector-0", 1: "detector-1"}

# Alerts about the watched system: one per job, whichever detectors report it.
SYSTEM_ALERTS = {
    "StablewatchDeadlock",
    "StablewatchConservationViolated",
    "StablewatchCutOpen",
    "StablewatchDeadlockBroken",
    "StablewatchBreakUnanswered",
    "StablewatchResolvePoliciesDisagree",
}
# Alerts about one detector: one per instance.
DETECTOR_ALERTS = {
    "StablewatchDetectorDown",
    "StablewatchNoRecentSnapshot",
    "StablewatchSnapshotsAborting",
    "StablewatchPartsRejected",
    "StablewatchRefused",
    "StablewatchNoAgents",
}
ALERTS = SYSTEM_ALERTS | DETECTOR_ALERTS
# The labels a detector's target has and the other's has not.
REPLICA_LABELS = ("instance", "replica")
GRPC_PORT = int(DetectorConfig().listen.rsplit(":", 1)[1])
METRICS_PORT = DetectorConfig().metrics_port
DS = "${DS_PROMETHEUS}"
# A PromQL identifier that names a stablewatch series or recording rule.
_NAME = re.compile(r"(?<![\w:])stablewatch[_:][\w:]*")
_PROMTOOL_MISSING = "promtool is not on PATH (Debian: apt-get install prometheus); the rule unit tests did not run"
_AMTOOL_MISSING = "amtool is not on PATH (Debian: apt-get install prometheus-alertmanager); the config was not checked"


# -- helpers ------------------------------------------------------------------------------------------------


def _sample_names(registry: Any) -> set[str]:
    """Every sample name the registry exposes, with the suffixes (_total, _bucket, ...).

    A labelled metric with no child yet exposes no sample; its names follow from its type.
    """
    names: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
    for family in registry.collect():
        names.update(sample.name for sample in family.samples)
        if not family.samples:
            names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def _strings(node: Any) -> Iterator[str]:
    """Every string in a parsed YAML or JSON document."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _names(texts: Iterator[str]) -> set[str]:
    return {name for text in texts for name in _NAME.findall(text)}


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _rules() -> list[dict[str, Any]]:
    return [rule for group in _load(PROMETHEUS / "alerts.yml")["groups"] for rule in group["rules"]]


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict[str, Any]]:
    return [panel for panel in _dashboard()["panels"] if panel["type"] != "row"]


def _dashboard_expressions() -> list[str]:
    """The PromQL of every panel target, template variable and annotation."""
    dashboard = _dashboard()
    exprs = [target["expr"] for panel in _panels() for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    return exprs


def _k8s() -> dict[str, list[dict[str, Any]]]:
    """The Kubernetes objects by kind."""
    objects: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                objects.setdefault(document["kind"], []).append(document)
    return objects


def _flag(args: list[str], flag: str) -> str:
    """The value that follows `flag` in an argument list."""
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module")
def detector_names() -> set[str]:
    return _sample_names(DetectorMetrics().registry)


@pytest.fixture(scope="module")
def agent_names() -> set[str]:
    return _sample_names(AgentMetrics().registry)


@pytest.fixture(scope="module")
def rpc_agent_names() -> set[str]:
    return _sample_names(RpcAgentMetrics().registry)


def _promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(_PROMTOOL_MISSING)
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def _relabelled(config: dict[str, Any], meta: dict[str, str]) -> dict[str, str]:
    """A target's labels after a scrape job's ``replace`` relabel rules (Prometheus' defaults:
    separator ``;``, replacement ``$1``, the regex anchored at both ends)."""
    labels = dict(meta)
    for rule in config.get("relabel_configs", []):
        assert rule.get("action", "replace") == "replace", rule
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(replacement)
    return labels


def _detector_job(path: Path) -> dict[str, Any]:
    (job,) = [job for job in _load(path)["scrape_configs"] if job["job_name"] == "stablewatch-detector"]
    return job


def _compose_detectors() -> dict[int, dict[str, Any]]:
    """The compose file's detector services, by the replica number their command gives."""
    services = _load(COMPOSE)["services"]
    detectors = {name: s for name, s in services.items() if s.get("image", "").startswith("stablewatch:")}
    return {int(_flag(s["command"], "--replica")): s | {"name": name} for name, s in detectors.items()}


# -- parsing ------------------------------------------------------------------------------------------------


def test_every_file_parses() -> None:
    yaml_files = sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])
    assert len(yaml_files) >= 10, yaml_files
    for path in yaml_files:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert documents, f"{path} is empty"
    assert _dashboard()["panels"]


def test_metric_names_are_collected(detector_names: set[str], agent_names: set[str], rpc_agent_names: set[str]) -> None:
    """The name lists the other tests rely on are complete (labelled metrics without children included)."""
    for name in (
        "stablewatch_predicate_value",
        "stablewatch_conservation_drift",
        "stablewatch_snapshots_total",
        "stablewatch_snapshot_duration_seconds_bucket",
        "stablewatch_deadlocks_resolved_total",
        "stablewatch_resolution_seconds_bucket",
        "stablewatch_breaks_sent_total",
        "stablewatch_break_reports_ignored_total",
        "stablewatch_wait_hints_total",
    ):
        assert name in detector_names
    assert "stablewatch_agent_messages_sent_total" in agent_names
    assert {
        "stablewatch_agent_rpc_stamped_messages_total",
        "stablewatch_agent_rpc_detector_connected",
    } <= rpc_agent_names
    assert not any(name.startswith("stablewatch_agent_") for name in detector_names)
    assert all(name.startswith("stablewatch_agent_rpc_") for name in rpc_agent_names)
    assert not any(name.startswith("stablewatch_agent_rpc_") for name in agent_names)


# -- alert rules --------------------------------------------------------------------------------------------


def test_alert_names() -> None:
    alerts = [rule for rule in _rules() if "alert" in rule]
    assert {rule["alert"] for rule in alerts} == ALERTS
    assert len(alerts) == len(ALERTS)
    for rule in alerts:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
    deadlock = next(rule for rule in alerts if rule["alert"] == "StablewatchDeadlock")
    assert deadlock["for"] == "0s"
    assert 'stablewatch_predicate_value{predicate="deadlock"} == 1' in deadlock["expr"]
    assert "stablewatch_deadlocked_nodes" in deadlock["annotations"]["description"]
    assert "stablewatch resolve" in deadlock["annotations"]["description"]


def test_break_alerts() -> None:
    """A break that worked is news (info); one that got no answer may leave the deadlock (warning)."""
    alerts = {rule["alert"]: rule for rule in _rules() if "alert" in rule}
    broken, unanswered = alerts["StablewatchDeadlockBroken"], alerts["StablewatchBreakUnanswered"]
    assert broken["labels"]["severity"] == "info"
    assert 'stablewatch_deadlocks_resolved_total{outcome="broken"}' in broken["expr"]
    assert unanswered["labels"]["severity"] == "warning"
    assert 'stablewatch_deadlocks_resolved_total{outcome=~"unanswered|not_attached|failed"}' in unanswered["expr"]
    for rule in (broken, unanswered):
        assert rule["for"] == "0s"
        assert "stablewatch resolutions" in rule["annotations"]["description"]


def _alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in _rules() if "alert" in rule}


def test_system_alerts_merge_the_replicas() -> None:
    """An alert about the watched system aggregates `instance` and `replica` away in its rule, so it
    is one alert for both detectors, which goes on when one dies; its annotations name no detector,
    and the queries they run aggregate the same way."""
    merge = re.compile(r"\b(max|sum) without \(instance, replica\) \(")
    for name in SYSTEM_ALERTS:
        rule = _alerts()[name]
        assert merge.match(rule["expr"]), (name, rule["expr"])
        # Counts of breaks add up (each break is sent by one detector); what detectors report is maxed.
        assert rule["expr"].startswith("sum" if "resolved_total" in rule["expr"] else "max"), name
        assert "$labels.job" in rule["annotations"]["summary"], name
        queries = 0
        for text in rule["annotations"].values():
            assert "$labels.instance" not in text and "$labels.replica" not in text, (name, text)
            for query in re.findall(r'printf "([^"]*)"[^|}]*\|\s*query\b', text):
                assert merge.match(query), (name, query)
                queries += 1
        assert queries == (name in {"StablewatchDeadlock", "StablewatchConservationViolated"}), name


def test_detector_alerts_stay_per_detector() -> None:
    """An alert about one detector keeps `instance` (and `replica` where the rule keeps labels): two
    detectors in trouble are two alerts, each saying which."""
    for name in DETECTOR_ALERTS:
        rule = _alerts()[name]
        assert "without" not in rule["expr"], name
        for grouping in re.findall(r"\b(?:by|on) \(([^)]*)\)", rule["expr"]):
            assert {"job", *REPLICA_LABELS} <= {label.strip() for label in grouping.split(",")}, (name, grouping)
        assert "$labels.instance" in rule["annotations"]["summary"], name
    down = _alerts()["StablewatchDetectorDown"]
    assert down["labels"]["severity"] == "warning"
    # It names the detectors' scrape job: the same in both Prometheus configurations.
    job = re.fullmatch(r'up\{job="([^"]+)"\} == 0', down["expr"])
    assert job is not None, down["expr"]
    for path in (PROMETHEUS / "prometheus.yml", KUBERNETES_PROMETHEUS):
        assert _detector_job(path)["job_name"] == job.group(1), path


def test_rules_use_only_detector_metrics(detector_names: set[str]) -> None:
    rules = _rules()
    recorded = {rule["record"] for rule in rules if "record" in rule}
    for path in (PROMETHEUS / "alerts.yml", PROMETHEUS / "alerts_test.yml"):
        names = _names(_strings(_load(path)))
        assert names, path
        assert names - detector_names - recorded == set(), f"{path.name} names metrics the detector does not export"
    for name in recorded:
        assert re.fullmatch(r"stablewatch:[a-z0-9_]+:[a-z0-9_]+", name), name  # level:metric:operations


def test_alert_unit_tests_cover_every_alert() -> None:
    tests = _load(PROMETHEUS / "alerts_test.yml")
    assert tests["rule_files"] == ["alerts.yml"]
    cases = [case for test in tests["tests"] for case in test.get("alert_rule_test", [])]
    for alert in ALERTS:
        mine = [case for case in cases if case["alertname"] == alert]
        assert any(case["exp_alerts"] for case in mine), f"{alert} is never tested firing"
        assert any(not case["exp_alerts"] for case in mine), f"{alert} is never tested not firing"


def test_promtool_rule_unit_tests() -> None:
    result = _promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# -- the rules' behaviour in the cases the replicas and Prometheus' extrapolation make -------------------

# The labels Prometheus gives detector `replica`'s series (prometheus.yml).
_JOB = "stablewatch-detector"


def _series(metric: str, replica: int, values: str, **labels: str) -> dict[str, str]:
    """A promtool input series of detector `replica`, with extra `labels`."""
    extra = "".join(f', {name}="{value}"' for name, value in labels.items())
    target = f'job="{_JOB}", instance="detector-{replica}:9464", replica="{replica}"'
    return {"series": f"{metric}{{{target}{extra}}}", "values": values}


def _deadlock(replica: int, values: str, unknown: str, completed: str) -> list[dict[str, str]]:
    """A detector's deadlock gauges, its `unknown` flags and its snapshots' completion times."""
    return [
        _series("stablewatch_predicate_value", replica, values, predicate="deadlock"),
        _series("stablewatch_predicate_unknown", replica, unknown, predicate="deadlock"),
        _series("stablewatch_last_completed_snapshot_timestamp_seconds", replica, completed),
    ]


def _rendered(template: str, labels: dict[str, str], value: str) -> str:
    """An annotation template as Prometheus renders it with these `labels` and `value`, for the
    constructs alerts.yml uses; a `with` over a query finds nothing (the tests give no such series)."""

    def without_query(match: re.Match[str]) -> str:
        return match.group(1) or ""

    text = re.sub(r"\{\{ with .*?(?:\{\{ else \}\}(.*?))?\{\{ end \}\}", without_query, template)
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda match: labels[match.group(1)], text)
    text = re.sub(r"\{\{ \$value[^}]*\}\}", value, text)
    assert "{{" not in text, text
    return text


def _fires(alert: str, at: str, *labels: dict[str, str], value: str = "") -> dict[str, Any]:
    """A promtool case: `alert` at `at` is exactly the alerts with these labels (none: not firing),
    each with the annotations its templates make of its labels and of `value`."""
    annotations = _alerts()[alert]["annotations"]
    expected = [
        {"exp_labels": dict(lab), "exp_annotations": {k: _rendered(t, lab, value) for k, t in annotations.items()}}
        for lab in labels
    ]
    return {"eval_time": at, "alertname": alert, "exp_alerts": expected}


def _promtool_cases(tmp_path: Path, tests: list[dict[str, Any]], evaluation_interval: str = "1m") -> None:
    """Run promtool unit `tests` of alerts.yml (written to `tmp_path`); fail with its report."""
    document = {"rule_files": [str(PROMETHEUS / "alerts.yml")], "evaluation_interval": evaluation_interval}
    (tmp_path / "cases_test.yml").write_text(yaml.safe_dump(document | {"tests": tests}, sort_keys=False))
    result = _promtool("test", "rules", "cases_test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


_DEADLOCK = {"severity": "critical", "job": _JOB, "predicate": "deadlock"}


def test_deadlock_alert_ignores_a_restarted_replicas_old_snapshot(tmp_path: Path) -> None:
    """Replica 1, down from 1m to 5m, comes back republishing its stored snapshot of 0m
    (deadlock=1); replica 0's snapshots show the deadlock broken from 3m on: no alert from 3m,
    though replica 1 shows 1 until its next snapshot (8m), which shows none either. A single
    detector's alert is as before: it fires on its deadlock and resolves with it."""
    restart = {
        "interval": "1m",
        "input_series": [
            *_deadlock(0, "1 1 1 0x7", "0x10", "0+60x10"),
            *_deadlock(1, "1 stale _ _ _ 1 1 1 0 0", "0 stale _ _ _ 0 0 0 0 0", "0 stale _ _ _ 0 0 0 480 540"),
        ],
        "alert_rule_test": [
            _fires("StablewatchDeadlock", "2m", _DEADLOCK),
            *(_fires("StablewatchDeadlock", f"{minute}m") for minute in (3, 5, 6, 7, 8)),
        ],
    }
    alone = {
        "interval": "1m",
        "input_series": _deadlock(0, "0 1 1 0 0", "0x5", "0+60x5"),
        "alert_rule_test": [
            _fires("StablewatchDeadlock", "0m"),
            _fires("StablewatchDeadlock", "1m", _DEADLOCK),
            _fires("StablewatchDeadlock", "2m", _DEADLOCK),
            _fires("StablewatchDeadlock", "3m"),
        ],
    }
    _promtool_cases(tmp_path, [restart, alone])


def test_deadlock_alert_fires_unless_a_newer_snapshot_decided_false(tmp_path: Path) -> None:
    """Replica 1 proves a deadlock (its snapshot of 60 s); replica 0's newer snapshot refutes
    nothing when its deadlock is unknown (0 with unknown=1, or NaN), and an older one refutes
    nothing either: the alert fires in each case. Equal times refute nothing."""
    proven = _deadlock(1, "1x4", "0x4", "60x4")
    cases = {
        "unknown": _deadlock(0, "0x4", "1x4", "120x4"),
        "nan": _deadlock(0, "NaN NaN NaN NaN NaN", "0x4", "120x4"),
        "older": _deadlock(0, "0x4", "0x4", "30x4"),
        "as old": _deadlock(0, "0x4", "0x4", "60x4"),
    }
    tests = [
        {
            "interval": "1m",
            "input_series": [*proven, *other],
            "alert_rule_test": [_fires("StablewatchDeadlock", "2m", _DEADLOCK)],
        }
        for other in cases.values()
    ]
    _promtool_cases(tmp_path, tests)


def test_conservation_alert_ignores_a_restarted_replicas_old_drift(tmp_path: Path) -> None:
    """Replica 1 comes back at 5m republishing its stored drift of -2 (snapshot of 0m); replica
    0's later snapshots show tokens conserved: no alert. For another counter that replica 0
    cannot decide (no drift gauge), replica 1's drift still fires, and so it does when replica 0
    (which stops at 2m) has only older snapshots."""
    tokens, seats = {"counter": "tokens"}, {"counter": "seats"}
    test = {
        "interval": "1m",
        "input_series": [
            _series("stablewatch_conservation_drift", 0, "-2 -2 0 0x7", **tokens),
            _series("stablewatch_last_completed_snapshot_timestamp_seconds", 0, "0+60x10"),
            _series("stablewatch_conservation_drift", 1, "-2 stale _ _ _ -2x5", **tokens),
            _series("stablewatch_conservation_drift", 1, "_ stale _ _ _ 5x5", **seats),
            _series("stablewatch_last_completed_snapshot_timestamp_seconds", 1, "0 stale _ _ _ 0x5"),
        ],
        "alert_rule_test": [
            _fires(
                "StablewatchConservationViolated", "1m", {"severity": "critical", "job": _JOB, **tokens}, value="-2"
            ),
            _fires("StablewatchConservationViolated", "6m", {"severity": "critical", "job": _JOB, **seats}, value="5"),
        ],
    }
    older = {
        "interval": "1m",
        "input_series": [
            _series("stablewatch_conservation_drift", 0, "0x4", **tokens),
            _series("stablewatch_last_completed_snapshot_timestamp_seconds", 0, "0x4"),
            _series("stablewatch_conservation_drift", 1, "-2x4", **tokens),
            _series("stablewatch_last_completed_snapshot_timestamp_seconds", 1, "60x4"),
        ],
        "alert_rule_test": [
            _fires("StablewatchConservationViolated", "2m", {"severity": "critical", "job": _JOB, **tokens}, value="-2")
        ],
    }
    _promtool_cases(tmp_path, [test, older])


def test_no_agents_is_one_alert(tmp_path: Path) -> None:
    """Every agent leaves detector 0 at 0m, so no snapshot completes: StablewatchNoRecentSnapshot,
    which alertmanager.yml inhibits only once StablewatchNoAgents fires (5m), must not fire
    before it, nor after; with an agent attached and no snapshot it still fires (after 2m)."""
    detector = {"job": _JOB, "instance": "detector-0:9464", "replica": "0", "severity": "warning"}
    test = {
        "interval": "1m",
        "input_series": [
            _series("stablewatch_agents_attached", 0, "0x8 1x6"),
            _series("stablewatch_last_completed_snapshot_timestamp_seconds", 0, "0x14"),
        ],
        "alert_rule_test": [
            *(_fires("StablewatchNoRecentSnapshot", f"{minute}m") for minute in (3, 4, 5, 6, 8, 10)),
            _fires("StablewatchNoAgents", "4m"),
            _fires("StablewatchNoAgents", "6m", detector),
            _fires("StablewatchNoRecentSnapshot", "11m", detector, value="11m 0s"),
        ],
    }
    _promtool_cases(tmp_path, [test])


def test_counts_in_descriptions_are_whole_numbers(tmp_path: Path) -> None:
    """One event each, scraped every 15 s as prometheus.yml does, evaluated between scrapes:
    increase() extrapolates it to 1.049, and each alert's annotations say 1."""
    resolved = "stablewatch_deadlocks_resolved_total"
    detector = {"instance": "detector-0:9464", "replica": "0"}
    counters = {
        "StablewatchDeadlockBroken": (resolved, {"outcome": "broken"}, {}),
        "StablewatchBreakUnanswered": (resolved, {"outcome": "unanswered"}, {}),
        "StablewatchResolvePoliciesDisagree": (resolved, {"outcome": "policies_disagree"}, {}),
        "StablewatchPartsRejected": ("stablewatch_rejected_parts_total", {"reason": "spoofed"}, detector),
        "StablewatchRefused": ("stablewatch_refused_total", {"reason": "too_many_agents"}, detector),
    }
    cases = [
        _fires(alert, "5m14s", {"job": _JOB, **target, **labels, **_alerts()[alert]["labels"]}, value="1")
        for alert, (_, labels, target) in counters.items()
    ]
    test = {
        "interval": "15s",
        "input_series": [_series(metric, 0, "0x8 1x40", **labels) for metric, labels, _ in counters.values()],
        "alert_rule_test": cases,
    }
    _promtool_cases(tmp_path, [test], evaluation_interval="1s")


def _counter(start: int, steps: tuple[int, ...], scrapes: int) -> str:
    """A promtool values string: a counter from `start` that grows by `steps`, repeated, per scrape."""
    values = [start]
    for scrape in range(1, scrapes):
        values.append(values[-1] + steps[scrape % len(steps)])
    return " ".join(map(str, values))


def test_snapshots_aborting_needs_three_whole_aborts(tmp_path: Path) -> None:
    """Scraped every 61 s and evaluated every minute (so no evaluation lines up with a scrape, as in
    production), each 5-minute window sees 4 or 5 scrapes: increase() extrapolates the 2 aborts
    they show to 2.5. Exactly 2 aborts in every window never fire; exactly 3 do, after 10 minutes."""
    detector = {"severity": "warning", "job": _JOB, "instance": "detector-0:9464", "replica": "0"}

    def test(steps: tuple[int, ...], *firing: dict[str, str]) -> dict[str, Any]:
        return {
            "interval": "61s",
            "input_series": [
                _series("stablewatch_snapshots_total", 0, _counter(100, steps, 40), outcome="aborted"),
                _series("stablewatch_snapshots_total", 0, "50x40", outcome="completed"),
            ],
            "alert_rule_test": [
                _fires("StablewatchSnapshotsAborting", f"{minute}m", *firing, value="100%") for minute in (20, 30)
            ],
        }

    _promtool_cases(tmp_path, [test((1, 0)), test((1, 1, 1, 0), detector)])


# The refusals StablewatchRefused leaves out (alerts.yml says why): every other reason the detector
# counts is one of a client's identity or of its admission limits, which the alert promises.
_REFUSALS_NOT_ALERTED = {"already_attached", "rate_limited", "too_many_triggers", "bad_request"}


def test_refused_alert_covers_every_admission_refusal() -> None:
    """Each of limits.REFUSAL_REASONS is either in StablewatchRefused's reason regex or named as left
    out on purpose, so a new reason has to be decided; the admission limits are all in."""
    expr = _alerts()["StablewatchRefused"]["expr"]
    (regex,) = re.findall(r'stablewatch_refused_total\{reason=~"([^"]+)"\}', expr)
    alerted = set(regex.split("|"))
    assert alerted | _REFUSALS_NOT_ALERTED == set(REFUSAL_REASONS)
    assert not alerted & _REFUSALS_NOT_ALERTED
    admission = {reason for reason in REFUSAL_REASONS if reason.startswith("too_many_")} - {"too_many_triggers"}
    assert {"too_many_watchers_for_identity", "no_register", *admission} <= alerted


_NUMBERS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
)  # fmt: skip


def test_readme_counts_the_alerts() -> None:
    """deploy/README.md says how many alerts and recording rules alerts.yml holds: the real numbers."""
    said = re.search(r"the (\w+) alerts and (\w+) recording rules", (DEPLOY / "README.md").read_text())
    assert said is not None
    rules = _rules()
    alerts = sum("alert" in rule for rule in rules)
    recorded = sum("record" in rule for rule in rules)
    assert (said.group(1), said.group(2)) == (_NUMBERS[alerts], _NUMBERS[recorded])


def test_dashboard_alert_annotations_name_the_alerts_labels() -> None:
    """An annotation over ALERTS names only labels its alert has: a merged system alert has no
    `instance` or `replica`."""
    for annotation in _dashboard()["annotations"]["list"]:
        alert = re.search(r'ALERTS\{alertname="(\w+)"', annotation.get("expr", ""))
        if alert is None:
            continue
        assert alert.group(1) in ALERTS, annotation["name"]
        named = set(
            re.findall(r"\{\{\s*(\w+)\s*\}\}", annotation.get("titleFormat", "") + annotation.get("textFormat", ""))
        )
        assert named, annotation["name"]
        if alert.group(1) in SYSTEM_ALERTS:
            assert not named & set(REPLICA_LABELS), (annotation["name"], named)


def test_promtool_checks_config_and_rules(tmp_path: Path, pki: dict[str, Path]) -> None:
    """promtool checks that the TLS files exist: a copy of the folder points them at test
    certificates. The hosts the configs name need not resolve: promtool checks the syntax."""
    folder = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, folder)
    tls = tmp_path / "tls"
    tls.mkdir()
    for name, source in (
        ("ca.pem", "ca_cert"),
        ("prometheus.pem", "nobody_cert"),
        ("prometheus-key.pem", "nobody_key"),
        ("ca.crt", "ca_cert"),
        ("tls.crt", "nobody_cert"),
        ("tls.key", "nobody_key"),
    ):
        shutil.copy(pki[source], tls / name)
    for name, mount in (("prometheus.yml", TLS_MOUNT), ("kubernetes.yml", K8S_PROMETHEUS_TLS)):
        config = folder / name
        text = config.read_text()
        assert f"{mount}/" in text, name
        config.write_text(text.replace(f"{mount}/", f"{tls}/"))
        result = _promtool("check", "config", name, cwd=folder)
        assert result.returncode == 0, result.stdout + result.stderr
    result = _promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


# -- Prometheus configuration -------------------------------------------------------------------------------


def _assert_alerts_sent_as_made(config: dict[str, Any]) -> None:
    """Prometheus relabels no alert: the rules already merge the replicas where that is meant, and
    an alert that dropped `instance` or `replica` on the way out would be two alerts in Prometheus
    but one in Alertmanager, resolved there when either detector dies."""
    assert "alert_relabel_configs" not in config["alerting"], config["alerting"]


def test_prometheus_config() -> None:
    config = _load(PROMETHEUS / "prometheus.yml")
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS / rule_file).is_file(), rule_file
    assert "alerts.yml" in config["rule_files"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"stablewatch-detector", "stablewatch-agents"}
    # One target per replica, each labelled with its replica number: the compose file's services.
    groups = jobs["stablewatch-detector"]["static_configs"]
    replicas = {int(group["labels"]["replica"]): group["targets"] for group in groups}
    assert replicas == {n: [f"{name}:{METRICS_PORT}"] for n, name in DETECTORS.items()}
    _assert_alerts_sent_as_made(config)
    ((alertmanager,),) = [
        group["targets"] for am in config["alerting"]["alertmanagers"] for group in am["static_configs"]
    ]
    assert alertmanager == "alertmanager:9093"
    # /metrics is HTTPS with client certificates wherever the detector runs mutual TLS.
    assert jobs["stablewatch-detector"]["scheme"] == "https"
    assert jobs["stablewatch-detector"]["tls_config"] == PROMETHEUS_TLS
    for sd in jobs["stablewatch-agents"]["file_sd_configs"]:
        for pattern in sd["files"]:
            files = sorted(PROMETHEUS.glob(pattern))
            assert files, f"no agent target file matches {pattern}"
            for path in files:
                for group in _load(path):
                    assert group["targets"] and all(":" in target for target in group["targets"]), path


def test_kubernetes_prometheus_config() -> None:
    """The Kubernetes variant finds each replica's pod through the headless Service's SRV records,
    labels it with the pod's index, and sends the alerts the same way."""
    config = _load(KUBERNETES_PROMETHEUS)
    compose_config = _load(PROMETHEUS / "prometheus.yml")
    assert config["rule_files"] == compose_config["rule_files"]
    _assert_alerts_sent_as_made(config)
    job = _detector_job(KUBERNETES_PROMETHEUS)
    assert job["scheme"] == "https"
    assert job["tls_config"] == {
        "ca_file": f"{K8S_PROMETHEUS_TLS}/ca.crt",
        "cert_file": f"{K8S_PROMETHEUS_TLS}/tls.crt",
        "key_file": f"{K8S_PROMETHEUS_TLS}/tls.key",
    }
    (sd,) = job["dns_sd_configs"]
    (service,) = _k8s()["Service"]
    (statefulset,) = _k8s()["StatefulSet"]
    name = service["metadata"]["name"]
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert sd["type"] == "SRV"
    assert sd["names"] == [f"_metrics._tcp.{name}.monitoring.svc.cluster.local"] and "metrics" in ports
    # What DNS answers for each pod of the StatefulSet, and the labels the rules make of it.
    for index in range(statefulset["spec"]["replicas"]):
        pod = f"{statefulset['metadata']['name']}-{index}"
        meta = {
            "__address__": f"{pod}.{name}.monitoring.svc.cluster.local:{METRICS_PORT}",
            "__meta_dns_srv_record_target": f"{pod}.{name}.monitoring.svc.cluster.local.",
            "__meta_dns_srv_record_port": str(METRICS_PORT),
        }
        labels = _relabelled(job, meta)
        assert labels["replica"] == str(index)
        assert labels["instance"] == pod
        assert labels["__address__"] == meta["__address__"]  # a name the detector's certificate carries


# -- Alertmanager configuration -----------------------------------------------------------------------------


def test_alertmanager_config() -> None:
    """One route to a webhook, grouped by alert and system (the detectors' alerts of one kind in
    one group); an inhibition between two alerts about one detector holds for that detector only,
    and one that involves a system alert cannot ask for the labels it merged away."""
    config = _load(ALERTMANAGER)
    route = config["route"]
    assert route["group_by"][0] == "alertname" and "job" in route["group_by"]
    assert not set(REPLICA_LABELS) & set(route["group_by"])
    receivers = {receiver["name"]: receiver for receiver in config["receivers"]}
    (webhook,) = receivers[route["receiver"]]["webhook_configs"]
    assert webhook["url"].startswith("http") and webhook["send_resolved"] is True
    for rule in config["inhibit_rules"]:
        names = set()
        for matcher in (*rule["source_matchers"], *rule["target_matchers"]):
            alert = re.fullmatch(r'alertname="(\w+)"', matcher)
            assert alert is not None and alert.group(1) in ALERTS, matcher
            names.add(alert.group(1))
        if names <= DETECTOR_ALERTS:
            assert {"job", "instance"} <= set(rule["equal"]), rule
        else:
            assert not set(REPLICA_LABELS) & set(rule["equal"]), rule


def test_amtool_checks_alertmanager_config() -> None:
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip(_AMTOOL_MISSING)
    result = subprocess.run(
        [amtool, "check-config", str(ALERTMANAGER)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# -- Grafana dashboard --------------------------------------------------------------------------------------


def test_dashboard_uses_only_real_metrics(
    detector_names: set[str], agent_names: set[str], rpc_agent_names: set[str]
) -> None:
    """Every name the dashboard queries is one the detector, an agent or an RPC-mode agent exports."""
    names = _names(iter(_dashboard_expressions()))
    assert names - detector_names - agent_names - rpc_agent_names == set()
    assert "stablewatch_snapshot_duration_seconds_bucket" in names
    assert "stablewatch_agent_messages_sent_total" in names


# What an RPC-mode agent exports in place of a channel-mode agent's series of another name (a series
# of the same name after ``stablewatch_agent_rpc_`` is the equivalent too, without being listed).
_RPC_EQUIVALENTS = {
    "stablewatch_agent_messages_sent_total": {"stablewatch_agent_rpc_stamped_messages_total"},
    "stablewatch_agent_reconnects_total": {"stablewatch_agent_rpc_peer_resets_total"},
    "stablewatch_agent_rejected_frames_total": {
        "stablewatch_agent_rpc_bad_stamps_total",
        "stablewatch_agent_rpc_stale_messages_total",
    },
}


def _row(title: str) -> list[dict[str, Any]]:
    """The panels of the (expanded) row called `title`: those after it up to the next row."""
    panels = _dashboard()["panels"]
    start = next(i for i, panel in enumerate(panels) if panel["type"] == "row" and panel["title"] == title)
    row = []
    for panel in panels[start + 1 :]:
        if panel["type"] == "row":
            break
        row.append(panel)
    return row


def test_dashboard_agents_row_covers_rpc_agents(agent_names: set[str], rpc_agent_names: set[str]) -> None:
    """RPC-mode agents export ``stablewatch_agent_rpc_*``, not ``stablewatch_agent_*``: each panel of
    the Agents row that shows a series with an RPC equivalent shows that too, and the agent
    variables list the agents of both modes, so the row is not empty for an RPC service."""
    row = _row("Agents")
    assert row
    shown_rpc: set[str] = set()
    for panel in row:
        names = _names(target["expr"] for target in panel["targets"])
        assert names <= agent_names | rpc_agent_names, panel["title"]
        shown_rpc |= names & rpc_agent_names
        for name in names & agent_names:
            suffix = name.removeprefix("stablewatch_agent_")
            same = {f"stablewatch_agent_rpc_{suffix}"} & rpc_agent_names
            missing = (same | _RPC_EQUIVALENTS.get(name, set())) - names
            assert not missing, (panel["title"], name, missing)
    assert {"stablewatch_agent_rpc_control_connected", "stablewatch_agent_rpc_stamped_messages_total"} <= shown_rpc
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    for variable in ("agent_job", "agent_instance"):
        query = variables[variable]["query"]["query"]
        assert {"stablewatch_agent_control_connected", "stablewatch_agent_rpc_control_connected"} <= _names(
            iter([query])
        ), variable


def test_dashboard_shows_what_it_promises() -> None:
    panels = _panels()
    exprs = "\n".join(_dashboard_expressions())
    timeline = [p for p in panels if p["type"] == "state-timeline"]
    assert any("stablewatch_predicate_value" in t["expr"] for p in timeline for t in p["targets"])
    for needle in (
        "stablewatch_deadlocked_nodes",
        "sum by (outcome) (rate(stablewatch_snapshots_total",
        "histogram_quantile(0.5, sum by (le) (rate(stablewatch_snapshot_duration_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(stablewatch_snapshot_duration_seconds_bucket",
        "stablewatch_in_flight_messages",
        "stablewatch_counter_total",
        "stablewatch_conservation_drift",
        "stablewatch_agents_attached",
        "sum by (reason) (increase(stablewatch_rejected_parts_total",
        "sum by (peer) (rate(stablewatch_agent_messages_sent_total",
        "sum by (outcome) (increase(stablewatch_deadlocks_resolved_total",
        "histogram_quantile(0.5, sum by (le) (rate(stablewatch_resolution_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(stablewatch_resolution_seconds_bucket",
        "sum by (requested_by) (increase(stablewatch_breaks_sent_total",
        "sum by (outcome) (increase(stablewatch_wait_hints_total",
    ):
        assert needle in exprs, needle
    annotations = [a["expr"] for a in _dashboard()["annotations"]["list"] if "expr" in a]
    assert any('stablewatch_deadlocks_resolved_total{outcome="broken"' in expr for expr in annotations)


def test_dashboard_structure() -> None:
    dashboard = _dashboard()
    assert 39 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == DS
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        x, y, w, h = (panel["gridPos"][key] for key in "xywh")
        assert x >= 0 and x + w <= 24, panel["title"]
        area = {(column, line) for column in range(x, x + w) for line in range(y, y + h)}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
    for panel in _panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": DS}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == DS, panel["title"]


def test_dashboard_expressions_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every panel query, with the dashboard variables filled in."""
    values = {
        "$__rate_interval": "1m",
        "$agent_instance": ".+",
        "$agent_job": "stablewatch-agents",
        "$instance": "localhost:9464",
        "$job": "stablewatch-detector",
    }
    exprs = []
    for expr in _dashboard_expressions():
        if expr.startswith("label_values("):  # Grafana's, not PromQL: check its selector
            expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
        for variable, value in values.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        exprs.append(expr)
    groups = [
        {"name": "dashboard", "rules": [{"record": f"dashboard:expr{i}:check", "expr": e} for i, e in enumerate(exprs)]}
    ]
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump({"groups": groups}))
    result = _promtool("check", "rules", "dashboard.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_matches_compose() -> None:
    datasources = _load(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert [d["type"] for d in datasources] == ["prometheus"]
    assert datasources[0]["isDefault"] is True
    assert datasources[0]["url"] == "http://prometheus:9090"
    provider = _load(DEPLOY / "grafana" / "provisioning" / "dashboards" / "stablewatch.yml")["providers"][0]
    mounts = _load(COMPOSE)["services"]["grafana"]["volumes"]
    assert any(m.endswith(f"{provider['options']['path']}/stablewatch-dashboard.json:ro") for m in mounts)


# -- containers ---------------------------------------------------------------------------------------------


def test_compose_file() -> None:
    compose = _load(COMPOSE)
    services = compose["services"]
    assert set(services) == {"certs", *DETECTORS.values(), "prometheus", "alertmanager", "grafana"}
    for name in DETECTORS.values():
        build = services[name]["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT
        assert (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    # Prometheus scrapes the detectors by service name, and Grafana finds Prometheus by its own.
    assert "network_mode" not in services["prometheus"]
    assert {p.split(":")[-1] for p in services["prometheus"]["ports"]} == {"9090"}
    assert {p.split(":")[-1] for p in services["alertmanager"]["ports"]} == {"9093"}
    assert {*DETECTORS.values(), "alertmanager"} <= set(services["prometheus"]["depends_on"])
    host_ports: list[str] = []
    for service in services.values():
        host_ports += [p.split(":")[0] for p in service.get("ports", [])]
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{source} is mounted but does not exist"
            else:
                assert source in compose["volumes"], source
    assert len(host_ports) == len(set(host_ports)), host_ports
    mounted = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert "/etc/prometheus" in mounted
    (config,) = [v for v in services["alertmanager"]["volumes"] if v.endswith(":/etc/alertmanager:ro")]
    assert (COMPOSE.parent / config.split(":")[0]).resolve() == ALERTMANAGER.parent
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in services["alertmanager"]["command"]


def test_compose_runs_two_detectors() -> None:
    """Replicas 0 and 1, each with its own store and archive, both published on the host; and
    prometheus.yml scrapes exactly these, each labelled with the replica its command gives."""
    detectors = _compose_detectors()
    assert {n: d["name"] for n, d in detectors.items()} == DETECTORS
    data = set()
    for detector in detectors.values():
        command = detector["command"]
        assert command.count("--replica") == 1
        (volume,) = [v for v in detector["volumes"] if v.split(":")[1] == "/data"]
        data.add(volume.split(":")[0])
        assert _flag(command, "--archive").startswith("/data/")
        ports = {p.split(":")[-1] for p in detector["ports"]}
        assert ports == {str(GRPC_PORT), str(METRICS_PORT)}
    assert len(data) == len(detectors), "each detector needs its own store"
    job = _detector_job(PROMETHEUS / "prometheus.yml")
    targets = {group["targets"][0]: group["labels"]["replica"] for group in job["static_configs"]}
    assert targets == {f"{d['name']}:{METRICS_PORT}": str(n) for n, d in detectors.items()}


def test_compose_runs_mutual_tls() -> None:
    """The certs service makes the files before the detectors start; only it holds the CA's key."""
    services = _load(COMPOSE)["services"]
    certs = services["certs"]
    assert f"../tls/{MAKE_CERTS.name}:/make-certs.sh:ro" in certs["volumes"]
    assert certs["command"] == ["/ca", TLS_MOUNT]
    for name in DETECTORS.values():
        detector = services[name]
        assert detector["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        command = detector["command"]
        assert command[: len(DETECTOR_TLS)] == DETECTOR_TLS
        health = detector["healthcheck"]["test"]
        assert health[:3] == ["CMD", "stablewatch", "health"]
        assert _flag(health, "--tls-ca") == "/tls/ca.pem"
        assert _flag(health, "--tls-cert") == "/tls/detector.pem"
    for name, service in services.items():
        mounts = {v.split(":")[0]: v.split(":")[1:] for v in service.get("volumes", [])}
        assert ("tls-ca" in mounts) == (name == "certs"), f"{name} must not see the CA's key"
        if name in (*DETECTORS.values(), "prometheus"):
            assert mounts["tls"] == [TLS_MOUNT, "ro"], name
    script = MAKE_CERTS.read_text()
    for name in ("detector", "prometheus"):  # the files DETECTOR_TLS and PROMETHEUS_TLS name
        assert f"\nleaf {name} " in script, name


def test_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (.+) \S+$", text, re.MULTILINE):
        for name in source.split():
            assert (ROOT / name).exists(), f"COPY {name}: not in the repository root"
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))
    assert entrypoint == ["stablewatch", "detector", "--listen", f"0.0.0.0:{GRPC_PORT}", "--data-dir", "/data"]
    assert re.search(rf"^EXPOSE {GRPC_PORT} {METRICS_PORT}$", text, re.MULTILINE)
    assert "pip install ." in text


def _copied(dockerfile: Path) -> set[str]:
    """What a Dockerfile COPYs from the build context (the repository root)."""
    sources: set[str] = set()
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile.read_text(), re.MULTILINE):
        sources.update(source.split())
    return sources


@pytest.mark.parametrize("dockerfile", [DEPLOY / "Dockerfile", SPARK / "Dockerfile"], ids=["detector", "spark"])
def test_dockerfile_copies_every_package_folder(dockerfile: Path) -> None:
    """`pip install .` needs every folder pyproject.toml's package-dir maps onto the package, and
    the README it names: the image copies them all."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = _copied(dockerfile)
    assert {"pyproject.toml", "README.md"} <= copied
    for folder in setuptools["package-dir"].values():
        parts = Path(folder).parts
        assert any("/".join(parts[:n]) in copied for n in range(1, len(parts) + 1)), f"{folder} is not copied"


@pytest.mark.parametrize("dockerfile", [DEPLOY / "Dockerfile", SPARK / "Dockerfile"], ids=["detector", "spark"])
def test_dockerfile_has_its_dockerignore(dockerfile: Path) -> None:
    """BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile, in place of the context's
    .dockerignore (the repository root has none): it keeps .venv and .git out of the context, and
    no source the Dockerfile copies."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    patterns = [line for line in ignore.read_text().splitlines() if line and not line.startswith("#")]
    assert {".git", ".venv"} <= set(patterns)
    for source in _copied(dockerfile):
        assert source not in patterns, source


def test_spark_compose_builds_from_the_root() -> None:
    """The Spark compose file builds deploy/spark/Dockerfile from the repository root, so its
    Dockerfile.dockerignore is the one Docker uses."""
    build = _load(SPARK / "docker-compose.yml")["services"]["spark-master"]["build"]
    context = (SPARK / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).resolve() == SPARK / "Dockerfile"


def test_spark_worker_has_a_writable_work_dir() -> None:
    """The worker runs as uid 10001, which cannot write Spark's default $SPARK_HOME/work: its
    command or environment names a work dir that the image makes and gives to that user."""
    worker = _load(SPARK / "docker-compose.yml")["services"]["spark-worker"]
    command = worker["command"]
    environment = worker.get("environment", {})
    work_dir = _flag(command, "--work-dir") if "--work-dir" in command else environment.get("SPARK_WORKER_DIR")
    assert work_dir, "the worker names no work dir"
    dockerfile = (SPARK / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", dockerfile, re.MULTILINE)
    (owned,) = re.findall(r"chown 10001:10001 ([^\n\\]+)", dockerfile)
    assert work_dir in owned.split(), f"{work_dir} is not made writable for uid 10001"


def test_kubernetes_manifests() -> None:
    objects = _k8s()
    assert {"StatefulSet", "Service", "Issuer", "Certificate"} == set(objects)
    (statefulset,), (service,) = objects["StatefulSet"], objects["Service"]
    spec = statefulset["spec"]
    assert spec["replicas"] == 2
    assert spec["podManagementPolicy"] == "Parallel"  # one replica down never holds the other back
    assert spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per replica
    pod = spec["template"]
    labels = pod["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    # Scraped by deploy/prometheus/kubernetes.yml with a replica label, not by a generic job.
    assert not any(key.startswith("prometheus.io/") for key in pod["metadata"].get("annotations", {}))
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}
    # Each replica its own store: a claim per pod, not a volume the pods share.
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == data["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert data["name"] not in {v["name"] for v in pod["spec"]["volumes"]}
    assert _flag(container["args"], "--archive").startswith("/data/")
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert service_ports == {"grpc": (GRPC_PORT, "grpc"), "metrics": (METRICS_PORT, "metrics")}
    assert "prometheus.io/scrape" not in service["metadata"].get("annotations", {})


def test_kubernetes_replica_is_the_pod_index() -> None:
    """--replica comes from the pod's index label through the downward API, as $(VAR) expansion."""
    (statefulset,) = _k8s()["StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    env = {variable["name"]: variable for variable in container["env"]}
    reference = re.fullmatch(r"\$\((\w+)\)", _flag(container["args"], "--replica"))
    assert reference is not None, container["args"]
    source = env[reference.group(1)]["valueFrom"]["fieldRef"]["fieldPath"]
    assert source == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert container["args"].count("--replica") == 1


def test_kubernetes_runs_mutual_tls_with_cert_manager() -> None:
    """The detectors mount the Secret their Certificate fills, it names each replica, and their
    probes speak TLS."""
    objects = _k8s()
    (statefulset,) = objects["StatefulSet"]
    certificates = {c["metadata"]["name"]: c["spec"] for c in objects["Certificate"]}
    issuers = {i["metadata"]["name"]: i["spec"] for i in objects["Issuer"]}
    for name, certificate in certificates.items():
        assert certificate["issuerRef"]["name"] in issuers, name
    assert certificates["stablewatch-ca"]["isCA"] is True
    assert issuers["stablewatch-ca"]["ca"]["secretName"] == certificates["stablewatch-ca"]["secretName"]

    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (tls,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    assert tls["readOnly"] is True
    secret = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]["secretName"]
    (detector,) = [c for c in certificates.values() if c["secretName"] == secret]
    service = statefulset["spec"]["serviceName"]
    assert service in detector["dnsNames"]  # the Service's name, where the CLI dials
    for index in range(statefulset["spec"]["replicas"]):  # each replica's name, where agents dial
        pod_name = f"{statefulset['metadata']['name']}-{index}.{service}"
        assert {pod_name, f"{pod_name}.monitoring.svc", f"{pod_name}.monitoring.svc.cluster.local"} <= set(
            detector["dnsNames"]
        )
    assert "127.0.0.1" in detector["ipAddresses"]  # the probes dial it there
    assert {"server auth", "client auth"} <= set(detector["usages"])  # client: the probes show it
    args = container["args"]
    files = {"--tls-cert": "tls.crt", "--tls-key": "tls.key", "--tls-client-ca": "ca.crt"}
    for flag, file in files.items():
        assert _flag(args, flag) == f"{tls['mountPath']}/{file}", flag
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["stablewatch", "health"], probe
        assert _flag(command, "--detector") == f"127.0.0.1:{GRPC_PORT}", probe
        assert _flag(command, "--tls-ca") == f"{tls['mountPath']}/ca.crt", probe

    uris = {name: c.get("uris", []) for name, c in certificates.items()}
    assert uris["stablewatch-operator"] == ["stablewatch://role/operator"]
    assert uris["stablewatch-reader"] == ["stablewatch://role/reader"]
    assert any(u.startswith("stablewatch://process/") for name, us in uris.items() for u in us if "agent" in name)


# -- the certificates make-certs.sh makes, with the real detector -------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of make-certs.sh for agents orders-1 and pay.ments (needs openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH; the certificates of deploy/tls/make-certs.sh were not tried")
    folder = tmp_path_factory.mktemp("made")
    run = [str(MAKE_CERTS), str(folder / "ca"), str(folder / "tls")]
    for _ in range(2):  # the second run keeps what the first made
        subprocess.run([*run, "orders-1", "pay.ments"], check=True, capture_output=True, timeout=120)
    return folder / "tls"


def _sans(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(getattr(name, "value", name)) for name in names]


def _scrape_as(url: str, server_name: str, made: Path) -> bytes:
    """GET a detector's /metrics as Prometheus does, verifying its certificate for ``server_name``
    (a compose service name that does not resolve here, so the socket dials the URL's address)."""
    context = ssl.create_default_context(cafile=made / "ca.pem")
    context.load_cert_chain(made / "prometheus.pem", made / "prometheus-key.pem")
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as tls,
    ):
        tls.sendall(f"GET /metrics HTTP/1.0\r\nHost: {server_name}:{port}\r\n\r\n".encode())
        response = b"".join(iter(lambda: tls.recv(65536), b""))
    assert response.startswith(b"HTTP/1.0 200") or response.startswith(b"HTTP/1.1 200"), response[:200]
    return response


def test_make_certs_names_each_identity(made: Path) -> None:
    assert "stablewatch://process/orders-1" in _sans(made / "agent-orders-1.pem")
    assert "stablewatch://role/operator" in _sans(made / "operator.pem")
    assert "stablewatch://role/reader" in _sans(made / "reader.pem")
    assert not any(name.startswith("stablewatch://") for name in _sans(made / "prometheus.pem"))
    assert {"detector", *DETECTORS.values(), "localhost", "127.0.0.1"} <= set(_sans(made / "detector.pem"))
    assert not (made / "ca-key.pem").exists()  # the CA's key stays in the CA folder
    bad = subprocess.run(
        [str(MAKE_CERTS), str(made.parent / "ca"), str(made), "not/an id"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "may only hold" in bad.stderr
    for clash in ("stablewatch-detector", "detector-0", "localhost"):  # would serve as the detector
        taken = subprocess.run(
            [str(MAKE_CERTS), str(made.parent / "ca"), str(made), clash], capture_output=True, text=True, timeout=60
        )
        assert taken.returncode == 2, clash
        assert "a name of the detectors' certificate" in taken.stderr
        assert not (made / f"agent-{clash}.pem").exists()


def test_made_certificates_work_with_the_detector(made: Path, tmp_path: Path) -> None:
    """Each certificate of make-certs.sh can do its job against a real mutual-TLS detector, and only that."""
    config = DetectorConfig(
        data_dir=tmp_path,
        listen="127.0.0.1:0",
        metrics_port=0,
        interval=None,
        tls_cert=made / "detector.pem",
        tls_key=made / "detector-key.pem",
        tls_client_ca=made / "ca.pem",
    )
    running = Running(config)

    def client(name: str) -> DetectorClient:
        creds = channel_credentials(made / "ca.pem", made / f"{name}.pem", made / f"{name}-key.pem")
        return DetectorClient(running.detector.address, timeout=10, credentials=creds)

    def register(name: str, process_id: str) -> str:
        # The blocking client: a grpc.aio one may see INTERNAL for a stream refused before it is read.
        creds = channel_credentials(made / "ca.pem", made / f"{name}.pem", made / f"{name}-key.pem")
        code, reply = register_stream(running.detector.address, creds, process_id, timeout=10)
        return reply if code == grpc.StatusCode.OK else code.name

    try:
        assert register("agent-orders-1", "orders-1") == "registered"
        assert register("agent-orders-1", "pay.ments") == "PERMISSION_DENIED"
        assert register("operator", "orders-1") == "PERMISSION_DENIED"
        with client("reader") as reader:
            reader.members()
            with pytest.raises(DetectorError) as caught:
                reader.trigger_snapshot(1)
            assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
        with client("operator") as operator, pytest.raises(DetectorError) as caught:
            operator.trigger_snapshot(1)
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION  # allowed; no agent is attached
        with client("prometheus") as prometheus, pytest.raises(DetectorError) as caught:
            prometheus.members()
        assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
        with client("detector") as probe:
            assert probe.health() == "SERVING"
        url = running.detector.metrics_url
        assert url is not None
        # Prometheus scrapes detector-0:9464 and detector-1:9464 in compose, with its certificate:
        # names the detector's certificate must carry.
        for name in DETECTORS.values():
            assert b"stablewatch_refused_total" in _scrape_as(url, name, made), name
    finally:
        running.stop()
