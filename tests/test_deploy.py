"""The deployment files in deploy/: they parse, they name only metrics that exist, and they agree.

The metric names are taken from the real code (``DetectorMetrics`` and ``AgentMetrics``), so a
renamed metric breaks this test instead of silently breaking an alert or a dashboard panel. The
alert rules' behaviour is tested by ``promtool test rules`` when promtool is on PATH.

The deployments run mutual TLS: the compose file, the Kubernetes manifests and the Prometheus
scrape config must name the certificate files that deploy/tls/make-certs.sh (compose) or
cert-manager (Kubernetes) make, and, when openssl is on PATH, the certificates the script makes
must work with the real detector: each identity can do what it is for, and no more.
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from control_streams import register as register_stream
from cryptography import x509

from stablewatch.agents.certificates import channel_credentials
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.cli.client import DetectorClient, DetectorError
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.metrics import DetectorMetrics
from stablewatch.testing.detector import Running

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/ (it belongs in the dev extra)")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "stablewatch-dashboard.json"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
KUBERNETES = DEPLOY / "kubernetes"
MAKE_CERTS = DEPLOY / "tls" / "make-certs.sh"
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

ALERTS = {
    "StablewatchDeadlock",
    "StablewatchConservationViolated",
    "StablewatchCutOpen",
    "StablewatchNoRecentSnapshot",
    "StablewatchSnapshotsAborting",
    "StablewatchPartsRejected",
    "StablewatchRefused",
    "StablewatchNoAgents",
    "StablewatchDeadlockBroken",
    "StablewatchBreakUnanswered",
}
GRPC_PORT = int(DetectorConfig().listen.rsplit(":", 1)[1])
METRICS_PORT = DetectorConfig().metrics_port
DS = "${DS_PROMETHEUS}"
# A PromQL identifier that names a stablewatch series or recording rule.
_NAME = re.compile(r"(?<![\w:])stablewatch[_:][\w:]*")
_PROMTOOL_MISSING = "promtool is not on PATH (Debian: apt-get install prometheus); the rule unit tests did not run"


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


def _promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(_PROMTOOL_MISSING)
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


# -- parsing ------------------------------------------------------------------------------------------------


def test_every_file_parses() -> None:
    yaml_files = sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])
    assert len(yaml_files) >= 10, yaml_files
    for path in yaml_files:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert documents, f"{path} is empty"
    assert _dashboard()["panels"]


def test_metric_names_are_collected(detector_names: set[str], agent_names: set[str]) -> None:
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
    assert not any(name.startswith("stablewatch_agent_") for name in detector_names)


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
    assert 'stablewatch_deadlocks_resolved_total{outcome=~"unanswered|not_attached"}' in unanswered["expr"]
    for rule in (broken, unanswered):
        assert rule["for"] == "0s"
        assert "stablewatch resolutions" in rule["annotations"]["description"]


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


def test_promtool_checks_config_and_rules(tmp_path: Path, pki: dict[str, Path]) -> None:
    """promtool checks that the TLS files exist: a copy of the folder points them at test certificates."""
    folder = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, folder)
    tls = tmp_path / "tls"
    tls.mkdir()
    for name, source in (
        ("ca.pem", "ca_cert"),
        ("prometheus.pem", "nobody_cert"),
        ("prometheus-key.pem", "nobody_key"),
    ):
        shutil.copy(pki[source], tls / name)
    config = folder / "prometheus.yml"
    config.write_text(config.read_text().replace(f"{TLS_MOUNT}/", f"{tls}/"))
    result = _promtool("check", "config", "prometheus.yml", cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    result = _promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


# -- Prometheus configuration -------------------------------------------------------------------------------


def test_prometheus_config() -> None:
    config = _load(PROMETHEUS / "prometheus.yml")
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS / rule_file).is_file(), rule_file
    assert "alerts.yml" in config["rule_files"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"stablewatch-detector", "stablewatch-agents"}
    targets = [t for group in jobs["stablewatch-detector"]["static_configs"] for t in group["targets"]]
    assert targets == [f"localhost:{METRICS_PORT}"]
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


# -- Grafana dashboard --------------------------------------------------------------------------------------


def test_dashboard_uses_only_real_metrics(detector_names: set[str], agent_names: set[str]) -> None:
    names = _names(iter(_dashboard_expressions()))
    assert names - detector_names - agent_names == set()
    assert "stablewatch_snapshot_duration_seconds_bucket" in names
    assert "stablewatch_agent_messages_sent_total" in names


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
    assert set(services) == {"certs", "detector", "prometheus", "grafana"}
    build = services["detector"]["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    ports = {p.split(":")[-1] for p in services["detector"]["ports"]}
    assert {str(GRPC_PORT), str(METRICS_PORT), "9090"} <= ports
    # Prometheus shares the detector's network, so prometheus.yml's localhost target reaches it.
    assert services["prometheus"]["network_mode"] == "service:detector"
    assert "prometheus" in services["detector"]["networks"]["default"]["aliases"]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{source} is mounted but does not exist"
            else:
                assert source in compose["volumes"], source
    mounted = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert "/etc/prometheus" in mounted


def test_compose_runs_mutual_tls() -> None:
    """The certs service makes the files before the detector starts; only it holds the CA's key."""
    services = _load(COMPOSE)["services"]
    certs, detector = services["certs"], services["detector"]
    assert f"../tls/{MAKE_CERTS.name}:/make-certs.sh:ro" in certs["volumes"]
    assert certs["command"] == ["/ca", TLS_MOUNT]
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
        if name in ("detector", "prometheus"):
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


def test_kubernetes_manifests() -> None:
    objects = _k8s()
    assert {"Deployment", "Service", "PersistentVolumeClaim", "Issuer", "Certificate"} == set(objects)
    (deployment,), (service,), (claim,) = objects["Deployment"], objects["Service"], objects["PersistentVolumeClaim"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]
    labels = pod["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/scheme"] == "https"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[data["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert service_ports == {"grpc": (GRPC_PORT, "grpc"), "metrics": (METRICS_PORT, "metrics")}
    assert "prometheus.io/scrape" not in service["metadata"].get("annotations", {})  # scraped once, per pod


def test_kubernetes_runs_mutual_tls_with_cert_manager() -> None:
    """The detector mounts the Secret its Certificate fills, and its probes speak TLS."""
    objects = _k8s()
    (deployment,) = objects["Deployment"]
    certificates = {c["metadata"]["name"]: c["spec"] for c in objects["Certificate"]}
    issuers = {i["metadata"]["name"]: i["spec"] for i in objects["Issuer"]}
    for name, certificate in certificates.items():
        assert certificate["issuerRef"]["name"] in issuers, name
    assert certificates["stablewatch-ca"]["isCA"] is True
    assert issuers["stablewatch-ca"]["ca"]["secretName"] == certificates["stablewatch-ca"]["secretName"]

    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (tls,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    assert tls["readOnly"] is True
    secret = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]["secretName"]
    (detector,) = [c for c in certificates.values() if c["secretName"] == secret]
    assert "stablewatch-detector" in detector["dnsNames"]  # the Service's name, where agents dial
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


def test_make_certs_names_each_identity(made: Path) -> None:
    assert "stablewatch://process/orders-1" in _sans(made / "agent-orders-1.pem")
    assert "stablewatch://role/operator" in _sans(made / "operator.pem")
    assert "stablewatch://role/reader" in _sans(made / "reader.pem")
    assert not any(name.startswith("stablewatch://") for name in _sans(made / "prometheus.pem"))
    assert {"detector", "localhost", "127.0.0.1"} <= set(_sans(made / "detector.pem"))
    assert not (made / "ca-key.pem").exists()  # the CA's key stays in the CA folder
    bad = subprocess.run(
        [str(MAKE_CERTS), str(made.parent / "ca"), str(made), "not/an id"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "may only hold" in bad.stderr


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
        context = ssl.create_default_context(cafile=made / "ca.pem")
        context.load_cert_chain(made / "prometheus.pem", made / "prometheus-key.pem")
        url = running.detector.metrics_url
        assert url is not None
        # Prometheus scrapes localhost:9464 in compose: a name the certificate must carry.
        with urllib.request.urlopen(url.replace("127.0.0.1", "localhost"), timeout=10, context=context) as response:
            assert b"stablewatch_refused_total" in response.read()
    finally:
        running.stop()
