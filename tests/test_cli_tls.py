"""The secure setup as an operator runs it: ``stablewatch detector`` with mutual TLS, agents with
their certificates, and the CLI with a reader's or an operator's certificate.

The detector and two token_node agents run as OS processes (the agents' one node certificate names
processes A, B and C: tests/certs.py). The CLI runs as a subprocess too; flag errors in-process.
"""

from __future__ import annotations

import json
import shutil
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from command_line import DetectorProcess, stablewatch

from polling import poll
from stablewatch.cli.main import main
from stablewatch.testing.token_nodes import Node, connect_all

pytestmark = pytest.mark.timeout(120)


class Secure:
    def __init__(self, detector: DetectorProcess, pki: dict[str, Path]) -> None:
        self.detector = detector
        self.pki = pki

    def cli(self, command: str, role: str | None, *args: str) -> tuple[int, str, str]:
        """Run a query command as `role` (a certificate of the pki; None: trust the CA, show none)."""
        tls = ["--tls-ca", str(self.pki["ca_cert"])]
        if role is not None:
            tls += ["--tls-cert", str(self.pki[f"{role}_cert"]), "--tls-key", str(self.pki[f"{role}_key"])]
        done = stablewatch(command, "--detector", self.detector.address, *tls, *args)
        return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path]) -> Iterator[Secure]:
    folder = tmp_path_factory.mktemp("secure")
    tls_dir = folder / "tls"  # what token_node --tls-dir reads
    tls_dir.mkdir()
    shutil.copy(pki["server_cert"], tls_dir / "node.pem")
    shutil.copy(pki["server_key"], tls_dir / "node.key")
    shutil.copy(pki["ca_cert"], tls_dir / "ca.pem")
    server = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    detector = DetectorProcess(folder / "data", *server, "--tls-client-ca", str(pki["ca_cert"]), "--interval", "off")
    nodes: list[Node] = []
    try:
        for process_id in ("A", "B"):
            nodes.append(Node(process_id, "--tokens", "10", "--detector", detector.address, "--tls-dir", str(tls_dir)))
        connect_all(nodes)
        yield Secure(detector, pki)
    finally:
        for node in nodes:
            node.stop()
        status = detector.stop()
    assert status == 0, "".join(detector.stderr.seen)


def test_agents_attach_and_an_operator_takes_a_snapshot(secure: Secure) -> None:
    def members() -> set[str]:
        code, out, err = secure.cli("status", "reader", "--json")
        assert code == 0, err
        return {member["process_id"] for member in json.loads(out)["members"]}

    poll(lambda: members() == {"A", "B"}, "A and B to attach over mutual TLS", 30)
    code, out, err = secure.cli("snapshot", "operator", "--json", "--timeout", "10")
    assert code == 0, err
    assert json.loads(out)["outcome"] == "completed"


def test_a_reader_cannot_take_a_snapshot(secure: Secure) -> None:
    code, out, err = secure.cli("snapshot", "reader", "--json")
    assert code == 1
    assert json.loads(out)["code"] == "PERMISSION_DENIED"
    assert "needs a client certificate with the URI SAN stablewatch://role/operator" in err


def test_only_an_operator_may_break_a_deadlock(secure: Secure) -> None:
    code, out, err = secure.cli("resolve", "reader", "1", "--json")
    assert code == 1
    assert json.loads(out)["code"] == "PERMISSION_DENIED"
    assert "ResolveDeadlock needs a client certificate with the URI SAN stablewatch://role/operator" in err
    # The operator gets past the check to the detector's answer: there is no such snapshot.
    code, out, err = secure.cli("resolve", "operator", "999999", "--json")
    assert code == 1
    assert json.loads(out)["code"] == "NOT_FOUND", err
    # Reading the breaks is a reader's right.
    code, out, err = secure.cli("resolutions", "reader", "--json")
    assert code == 0, err
    assert json.loads(out)["resolutions"] == []


def test_health_and_metrics_over_tls(secure: Secure) -> None:
    code, out, err = secure.cli("health", "nobody")
    assert code == 0, err
    assert "SERVING" in out
    assert secure.detector.metrics.startswith("https://")
    context = ssl.create_default_context(cafile=secure.pki["ca_cert"])
    context.load_cert_chain(secure.pki["nobody_cert"], secure.pki["nobody_key"])
    with urllib.request.urlopen(secure.detector.metrics, timeout=10, context=context) as response:
        assert b"stablewatch_agents_attached" in response.read()


def test_plaintext_and_certificate_less_clients_are_refused(secure: Secure) -> None:
    done = stablewatch("status", "--detector", secure.detector.address, "--timeout", "3")
    assert done.returncode == 1
    assert "needs --tls-ca" in done.stderr
    code, _, err = secure.cli("status", None, "--timeout", "3")
    assert code == 1
    assert "over TLS" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["status", "--tls-ca", "/nonexistent/ca.pem"], "cannot read TLS CA certificate file"),
        (["detector", "--tls-cert", "/nonexistent/d.pem", "--tls-key", "/nonexistent/d.key"], "d.pem"),
        (["detector", "--tls-client-ca", "{ca}"], "--tls-client-ca (mutual TLS) needs --tls-cert"),
        (["status", "--tls-ca", "{ca}", "--tls-cert", "{ca}"], "--tls-cert and --tls-key go together"),
        (["detector", "--trigger-rate", "fast"], "expected N/S"),
        (["status", "--tls-ca", "{junk}"], "junk.pem' holds no PEM data"),
        (["detector", "--tls-cert", "{cert}", "--tls-key", "{other_key}"], "is not the key of --tls-cert"),
    ],
)
def test_bad_tls_flags_exit_2_naming_the_file(
    argv: list[str], message: str, pki: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    values = {"ca": pki["ca_cert"], "junk": junk, "cert": pki["server_cert"], "other_key": pki["client_key"]}
    argv = [arg.format(**values) for arg in argv]
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err
