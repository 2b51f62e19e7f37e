"""Alerts once: two detectors see one deadlock, Prometheus raises one alert, Alertmanager sends it
once, and a detector's death changes nothing of it.

The deploy/ configuration, run for real on loopback: two detectors side by side (``--replica 0``
and ``--replica 1``), two agents deadlocked on each other and attached to both
(``stablewatch.testing.deadlock_node --detector A,B``), Debian's Prometheus scraping both
detectors (each target labelled with its replica) with the alert rules of deploy/prometheus, which
merge the replicas in the rule, and the ``alerting`` section of deploy/prometheus/prometheus.yml,
Debian's Alertmanager with deploy/alertmanager/alertmanager.yml, and a webhook receiver written
here that records every notification. Only the addresses and the timings are the test's own
(seconds, not minutes).

The processes are started once for the module, in this order of tests:

1. Both detectors report the deadlock (two series in Prometheus, one per replica), Prometheus holds
   one firing ``StablewatchDeadlock`` alert, without instance or replica, and the receiver gets
   exactly one notification, and still one after Prometheus has sent the alert again past two of
   Alertmanager's group intervals.
2. Replica 1 is killed. Prometheus finds its target down and notices it (``StablewatchDetectorDown``
   pending), and through many evaluations and resends after that the deadlock alert stays the same
   firing alert in Prometheus and active in Alertmanager, with no resolved and no second firing
   notification.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from command_line import DetectorProcess, LineReader
from prometheus_client.parser import text_string_to_metric_families

from polling import poll
from stablewatch.testing.deadlock_node import DeadlockProcess, introduce

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/ (it belongs in the dev extra)")

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS_YML = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTMANAGER_YML = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
ALERT = "StablewatchDeadlock"
DOWN_ALERT = "StablewatchDetectorDown"
JOB = "stablewatch-detector"
# The deadlock alert's labels, in Prometheus and in Alertmanager: no instance, no replica.
DEADLOCK_LABELS = {"alertname": ALERT, "job": JOB, "predicate": "deadlock", "severity": "critical"}
REPLICAS = (0, 1)
DYING = 1  # the replica the second test kills

# Timings: Prometheus scrapes and evaluates twice a second and sends a firing alert again every
# RESEND s; a firing alert it sent lives in Alertmanager for 4 * RESEND s unless sent again, so a
# stall of the machine shorter than that never resolves it. Alertmanager notifies a new group
# after GROUP_WAIT, and a changed one at most every GROUP_INTERVAL.
SCRAPE = "500ms"
RESEND = 2.0
GROUP_WAIT = 1.0
GROUP_INTERVAL = 2.0

DEBIAN_PACKAGES = "prometheus prometheus-alertmanager"
_LISTENING = re.compile(r'msg="Listening on" address=(\S+)')


@dataclass(frozen=True)
class Binaries:
    """Debian's Prometheus and Alertmanager (its binary is prometheus-alertmanager there)."""

    prometheus: str
    alertmanager: str
    amtool: str


@pytest.fixture(scope="module")
def binaries() -> Binaries:
    """The programs the test runs; it skips, before starting anything, when one is missing."""
    found: dict[str, str] = {}
    for role, names in (
        ("prometheus", ("prometheus",)),
        ("alertmanager", ("alertmanager", "prometheus-alertmanager")),
        ("amtool", ("amtool",)),
    ):
        path = next((path for name in names if (path := shutil.which(name))), None)
        if path is None:
            pytest.skip(f"{' or '.join(names)} is not on PATH (Debian: apt-get install {DEBIAN_PACKAGES})")
        found[role] = path
    return Binaries(**found)


# -- the processes ------------------------------------------------------------------------------------------


class Server:
    """A Prometheus or an Alertmanager, started on 127.0.0.1:0: its address is read from its log."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log = LineReader(self.process.stderr)  # drained, so the server never blocks on a full pipe
        try:
            self.address = poll(self._listening, f"{name} to listen", timeout=60, interval=0.05)
        except BaseException:
            self.stop()
            raise

    def _listening(self) -> str | None:
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.process.returncode}:\n{self.logged()}")
        for line in list(self.log.seen):
            if match := _LISTENING.search(line):
                return match.group(1)
        return None

    def logged(self) -> str:
        return "".join(self.log.seen)[-4000:]

    def get(self, path: str, **query: str) -> Any:
        """GET a JSON document of the server's HTTP API."""
        url = f"http://{self.address}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@dataclass
class Webhook:
    """Alertmanager's webhook receiver: records every POST (its JSON body and when it came)."""

    server: HTTPServer
    received: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/stablewatch"

    def notifications(self, alertname: str) -> list[tuple[float, dict[str, Any]]]:
        """The notifications of the groups of ``alertname``, oldest first."""
        with self.lock:
            return [(at, body) for at, body in self.received if body["groupLabels"].get("alertname") == alertname]


@pytest.fixture(scope="module")
def webhook() -> Iterator[Webhook]:
    hook: Webhook

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with hook.lock:
                hook.received.append((time.time(), body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    hook = Webhook(HTTPServer(("127.0.0.1", 0), Handler))
    thread = threading.Thread(target=hook.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield hook
    hook.server.shutdown()
    hook.server.server_close()
    thread.join(timeout=10)


def alertmanager_config(webhook_url: str) -> dict[str, Any]:
    """deploy/alertmanager/alertmanager.yml with the test's receiver URL and timings."""
    config = yaml.safe_load(ALERTMANAGER_YML.read_text())
    route = config["route"]
    route["group_wait"] = f"{GROUP_WAIT:g}s"
    route["group_interval"] = f"{GROUP_INTERVAL:g}s"
    receivers = {receiver["name"]: receiver for receiver in config["receivers"]}
    (hook,) = receivers[route["receiver"]]["webhook_configs"]
    hook["url"] = webhook_url
    return config


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("alertmanager")


@pytest.fixture(scope="module")
def alertmanager(workspace: Path, binaries: Binaries, webhook: Webhook) -> Iterator[Server]:
    path = workspace / "alertmanager.yml"
    path.write_text(yaml.safe_dump(alertmanager_config(webhook.url)))
    check = subprocess.run([binaries.amtool, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    command = [binaries.alertmanager, f"--config.file={path}", f"--storage.path={workspace / 'alertmanager-data'}"]
    command += ["--web.listen-address=127.0.0.1:0", "--cluster.listen-address="]  # one: no cluster
    server = Server("Alertmanager", command)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def killed() -> set[int]:
    """The replicas a test killed on purpose (SIGKILL): their exit status is the signal's."""
    return set()


@pytest.fixture(scope="module")
def detectors(workspace: Path, killed: set[int]) -> Iterator[dict[int, DetectorProcess]]:
    """Replicas 0 and 1, each with its own store, snapshotting five times a second."""
    running: dict[int, DetectorProcess] = {}
    try:
        for replica in REPLICAS:
            running[replica] = DetectorProcess(
                workspace / f"detector-{replica}", "--replica", str(replica), "--interval", "0.2", "--deadline", "5"
            )
        yield running
    finally:
        codes = {replica: detector.stop() for replica, detector in running.items()}
        for replica, detector in running.items():
            print(f"--- detector {replica} ---\n{''.join(detector.stderr.seen)[-2000:]}")
        assert codes == {r: -signal.SIGKILL if r in killed else 0 for r in running}, codes


def prometheus_config(detectors: dict[int, DetectorProcess], alertmanager: str) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with the test's targets and timings: its detector job in
    plaintext, each replica's target replaced by that replica's detector, its alerting section as
    it is pointed at the test's Alertmanager; the rules of alerts.yml (the merging under test)."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"] = {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE}
    config["rule_files"] = [str(ALERTS_YML)]
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "stablewatch-detector"]
    job.pop("scheme")
    job.pop("tls_config")
    for group in job["static_configs"]:
        metrics = urllib.parse.urlsplit(detectors[int(group["labels"]["replica"])].metrics)
        group["targets"] = [metrics.netloc]
    assert {int(group["labels"]["replica"]) for group in job["static_configs"]} == set(REPLICAS)
    config["scrape_configs"] = [job]
    config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [alertmanager]}]}]
    return config


@pytest.fixture(scope="module")
def prometheus(
    workspace: Path, binaries: Binaries, detectors: dict[int, DetectorProcess], alertmanager: Server
) -> Iterator[Server]:
    path = workspace / "prometheus.yml"
    path.write_text(yaml.safe_dump(prometheus_config(detectors, alertmanager.address)))
    command = [binaries.prometheus, f"--config.file={path}", f"--storage.tsdb.path={workspace / 'prometheus-data'}"]
    command += ["--web.listen-address=127.0.0.1:0", f"--rules.alert.resend-delay={RESEND:g}s"]
    server = Server("Prometheus", command)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def deadlocked(detectors: dict[int, DetectorProcess]) -> Iterator[list[DeadlockProcess]]:
    """A and B, each attached to both detectors, each holding its lock and waiting for the other's."""
    both = ",".join(detectors[replica].address for replica in REPLICAS)
    nodes: list[DeadlockProcess] = []
    try:
        nodes = [DeadlockProcess("A", "B", "asyncio", both), DeadlockProcess("B", "A", "asyncio", both)]
        introduce(nodes)
        for node in nodes:  # both hold their own lock first: "go" then deadlocks them for sure
            node.command("hold")
            node.expect("holding")
        for node in nodes:
            node.command("go")
        yield nodes
    finally:
        codes = [node.stop() for node in nodes]
        for node in nodes:
            print(f"--- {node.process_id} ---\n{node.log()}")
        assert codes == [0] * len(nodes), codes


# -- what the test reads ------------------------------------------------------------------------------------


def scrape(detector: DetectorProcess) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """A detector's /metrics: each sample's value by name and labels."""
    with urllib.request.urlopen(detector.metrics, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def deadlock_reported(detector: DetectorProcess) -> bool:
    return scrape(detector).get("stablewatch_predicate_value", {}).get((("predicate", "deadlock"),)) == 1.0


def alerts(prometheus: Server, alertname: str = ALERT) -> list[dict[str, Any]]:
    """Prometheus' alerts named ``alertname`` (pending or firing), as its API gives them."""
    return [a for a in prometheus.get("/api/v1/alerts")["data"]["alerts"] if a["labels"]["alertname"] == alertname]


def firing(prometheus: Server) -> list[dict[str, str]]:
    """The labels of Prometheus' firing alerts named ALERT."""
    return [a["labels"] for a in alerts(prometheus) if a["state"] == "firing"]


def query(prometheus: Server, expr: str) -> list[dict[str, Any]]:
    """An instant query's samples: each with its ``metric`` (labels) and ``value`` ([time, text])."""
    return prometheus.get("/api/v1/query", query=expr)["data"]["result"]


def last_evaluation(prometheus: Server, group: str = "stablewatch-alerts") -> float:
    """When Prometheus last evaluated the rule group (seconds since the epoch)."""
    (found,) = [g for g in prometheus.get("/api/v1/rules")["data"]["groups"] if g["name"] == group]
    return _timestamp(found["lastEvaluation"])


def held(alertmanager: Server) -> list[dict[str, Any]]:
    """Alertmanager's alerts named ALERT, active or not."""
    return alertmanager.get("/api/v2/alerts", filter=f'alertname="{ALERT}"')


def _timestamp(text: str) -> float:
    """An RFC 3339 time of Alertmanager's API (nanoseconds and all) as seconds since the epoch."""
    text = re.sub(r"(\.\d{6})\d+", r"\1", text).replace("Z", "+00:00")
    return datetime.fromisoformat(text).timestamp()


# -- the tests ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """Everything the module started: what the tests look at, and their logs when one fails."""

    alertmanager: Server
    detectors: dict[int, DetectorProcess]
    prometheus: Server
    webhook: Webhook
    deadlocked: list[DeadlockProcess]

    @contextlib.contextmanager
    def logs_on_failure(self) -> Iterator[None]:
        """Print Prometheus', Alertmanager's and the receiver's logs when the block fails."""
        try:
            yield
        except BaseException:
            print(f"--- Prometheus ---\n{self.prometheus.logged()}\n--- Alertmanager ---\n{self.alertmanager.logged()}")
            bodies = [body for _, body in self.webhook.received]
            print(f"--- webhook ---\n{json.dumps(bodies, indent=1)[-4000:]}")
            raise


@pytest.fixture(scope="module")
def stack(
    alertmanager: Server,  # first: it skips before any detector starts when a program is missing
    detectors: dict[int, DetectorProcess],
    prometheus: Server,
    webhook: Webhook,
    deadlocked: list[DeadlockProcess],
) -> Stack:
    return Stack(alertmanager, detectors, prometheus, webhook, deadlocked)


@dataclass(frozen=True)
class Notified:
    """The deadlock's one notification: when the receiver got it, and the alert as Prometheus holds it."""

    at: float
    active_at: str  # the alert's activeAt in Prometheus: the same for as long as it never resolves


@pytest.fixture(scope="module")
def notified(stack: Stack) -> Notified:
    """Both detectors report the deadlock, Prometheus fires one alert for it, and the receiver has
    had its notification: the state both tests start from."""
    with stack.logs_on_failure():
        # Both agents attach to both detectors, and each detector proves the deadlock on its own.
        for replica, detector in stack.detectors.items():
            poll(
                lambda d=detector: scrape(d).get("stablewatch_agents_attached", {}).get(()) == 2.0,
                f"both agents attached to detector {replica}",
                timeout=60,
                interval=0.1,
            )
        for replica, detector in stack.detectors.items():
            poll(lambda d=detector: deadlock_reported(d), f"detector {replica} reporting the deadlock", 60, 0.1)
        poll(lambda: len(firing(stack.prometheus)) == 1, "the deadlock alert firing in Prometheus", 60, 0.2)
        poll(lambda: stack.webhook.notifications(ALERT), "the deadlock's notification", timeout=60, interval=0.1)
        ((at, _),) = stack.webhook.notifications(ALERT)
        (alert,) = alerts(stack.prometheus)
        return Notified(at, alert["activeAt"])


def _one_deadlock_alert(stack: Stack, notified: Notified) -> None:
    """What must hold all along: one deadlock alert, firing since the start in Prometheus, active in
    Alertmanager, notified once."""
    (alert,) = alerts(stack.prometheus)
    assert alert["labels"] == DEADLOCK_LABELS, alert
    assert alert["state"] == "firing" and alert["activeAt"] == notified.active_at, alert
    held_now = held(stack.alertmanager)
    assert [a["labels"] for a in held_now] == [DEADLOCK_LABELS], held_now
    assert held_now[0]["status"]["state"] == "active", held_now
    assert _timestamp(held_now[0]["endsAt"]) > time.time(), held_now
    assert len(stack.webhook.notifications(ALERT)) == 1, stack.webhook.notifications(ALERT)


def _resent_after(moment: float, stack: Stack, notified: Notified) -> Callable[[], bool]:
    """A poll condition: true once Prometheus has evaluated the rules, and Alertmanager has had the
    alert again, later than ``moment`` plus two group intervals and a resend, so that a resolved or
    repeated notification would have gone out by then; ``_one_deadlock_alert`` holds at every look."""
    bound = moment + 2 * GROUP_INTERVAL + RESEND

    def condition() -> bool:
        _one_deadlock_alert(stack, notified)
        (active,) = held(stack.alertmanager)
        return last_evaluation(stack.prometheus) > bound and _timestamp(active["updatedAt"]) > bound

    return condition


def test_one_deadlock_seen_by_two_detectors_is_notified_once(stack: Stack, notified: Notified) -> None:
    prometheus, webhook = stack.prometheus, stack.webhook
    assert all(d.process.poll() is None for d in stack.detectors.values()), "runs before the failover test"
    with stack.logs_on_failure():
        # Prometheus holds both replicas' reports, and merges them into one alert in the rule.
        reports = query(prometheus, 'stablewatch_predicate_value{predicate="deadlock"} == 1')
        assert sorted(r["metric"]["replica"] for r in reports) == [str(r) for r in REPLICAS]
        assert len({r["metric"]["instance"] for r in reports}) == len(REPLICAS)
        assert firing(prometheus) == [DEADLOCK_LABELS]

        # Alertmanager holds one alert and notifies once.
        ((_, notification),) = webhook.notifications(ALERT)
        assert notification["status"] == "firing"
        assert notification["groupLabels"] == {"alertname": ALERT, "job": JOB}
        (alert,) = notification["alerts"]
        assert alert["labels"] == DEADLOCK_LABELS
        assert alert["status"] == "firing"

        # Prometheus sends the alert again every RESEND s, and Alertmanager flushes the group every
        # GROUP_INTERVAL s: once it has an update from past two flushes after the notification, a
        # duplicate would have been sent. Until then (and after), one alert and one notification.
        poll(_resent_after(notified.at, stack, notified), "two group intervals", 60, 0.2)
        assert len(query(prometheus, 'stablewatch_predicate_value{predicate="deadlock"} == 1')) == len(REPLICAS)
        assert all(node.process.poll() is None for node in stack.deadlocked)  # still deadlocked, nobody broke it


def test_the_alert_outlives_a_detector(stack: Stack, notified: Notified, killed: set[int]) -> None:
    """Replica 1 dies: its series end, the merged one goes on from replica 0's, and nobody is told
    the deadlock resolved or formed again."""
    prometheus = stack.prometheus
    with stack.logs_on_failure():
        _one_deadlock_alert(stack, notified)
        dying = stack.detectors[DYING]
        instance = urllib.parse.urlsplit(dying.metrics).netloc
        killed.add(DYING)
        assert dying.stop(signal.SIGKILL) == -signal.SIGKILL

        # Prometheus's next scrape of it fails: `up` is 0, and its series end (staleness markers).
        def down() -> float | None:
            _one_deadlock_alert(stack, notified)
            (up,) = query(prometheus, f'up{{job="{JOB}", replica="{DYING}"}}')
            return time.time() if up["value"][1] == "0" else None

        down_at = poll(down, f"Prometheus to find replica {DYING} down", timeout=30, interval=0.1)
        reports = query(prometheus, 'stablewatch_predicate_value{predicate="deadlock"} == 1')
        assert [r["metric"]["replica"] for r in reports] == [str(r) for r in REPLICAS if r != DYING]

        # The dead detector is noticed: StablewatchDetectorDown is pending for it (firing after
        # its `for`, a minute), a different alert from the deadlock's.
        (pending,) = poll(lambda: alerts(prometheus, DOWN_ALERT), f"{DOWN_ALERT} for replica {DYING}", 30, 0.1)
        assert pending["state"] == "pending", pending
        assert pending["labels"] == {
            "alertname": DOWN_ALERT,
            "job": JOB,
            "instance": instance,
            "replica": str(DYING),
            "severity": "warning",
        }

        # Through many evaluations, resends and group flushes after that, the deadlock alert is the
        # one it was: firing since the start in Prometheus, active in Alertmanager, notified once.
        poll(_resent_after(down_at, stack, notified), "two group intervals after the death", 60, 0.2)
        ((_, notification),) = stack.webhook.notifications(ALERT)
        assert notification["status"] == "firing"
        assert all(node.process.poll() is None for node in stack.deadlocked)  # still deadlocked
        assert deadlock_reported(stack.detectors[next(r for r in REPLICAS if r != DYING)])
