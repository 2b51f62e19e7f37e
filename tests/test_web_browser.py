"""The web view in a real browser: headless Chromium (Debian's, driven by Playwright over its
DevTools pipe) opens the page of a live detector watching the dining philosophers.

What only a browser shows: the page's script runs (no error, nothing the content security policy
refuses), follows the event stream and puts each new snapshot in place without a reload, and the
server-drawn graph is painted with the deadlocked cycle in red. Under mutual TLS the browser shows
a reader's certificate and sees the page; without a certificate the handshake fails.

The table is in-process agents named as in ``examples/philosophers.py``, put by hand in the states
that example goes through (some philosophers waiting for their right fork, then all of them), so
that which snapshot shows what is certain; a sixth process, the host, waits on no one. Snapshots are
taken only when a test triggers one. A screenshot of the deadlocked page is kept under
``$STABLEWATCH_ARTIFACTS`` (default: the test's temporary folder).

Skips only where no Chromium is installed (``.ci/run`` installs Debian's ``chromium``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mtls_detector import mtls_detector
from playwright.sync_api import Browser, ConsoleMessage, Error, Page, Playwright, sync_playwright

from polling import poll
from stablewatch.agents import Agent
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.testing.detector import Running

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 20.0  # seconds: an upper bound for a slow shared machine, not an expected duration
SEATS = ("P0", "P1", "P2", "P3", "P4")  # the example's seats, in ring order
HOST = "host"  # attached, waiting on no one: never deadlocked
DEAD = "rgb(220, 38, 38)"  # view.css's --dead, as the browser computes a colour
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# A switch Chromium ignores, to find this module's browser among the machine's processes.
MARKER = f"--stablewatch-test-browser={os.getpid()}"


# -- the browser ---------------------------------------------------------------------------------------------


def _processes() -> dict[int, tuple[int, bytes]]:
    """Every live process: pid -> (parent pid, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rpartition(")")[2].split()  # after "pid (name)": state, ppid, ...
        if fields[0] != "Z":  # a zombie has ended; its parent just has not reaped it yet
            found[int(entry.name)] = (int(fields[1]), command)
    return found


def _browser_tree() -> set[int]:
    """The pids of this module's Chromium and of every process under it (renderers, GPU, zygotes)."""
    processes = _processes()
    tree = {pid for pid, (_, command) in processes.items() if MARKER.encode() in command}
    grew = True
    while grew:
        below = {pid for pid, (parent, _) in processes.items() if parent in tree}
        grew = not below <= tree
        tree |= below
    return tree


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium for the module, closed at its end, leaving no process of it behind."""
    if CHROMIUM is None:
        pytest.skip("no Chromium found (chromium or chromium-browser on PATH); .ci/run installs Debian's chromium")
    playwright: Playwright = sync_playwright().start()
    tree: set[int] = set()
    try:
        # --no-sandbox: CI runs as root, where Chromium refuses its sandbox.
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", MARKER])
        try:
            yield launched
        finally:
            tree = _browser_tree()
            launched.close()
    finally:
        playwright.stop()
    assert tree, "the browser's process was not found by its marker"
    poll(lambda: not (tree & _processes().keys()), "the browser's processes to end", TIMEOUT)


@dataclass
class Watched:
    """A page and what it reported: console errors and uncaught exceptions."""

    page: Page
    errors: list[str] = field(default_factory=list)

    def console(self, message: ConsoleMessage) -> None:
        if message.type == "error":  # a failed request, a CSP refusal, console.error
            self.errors.append(f"console: {message.text} at {message.location}")

    def uncaught(self, error: Error) -> None:
        self.errors.append(f"page error: {error}")


@contextmanager
def open_page(browser: Browser, **options: Any) -> Iterator[Watched]:
    """A page in a context of its own (``options``: Playwright's ``new_context``), closed afterwards."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, **options)
    context.set_default_timeout(TIMEOUT * 1000)
    try:
        page = context.new_page()
        watched = Watched(page)
        page.on("console", watched.console)
        page.on("pageerror", watched.uncaught)
        yield watched
    finally:
        context.close()


def artifacts(tmp_path: Path) -> Path:
    """Where screenshots go: ``$STABLEWATCH_ARTIFACTS`` (set it to keep them) or the test's temporary folder."""
    folder = Path(os.environ.get("STABLEWATCH_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# -- the table ----------------------------------------------------------------------------------------------


class Table:
    """A detector with the five philosophers and the host attached; snapshots only when triggered."""

    def __init__(self, running: Running, agents: dict[str, Agent]) -> None:
        self.running = running
        self.agents = agents

    def snapshot(self) -> int:
        """Take a snapshot; its id once it has completed."""
        return self.running.call(self.running.detector.trigger()).snapshot.snapshot_id

    def hungry(self, *seats: str) -> None:
        """Each of ``seats`` holds its left fork and waits (AND) on its right neighbour for the other."""
        for seat in seats:
            right = SEATS[(SEATS.index(seat) + 1) % len(SEATS)]
            self.agents[seat].state.add_wait([right], model="and")


@pytest.fixture
def table(tmp_path: Path) -> Iterator[Table]:
    config = DetectorConfig(
        data_dir=tmp_path / "data",
        listen="127.0.0.1:0",
        metrics_port=0,  # the web view is served beside /metrics
        interval=None,
        expected_members=(*SEATS, HOST),
        hints=False,  # snapshots only when a test triggers one
    )
    running = Running(config)
    agents = {name: Agent(name, detector=running.detector.address, heartbeat_interval=0.2) for name in (*SEATS, HOST)}
    try:
        for name, agent in agents.items():
            if name in SEATS:
                agent.state.set_counter("forks", 1)  # each seat's left fork, as in the example
                agent.state.set_attribute("meals", 3)
            running.call(agent.start())
        poll(lambda: len(running.detector.coordinator.members) == len(agents), "every member attached")
        yield Table(running, agents)
    finally:
        for agent in agents.values():
            running.call(agent.stop())
        running.stop()


# -- reading the page -----------------------------------------------------------------------------------------


def shown_snapshot(page: Page, snapshot_id: int) -> None:
    """Wait until the page shows ``snapshot_id`` (put in place from the event stream, no reload)."""
    page.wait_for_function(
        "id => document.querySelector('#snapshot-id').dataset.snapshot === id"
        " && document.querySelector('#graph > svg.wait-for')?.dataset.snapshot === id",
        arg=str(snapshot_id),
        timeout=TIMEOUT * 1000,
    )


def nodes(page: Page) -> dict[str, dict[str, str | list[str]]]:
    """The drawn graph's nodes: name -> classes and the stroke the browser paints their box with."""
    found = page.eval_on_selector_all(
        "#graph > svg.wait-for g.node",
        """nodes => nodes.map(g => [g.getAttribute('data-node'), {
            classes: g.getAttribute('class').split(/\\s+/),
            stroke: getComputedStyle(g.querySelector('rect')).stroke,
        }])""",
    )
    return dict(found)


def edges(page: Page) -> dict[tuple[str, str], list[str]]:
    """The drawn graph's edges: (waiter, target) -> classes."""
    found = page.eval_on_selector_all(
        "#graph > svg.wait-for g.edge",
        "edges => edges.map(g => [g.getAttribute('data-waiter'), g.getAttribute('data-target'),"
        " g.getAttribute('class').split(/\\s+/)])",
    )
    return {(waiter, target): classes for waiter, target, classes in found}


def predicate(page: Page, name: str) -> str | None:
    return page.get_attribute(f"#predicates li.predicate[data-predicate={name}]", "data-value")


# -- the tests ------------------------------------------------------------------------------------------------


def test_the_page_follows_the_table_into_deadlock_and_paints_the_cycle(
    browser: Browser, table: Table, tmp_path: Path
) -> None:
    table.hungry("P1", "P3")  # two philosophers wait for their right fork; the table still eats
    eating = table.snapshot()
    url = table.running.detector.web_url
    assert url is not None
    with open_page(browser) as watched:
        page = watched.page
        response = page.goto(url)
        assert response is not None and response.status == 200
        page.wait_for_selector("body[data-connection=live]")
        shown_snapshot(page, eating)
        assert predicate(page, "deadlock") == "false"
        drawn = nodes(page)
        assert set(drawn) == {*SEATS, HOST}
        assert not any({"deadlocked", "cycle"} & set(node["classes"]) for node in drawn.values())
        assert "deadlocked" not in edges(page)[("P1", "P2")]  # a wait, not a deadlock

        # The rest get hungry holding their left fork: P0 -> P1 -> P2 -> P3 -> P4 -> P0.
        table.hungry("P0", "P2", "P4")
        deadlocked = table.snapshot()
        assert deadlocked != eating
        shown_snapshot(page, deadlocked)  # the page updates by itself
        assert predicate(page, "deadlock") == "true"
        drawn = nodes(page)
        for seat in SEATS:
            assert {"deadlocked", "cycle"} <= set(drawn[seat]["classes"]), seat
            assert drawn[seat]["stroke"] == DEAD, seat  # painted red, not only classed
        assert not {"deadlocked", "cycle"} & set(drawn[HOST]["classes"])
        assert drawn[HOST]["stroke"] != DEAD
        drawn_edges = edges(page)
        for i, seat in enumerate(SEATS):
            assert {"deadlocked", "cycle"} <= set(drawn_edges[(seat, SEATS[(i + 1) % len(SEATS)])])

        members = page.eval_on_selector_all(
            "#members li[data-member]", "items => items.map(li => [li.dataset.member, li.dataset.state])"
        )
        assert sorted(members) == sorted([name, "attached"] for name in (*SEATS, HOST))
        timeline = page.eval_on_selector_all(
            "#timeline li[data-snapshot]", "items => items.map(li => [li.dataset.snapshot, li.dataset.outcome])"
        )
        assert timeline == [[str(deadlocked), "completed"], [str(eating), "completed"]]  # newest first
        change = page.locator(f"#changes li[data-predicate=deadlock][data-snapshot='{deadlocked}']")
        assert change.get_attribute("data-from") == "false" and change.get_attribute("data-to") == "true"
        assert page.get_attribute("body", "data-connection") == "live"

        page.screenshot(path=artifacts(tmp_path) / "web-view.png", full_page=True)
        assert watched.errors == []


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path]) -> Iterator[Running]:
    """A detector under mutual TLS (clients need a certificate of the test CA), with no members."""
    with mtls_detector(tmp_path_factory.mktemp("web-browser-mtls"), pki) as running:
        yield running


def certificate(url: str, pki: dict[str, Path], name: str) -> dict[str, Any]:
    """Playwright's client certificate entry: show ``name``'s certificate to ``url``'s origin."""
    origin = url.rstrip("/")
    return {"client_certificates": [{"origin": origin, "certPath": pki[f"{name}_cert"], "keyPath": pki[f"{name}_key"]}]}


# The server's certificate is not what these tests check (tests/test_web_view.py does, with the CA):
# the browser does not know the test CA, so it is told not to mind.
TRUSTING = {"ignore_https_errors": True}


def test_a_reader_certificate_opens_the_page_under_mutual_tls(
    browser: Browser, mtls: Running, pki: dict[str, Path]
) -> None:
    url = mtls.detector.web_url
    assert url is not None and url.startswith("https://127.0.0.1:")
    with open_page(browser, **TRUSTING, **certificate(url, pki, "reader")) as watched:
        page = watched.page
        response = page.goto(url)
        assert response is not None and response.status == 200
        page.wait_for_selector("body[data-connection=live]")  # the event stream too went through
        page.wait_for_function("document.querySelector('#detector').textContent !== ''")  # a view arrived
        assert page.text_content("#snapshot-meta") == "no snapshot has completed yet"
        assert watched.errors == []


def test_a_certificate_without_the_reader_role_gets_403(browser: Browser, mtls: Running, pki: dict[str, Path]) -> None:
    url = mtls.detector.web_url
    assert url is not None
    with open_page(browser, **TRUSTING, **certificate(url, pki, "nobody")) as watched:
        response = watched.page.goto(url)
        assert response is not None and response.status == 403
        assert "stablewatch://role/reader" in (watched.page.text_content("body") or "")


def test_a_browser_without_a_certificate_cannot_open_the_page(
    browser: Browser, mtls: Running, pki: dict[str, Path]
) -> None:
    url = mtls.detector.web_url
    assert url is not None
    # The server ends the handshake: no page at all (Chromium reports it as a socket error).
    with open_page(browser, **TRUSTING) as watched, pytest.raises(Error, match=r"net::ERR_"):
        watched.page.goto(url)
    with open_page(browser, **TRUSTING, **certificate(url, pki, "reader")) as watched:
        response = watched.page.goto(url)  # the same server, the same browser: the certificate was missing
        assert response is not None and response.status == 200
