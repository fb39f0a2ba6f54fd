"""The web console (services/console/) in a real browser: Debian's headless
chromium driven by selenium, against one real `baton up` with two
deployments (one stack for the module, its tests in order).

Sessions are made and spoken to through the SDK; the console is used as an
operator would: its pages, its live timeline (no reload), its confirmation
pages and actions. Screenshots of each view go to a temporary directory
(BATON_CONSOLE_SHOTS to choose it), named in the output.

The owners run the fixture agent that refuses to load a session while a
file named after it exists (`build_refuse_load_while_marked_agent`), with a
restart budget of 1: a session created and sent a message while every
load is refused stalls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

pytest.importorskip("selenium")
from baton_client import Client, Settings  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from baton_runtime._proto.baton.ingress.v1 import ingress_pb2 as pb  # noqa: E402
from baton_runtime.cli.system.launch_settings import DEMO_API_KEY  # noqa: E402
from baton_runtime.common.security.tls import Security  # noqa: E402
from baton_runtime.console.app import create_app  # noqa: E402
from baton_runtime.console.config import ConsoleConfig  # noqa: E402
from baton_runtime.owner.agents.fixture import EVERY_SESSION, REFUSE_DIR_ENV  # noqa: E402
from tests.scrape import scrape  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
STARTUP = 90.0
WAIT = 30.0
# A live session's stream keeps its last RETAINED events (anchor deletes the
# rest): one test's session passes it, the others stay below.
RETAINED = 60
AGENT = "baton_runtime.owner.agents.fixture:build_refuse_load_while_marked_agent"
BROWSER_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1000",
)
_T = TypeVar("_T")
METRICS = re.compile(r"^  (\S+(?: of \S+)?) +(http://127\.0\.0\.1:\d+/metrics)$")
STARTED = re.compile(r"^baton up: started (\S+)(?: of \S+)? \(pid (\d+)\) on (\S+)$")

# Skipped where the browser is missing, but never in CI (.ci/run installs it).
pytestmark = pytest.mark.skipif(
    not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()) and not os.environ.get("CI"),
    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)",
)


@dataclass
class Up:
    """A running `baton up` and what it printed."""

    proc: subprocess.Popen[str]
    marks: Path
    lines: list[str] = field(default_factory=list)
    console: str = ""
    token: str = ""
    ingresses: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""
    hooks: str = ""
    anchor: str = ""
    pids: list[int] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)  # label -> metrics URL

    @property
    def ca(self) -> str:
        return str(Path(self.run_dir) / "certs" / "ca.crt")

    def certs(self, name: str) -> Security:
        base = Path(self.run_dir) / "certs"
        return Security.tls(str(base / f"{name}.crt"), str(base / f"{name}.key"), self.ca)

    def client(self, deployment_id: str) -> Client:
        settings = Settings(
            target=self.ingresses[deployment_id], api_key=DEMO_API_KEY, ca_cert=self.ca
        )
        return Client(settings)


def _read(up: Up, ready: threading.Event) -> None:
    assert up.proc.stdout is not None
    for raw in up.proc.stdout:
        line = raw.rstrip("\n")
        up.lines.append(line)
        if match := re.match(r"^Console: (http://\S+) \(.* console token (\S+):", line):
            up.console, up.token = match[1], match[2]
        elif match := re.match(r"^baton up: run dir (\S+),", line):
            up.run_dir = match[1]
        elif match := re.match(
            r"^baton up: started (\S+)(?: of \S+)? \(pid (\d+)\) on (\S+)$", line
        ):
            up.pids.append(int(match[2]))
            if match[1] in ("hooks", "anchor"):
                setattr(up, match[1], match[3])
        elif match := METRICS.match(line):
            up.metrics[match[1]] = match[2]
        elif line.startswith("Baton is up: deployments "):
            up.ingresses = dict(re.findall(r"(\S+) \(public API at (\S+)\)", line))
        elif line == "baton up: ready":
            ready.set()
    ready.set()


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    work = Path(tempfile.mkdtemp(prefix="baton-console-"))
    marks = work / "marks"
    marks.mkdir()
    env = {
        **os.environ,
        "BATON_PROFILE": str(work / "profile.json"),
        "BATON_AGENT": AGENT,
        REFUSE_DIR_ENV: str(marks),
        "BATON_OWNER_RESTART_BUDGET": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_runtime.cli", "up", "--port-base", "0", "--etcd-port", "0"]
        + ["--deployment-id", "dep-1,dep-2", "--run-dir", str(work / "run")]
        + ["--stream-retention-events", str(RETAINED), "--stream-retention", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    launched = Up(proc, marks)
    ready = threading.Event()
    threading.Thread(target=_read, args=(launched, ready), daemon=True).start()
    try:
        assert ready.wait(STARTUP) and proc.poll() is None, "\n".join(launched.lines)
        assert launched.console.startswith("http://127.0.0.1:"), "\n".join(launched.lines)
        assert set(launched.ingresses) == {"dep-1", "dep-2"}, "\n".join(launched.lines)
        yield launched
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for pid in launched.pids:  # a last resort: nothing may outlive the module
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Browser:
    driver: WebDriver
    base: str
    shots: Path
    log: list[dict[str, Any]] = field(default_factory=list)

    def open(self, path: str) -> None:
        self.driver.get(self.base.rstrip("/") + path)
        self.check_page()

    def check_page(self) -> None:
        """Every page has a title and every control a label; its console
        log is kept (and checked at the end of each test)."""
        wait_until(lambda: self.driver.execute_script("return document.readyState") == "complete")
        assert self.driver.title.endswith("· Baton console"), self.driver.title
        unlabelled = self.driver.execute_script(
            """
            const bad = [];
            const controls = 'input:not([type=hidden]), select, textarea';
            for (const c of document.querySelectorAll(controls)) {
              const label = c.id && document.querySelector('label[for="' + c.id + '"]');
              if (!label && !c.getAttribute('aria-label')) bad.push(c.outerHTML);
            }
            for (const b of document.querySelectorAll('button, a')) {
              if (!b.textContent.trim() && !b.getAttribute('aria-label')) bad.push(b.outerHTML);
            }
            return bad;
            """
        )
        assert unlabelled == [], unlabelled
        self.log += self.driver.get_log("browser")

    def shot(self, name: str) -> None:
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))

    def errors(self) -> list[dict[str, Any]]:
        self.log += self.driver.get_log("browser")
        return [entry for entry in self.log if entry["level"] == "SEVERE"]

    def css(self, selector: str) -> list[Any]:
        return list(self.driver.find_elements(By.CSS_SELECTOR, selector))

    def text(self, selector: str) -> str:
        """The rendered text of the first match, read in one script: a part
        the page rewrites as live items arrive cannot go stale between
        finding it and reading it."""
        shown: str = self.driver.execute_script(
            "const el = document.querySelector(arguments[0]); return el ? el.innerText : '';",
            selector,
        )
        return shown

    def timeline(self) -> list[tuple[int, str, str, str]]:
        """(seq, kind, deployment, text) of each event on the page."""
        rows = self.driver.execute_script(
            """
            return [...document.querySelectorAll('#timeline li.ev')].map(li =>
              [Number(li.dataset.seq), li.dataset.kind, li.dataset.deployment,
               li.querySelector('.body').textContent.trim()]);
            """
        )
        return [tuple(r) for r in rows]


def wait_until(
    check: Callable[[], _T | None],
    timeout: float = WAIT,
    what: str = "",
    seen: Callable[[], str] = lambda: "",
) -> _T:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except StaleElementReferenceException:
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g}s: {what or check}\n{seen()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def browser(up: Up, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    options = webdriver.ChromeOptions()
    for flag in BROWSER_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="baton-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    shots = Path(os.environ.get("BATON_CONSOLE_SHOTS") or tmp_path_factory.mktemp("shots"))
    shots.mkdir(parents=True, exist_ok=True)
    print(f"console screenshots: {shots}")
    try:
        yield Browser(driver, up.console, shots)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@dataclass
class Sessions:
    """The sessions the tests share, by role."""

    followed: str = ""
    stalled: str = ""
    idle: str = ""


SHARED = Sessions()


def status_of(up: Up, deployment_id: str, session_id: str) -> pb.Session:
    with up.client(deployment_id) as client:
        return client.get_session(session_id)


def owner_log(up: Up, deployment_id: str = "dep-1") -> str:
    log = Path(up.run_dir) / "logs" / f"owner-{deployment_id}.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return "\n".join(line for line in lines if "drain" in line or "error" in line)[-6000:]


def answered(browser: Browser, text: str) -> bool:
    """The page shows the answer to `text`."""
    return any(e[1] == "message.completed" and text in e[3] for e in browser.timeline())


def test_overview_lists_both_deployments_and_a_session(up: Up, browser: Browser) -> None:
    with up.client("dep-1") as client:
        SHARED.followed = client.create_session().session_id
    browser.open("/")
    rows = {row.get_attribute("data-deployment"): row for row in browser.css("#deployments tr")}
    assert {"dep-1", "dep-2"} <= set(rows), browser.driver.page_source
    assert "active" in rows["dep-1"].text and "active" in rows["dep-2"].text
    assert "SERVING" in browser.css("#health")[0].text
    browser.shot("overview")
    browser.open("/sessions")
    listed = [row.get_attribute("data-session") for row in browser.css("#sessions tbody tr")]
    assert SHARED.followed in listed
    # The AIP-160 filter of ListSessions, across channels.
    field_ = browser.css("#filter")[0]
    field_.send_keys("deployment = dep-2")
    browser.css("form.filter button")[0].click()
    browser.check_page()
    assert SHARED.followed not in browser.driver.page_source
    browser.shot("sessions")
    assert not browser.errors()
    browser.open("/sessions?filter=status%20%3D%20nonsense")
    assert "INVALID_FILTER" in browser.css("p.error")[0].text
    browser.log.clear()  # (the refusal's 400 is the browser's only complaint)


def test_a_session_page_follows_live_across_an_upgrade(up: Up, browser: Browser) -> None:
    sid = SHARED.followed
    browser.open(f"/sessions/{sid}")
    browser.driver.execute_script("window.notReloaded = true;")
    with up.client("dep-1") as client:
        client.send(sid, "hello console")
    wait_until(
        lambda: any(
            e[1] == "message.completed" and "hello console" in e[3] for e in browser.timeline()
        ),
        what="the answer on the page",
    )
    # Through the second deployment's ingress: the session moves (an upgrade).
    with up.client("dep-2") as client:
        client.send(sid, "after the upgrade")

    def moved() -> list[tuple[int, str, str, str]] | None:
        events = browser.timeline()
        done = [e for e in events if e[1] == "message.completed" and "after the upgrade" in e[3]]
        return events if done else None

    events = wait_until(moved, what="the turn on the new deployment")
    assert browser.driver.execute_script("return window.notReloaded === true;")
    seqs = [e[0] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # no gap, no repeat
    handoff = next(e for e in events if e[1] == "session.handed_off")
    assert "dep-1" in handoff[3] and "dep-2" in handoff[3] and handoff[2] == "dep-2"
    after = next(e for e in events if e[1] == "message.completed" and "after the upgrade" in e[3])
    assert after[2] == "dep-2" and after[0] > handoff[0]
    wait_until(lambda: "dep-2" in browser.css("#deployment")[0].text, what="the header updated")
    browser.shot("session")
    # The handoff, by its id.
    browser.css("li.ev-handoff a")[0].click()
    browser.check_page()
    assert "dep-2" in browser.driver.page_source and browser.driver.title.startswith("Handoff")
    browser.shot("handoff")
    assert not browser.errors()


def test_a_session_page_shows_the_step_in_flight_as_it_is_written(up: Up, browser: Browser) -> None:
    """The fixture model writes its answer in 80 parts over 8 s: the page
    shows the text growing below the timeline (live items) before the
    answer is committed, then the committed answer in the timeline and no
    draft."""
    answer = "".join(f"{i}," for i in range(80))
    with up.client("dep-1") as client:
        sid = client.create_session().session_id
        browser.open(f"/sessions/{sid}")
        client.send(sid, "stream 80 8000")

    def draft() -> str:
        shown: str = browser.driver.execute_script(
            """
            const box = document.getElementById('live-step');
            const text = box && !box.hidden && box.querySelector('.live-text');
            return text ? text.textContent : '';
            """
        )
        return shown

    seen: list[str] = []
    polls: list[float] = []

    def grown() -> bool:
        polls.append(time.monotonic())
        text = draft()
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        committed = answered(browser, answer)
        gaps = [round(b - a, 2) for a, b in zip(polls, polls[1:], strict=False)]
        assert not (committed and len(seen) < 2), (seen, gaps)  # it grew before the commit
        return len(seen) >= 2

    wait_until(grown, what="the answer growing on the page", seen=lambda: str(seen))
    assert not answered(browser, answer)  # not committed yet: a draft
    assert all(answer.startswith(text) for text in seen), seen
    assert all(b.startswith(a) and b != a for a, b in zip(seen, seen[1:], strict=False)), seen
    note = browser.text("#live-step .live-note")
    assert "Step 1 is running" in note, note
    browser.shot("session-live")
    wait_until(lambda: answered(browser, answer), what="the committed answer")
    wait_until(
        lambda: browser.driver.execute_script(
            "return document.getElementById('live-step').hidden;"
        ),
        what="the draft cleared by the commit",
    )
    assert not browser.errors()


READS = {
    "anchor": ("GetSnapshot", "ReadEvents", "LoadSession"),
    "hooks": ("DescribeSession", "ListChannelSessions", "GetOwner", "DescribeDeployment"),
}
IDLE_WINDOW = 3.0


async def served_reads(up: Up) -> dict[str, float]:
    """The reads hooks and anchor have answered so far, by method."""
    counts: dict[str, float] = {}
    for service, methods in READS.items():
        scraped = await scrape(up.metrics[service])
        for method in methods:
            full = f"/baton.{service}.v1.{'HookRegistry' if service == 'hooks' else 'Anchor'}"
            counts[method] = scraped.total(
                "baton_rpc_server_handled_total", method=f"{full}Service/{method}"
            )
    return counts


async def test_an_idle_open_session_page_costs_no_reads(up: Up, browser: Browser) -> None:
    """A session's page open on an idle session: in a window of a few
    seconds the console makes none of the reads a page is made of (the page
    waits on its follow; nothing polls)."""
    browser.open(f"/sessions/{SHARED.followed}")  # (its reads are done when it has loaded)
    before = await served_reads(up)
    await asyncio.sleep(IDLE_WINDOW)
    assert await served_reads(up) == before
    assert browser.text("#live").startswith("Following live")


def test_older_pages_load_down_to_the_retention_horizon(up: Up, browser: Browser) -> None:
    turns = 12  # 7 events each: the stream passes RETAINED
    with up.client("dep-2") as client:
        sid = client.create_session().session_id
        for n in range(turns):  # one turn each (a message sent into a turn joins it)
            client.send(sid, f"turn {n}")
            wait_until(lambda n=n: client.get_session(sid).turn_count == n + 1, what="a turn")
    view = wait_until(
        lambda: (
            (v := status_of(up, "dep-2", sid)).status == pb.SESSION_STATUS_IDLE
            and v.earliest_seq > 0
            and v
        ),
        what="the old events deleted",
        seen=lambda: str(status_of(up, "dep-2", sid)),
    )
    browser.open(f"/sessions/{sid}")
    shown = [e[0] for e in browser.timeline()]
    assert shown == list(range(view.stream_head - 50, view.stream_head)), shown
    assert not browser.css("li.horizon")
    browser.css("#older")[0].click()
    wait_until(lambda: browser.css("li.horizon"), what="the horizon shown")
    earliest = int(browser.css("li.horizon")[0].get_attribute("data-horizon"))
    assert earliest >= view.earliest_seq
    assert f"#{earliest}" in browser.css("li.horizon")[0].text
    shown = [e[0] for e in browser.timeline()]
    assert shown == list(range(earliest, view.stream_head)), shown  # gapless
    assert not browser.css("#older")  # nothing older to load
    browser.shot("session-horizon")
    assert not browser.errors()


def test_a_stalled_session_is_shown_and_resumed(up: Up, browser: Browser) -> None:
    mark = up.marks / EVERY_SESSION  # (no other session loads meanwhile)
    mark.touch()
    with up.client("dep-1") as client:
        sid = SHARED.stalled = client.create_session().session_id
        client.send(sid, "stuck")
    wait_until(
        lambda: status_of(up, "dep-1", sid).status == pb.SESSION_STATUS_STALLED,
        what="the session stalled",
    )
    browser.open("/")
    assert sid in browser.css("#stalled")[0].text
    browser.open(f"/sessions/{sid}")
    assert browser.css("#status")[0].text == "stalled"
    assert "1 unconsumed" in browser.css("#inbox")[0].text
    mark.unlink()  # the cause fixed
    browser.driver.find_element(By.LINK_TEXT, "Resume the stalled session").click()
    browser.check_page()
    assert sid in browser.css("#question")[0].text
    browser.shot("confirm")
    browser.css("#confirm")[0].click()
    browser.check_page()
    assert "resumed" in browser.css(".notice")[0].text
    wait_until(lambda: answered(browser, "stuck"), what="the inbox answered")
    assert status_of(up, "dep-1", sid).inbox_depth == 0
    assert not browser.errors()


def test_draining_from_the_console_moves_idle_sessions(up: Up, browser: Browser) -> None:
    with up.client("dep-1") as client:
        sid = SHARED.idle = client.create_session().session_id
        client.send(sid, "settle")
    wait_until(
        lambda: (
            status_of(up, "dep-1", sid).turn_count == 1
            and status_of(up, "dep-1", sid).status == pb.SESSION_STATUS_IDLE
        ),
        what="an idle session on dep-1",
    )
    browser.open("/deployments/dep-1")
    Select(browser.css("#drain-to")[0]).select_by_value("dep-2")
    browser.css("form.filter button")[0].click()
    browser.check_page()
    assert "dep-1 to dep-2" in browser.css("#question")[0].text
    browser.css("#confirm")[0].click()
    browser.check_page()
    wait_until(lambda: "drained:" in browser.css("main")[0].text, timeout=90, what="the drain")

    def shows_drained() -> bool:
        """(The owners announce a drain on their next keep-alive: reload.)"""
        browser.driver.refresh()
        return browser.css("#dep-status")[0].text == "drained"

    wait_until(
        shows_drained,
        timeout=60,
        what="the deployment page showing dep-1 drained",
        seen=lambda: browser.driver.find_element(By.TAG_NAME, "main").text + owner_log(up),
    )
    browser.check_page()
    browser.shot("deployment")
    for moved in (SHARED.idle, SHARED.stalled):
        assert status_of(up, "dep-2", moved).deployment_id == "dep-2"
    browser.open("/")
    row = next(
        r for r in browser.css("#deployments tr") if r.get_attribute("data-deployment") == "dep-1"
    )
    assert "drained" in row.text
    browser.shot("overview-drained")
    assert not browser.errors()


def test_a_forged_cross_site_post_is_refused(up: Up, browser: Browser) -> None:
    sid = SHARED.idle
    # A page of another origin posting to the console (the browser sends the
    # console's cookies with it where it may, and Origin: null).
    forged = (
        "data:text/html,<title>x</title><form method=post "
        f"action='{up.console}sessions/{sid}/reset'><input name=csrf value=guess>"
        "<button id=go>go</button></form>"
    )
    browser.driver.get(forged)
    browser.driver.find_element(By.ID, "go").click()
    wait_until(lambda: "Refused" in browser.driver.title, what="the refusal")
    assert status_of(up, "dep-2", sid).status != pb.SESSION_STATUS_FINALIZED
    # Outside a browser: the right origin without the browser's token, and
    # a token with another origin.
    with httpx.Client(base_url=up.console) as http:
        page = http.get(f"/sessions/{sid}/reset")
        token = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert page.status_code == 200 and token
        bare = httpx.post(
            f"{up.console}sessions/{sid}/reset",
            data={"csrf": token[1]},
            headers={"Origin": up.console.rstrip("/")},
        )
        assert bare.status_code == 403, bare.text
        other = http.post(
            f"/sessions/{sid}/reset",
            data={"csrf": token[1]},
            headers={"Origin": "http://evil.example"},
        )
        assert other.status_code == 403, other.text
    assert status_of(up, "dep-2", sid).status != pb.SESSION_STATUS_FINALIZED
    refusals = browser.errors()  # the refusal's 403 is the browser's only complaint
    assert all("403" in entry["message"] for entry in refusals), refusals
    browser.log.clear()


def test_a_reset_from_the_console_finalizes_the_session(up: Up, browser: Browser) -> None:
    """Through the session's deployment's ingress, with the console's key."""
    sid = SHARED.idle
    browser.open(f"/sessions/{sid}")
    browser.driver.find_element(By.LINK_TEXT, "Reset (finalize) the session").click()
    browser.check_page()
    browser.css("#confirm")[0].click()
    browser.check_page()
    assert "reset accepted" in browser.css(".notice")[0].text
    wait_until(
        lambda: status_of(up, "dep-2", sid).status == pb.SESSION_STATUS_FINALIZED,
        what="the session finalized",
    )
    wait_until(lambda: "closed" in browser.css("#live")[0].text, what="the follow ended")
    assert not browser.errors()


def test_callers_without_authority_are_refused(up: Up) -> None:
    """Not on loopback without the token (then with it); a loopback caller
    naming another host (DNS rebinding); and a console whose identity is
    not an operator's (an owner's certificate): the services refuse its
    reads and its actions."""
    config = ConsoleConfig(
        hooks=up.hooks,
        anchor=up.anchor,
        security=up.certs("operator"),
        token=up.token,
    )
    remote = ("198.51.100.7", 40000)
    with TestClient(create_app(config), client=remote, follow_redirects=False) as http:
        refused = http.get("/", headers={"Host": "console.example"})
        assert refused.status_code == 401 and "token" in refused.text
        assert http.get("/", headers={"Authorization": "Bearer wrong-token"}).status_code == 401
        login = http.get(f"/sessions?token={up.token}")
        assert login.status_code == 303 and login.headers["location"] == "/sessions"
        assert http.get("/sessions").status_code == 200  # with the cookie
        assert http.get("/", headers={"Authorization": f"Bearer {up.token}"}).status_code == 200
    with TestClient(create_app(config), client=("127.0.0.1", 40000)) as http:
        rebound = http.get("/", headers={"Host": "attacker.example:8080"})
        assert rebound.status_code == 401
        assert http.get("/", headers={"Host": "127.0.0.1:8080"}).status_code == 200
    not_operator = ConsoleConfig(hooks=up.hooks, anchor=up.anchor, security=up.certs("owner-dep-2"))
    with TestClient(create_app(not_operator), client=("127.0.0.1", 40000)) as http:
        headers = {"Host": "127.0.0.1:8080", "Origin": "http://127.0.0.1:8080"}
        page = http.get(f"/sessions/{SHARED.stalled}/resume", headers=headers)
        assert page.status_code == 403 and "ROLE_NOT_ALLOWED" in page.text, page.text
        token = http.cookies["baton_console_csrf"]
        answer = http.post(
            f"/sessions/{SHARED.stalled}/resume", data={"csrf": token}, headers=headers
        )
        assert answer.status_code == 403 and "ROLE_NOT_ALLOWED" in answer.text, answer.text
