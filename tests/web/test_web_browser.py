"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright)
against real ``kombu-delay web`` servers, a real mover and a real Celery worker, under a key prefix.

Without Playwright or Chromium these tests skip, saying why; with
``KOMBU_DELAY_REQUIRE_BROWSER=1`` (CI sets it) a missing browser fails them instead. With
``KOMBU_DELAY_SCREENSHOTS=1`` the run also writes the docs' screenshots to ``docs/images/``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from kombu_delay import DelayControl
from kombu_delay.tooling.redis_server import RedisServer, free_port
from tests.support.ecosystem_app import LEDGER_KEY
from tests.support.procs import ROOT, Proc, wait_until

#: Where Debian's chromium package puts the browser (override with KOMBU_DELAY_CHROMIUM).
CHROMIUM = os.environ.get("KOMBU_DELAY_CHROMIUM", "/usr/bin/chromium")
PREFIX = "webui:"
OPTIONS = {"global_keyprefix": PREFIX, "delay_compress_after": 0}
SCREENSHOTS = ROOT / "docs" / "images"


def missing_browser() -> str | None:
    """Why no browser test can run here, or ``None``."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e '.[test]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set KOMBU_DELAY_CHROMIUM)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = missing_browser()
    if reason is not None:
        if os.environ.get("KOMBU_DELAY_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser tests required (KOMBU_DELAY_REQUIRE_BROWSER=1) but cannot run: {reason}")
        pytest.skip(f"browser tests skipped: {reason}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def serve_web(cli: list[str], log: Path, *extra: str) -> tuple[Proc, str]:
    """A ``kombu-delay web`` refreshing its overview every second, once it answers; and its URL."""
    port = free_port()
    proc = Proc([*cli, "web", "--port", str(port), "--refresh", "1", *extra], None, log)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.popen.poll() is None, proc.output()
        try:
            with urllib.request.urlopen(url + "/overview.json", timeout=5) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    try:
        wait_until(up, timeout=60, interval=0.1)
    except BaseException:
        proc.stop()
        raise
    return proc, url


class Stack:
    """A mover, a Celery worker and two dashboards (actions on, read-only) on the session Redis."""

    def __init__(self, redis_server: Any, tmp: Path) -> None:
        self.redis_server = redis_server
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.ledger = redis_server.client()
        self.ledger.delete(LEDGER_KEY)
        env = {
            "ECO_BROKER": redis_server.delay_url,
            "ECO_OPTIONS": json.dumps(OPTIONS),
            "ECO_LEDGER": redis_server.url,
        }
        self.start("mover", [*self.cli(), "mover"])
        worker = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.support.ecosystem_app",
            "worker",
            "--pool",
            "solo",
        ]
        worker += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        worker += ["-Q", "celery", "-n", "web@%h"]
        self.start("worker", worker, env)
        self.url = self.serve("web-actions", "--allow-actions")
        self.read_only_url = self.serve("web-readonly")
        self.control = DelayControl(redis_server.delay_url, OPTIONS)
        self.app = Celery("pub", broker=redis_server.delay_url)
        self.app.conf.broker_transport_options = OPTIONS

    def cli(self) -> list[str]:
        return [sys.executable, "-m", "kombu_delay", "-b", self.redis_server.delay_url, "--prefix", PREFIX]

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, env, self.tmp / f"{name}.log")
        self.procs.append(proc)
        return proc

    def serve(self, name: str, *extra: str) -> str:
        proc, url = serve_web(self.cli(), self.tmp / f"{name}.log", *extra)
        self.procs.append(proc)
        return url

    def runs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.ledger.lrange(LEDGER_KEY, 0, -1)]

    def stop(self) -> None:
        self.app.close()
        self.control.close()
        for proc in reversed(self.procs):
            proc.stop()
        self.ledger.close()


@pytest.fixture(scope="module")
def stack(redis_server, browser, tmp_path_factory) -> Iterator[Stack]:
    client = redis_server.client()
    client.flushall()
    client.close()
    running = Stack(redis_server, tmp_path_factory.mktemp("web"))
    try:
        wait_until(lambda: running.control.stats(hours=1).movers, timeout=60)
        yield running
    finally:
        running.stop()


@pytest.fixture
def page(browser) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(120_000)  # each page load, click or wait: generous on a busy machine
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def shoot(tab: Any, name: str, tmp_path: Path) -> None:
    """Screenshot the page; into the docs too when KOMBU_DELAY_SCREENSHOTS=1 asks for it."""
    shot = tmp_path / name
    tab.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("KOMBU_DELAY_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOTS / name)


def send(stack: Stack, name: str, *args: object, **options: object) -> str:
    return str(stack.app.send_task(name, args, **options).id)


def test_overview_shows_what_is_scheduled_and_refreshes_by_itself(stack, page, tmp_path):
    for i in range(12):
        send(stack, "eco.record", f"ov-{i}", countdown=1800 + i * 3000)
    for i in range(5):
        send(stack, "eco.record", f"mail-{i}", countdown=900 + i * 1200, queue="emails")
    page.goto(stack.url + "/")
    total = page.locator("#total-scheduled")
    wait_until(lambda: int(total.inner_text().replace(",", "")) >= 17, timeout=120)
    assert page.locator("#queues").get_by_text("emails").count() == 1
    heights = page.locator("#due-chart rect.bar").evaluate_all(
        "bars => bars.map(b => Number(b.getAttribute('height')))"
    )
    assert len(heights) == 24 and sum(h > 0 for h in heights) >= 5
    assert page.locator("#movers tbody tr").count() >= 1
    shoot(page, "dashboard-overview.png", tmp_path)
    # New messages appear without a reload: the page refreshes its overview every second.
    before = int(total.inner_text().replace(",", ""))
    page.evaluate("window.__same_page = true")
    for i in range(3):
        send(stack, "eco.record", f"late-{i}", countdown=2400)
    # (polled from here: the page's Content-Security-Policy forbids evaluating a string in it)
    wait_until(lambda: int(total.inner_text().replace(",", "")) >= before + 3, timeout=120, interval=0.2)
    assert page.evaluate("window.__same_page") is True


def test_the_overview_says_when_it_cannot_refresh_and_why(page, tmp_path):
    # With Redis gone, the open page only dimmed its figures: they read as current.
    with RedisServer() as own:
        proc, url = serve_web(
            [sys.executable, "-m", "kombu_delay", "-b", own.delay_url], tmp_path / "web.log"
        )
        try:
            page.goto(url + "/")
            notice = page.locator("#stale")
            assert notice.is_hidden()
            own.stop(kill=True)
            wait_until(notice.is_visible, timeout=120, interval=0.2)
            told = notice.inner_text()
            assert told.startswith("Not refreshed since ") and "Redis is unavailable" in told, told
            own.start()
            wait_until(notice.is_hidden, timeout=120, interval=0.2)
            # A dashboard that hangs answers nothing at all: its figures looked current for ever.
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                wait_until(notice.is_visible, timeout=120, interval=0.2)
                assert "the dashboard did not answer within 20 s" in notice.inner_text(), notice.inner_text()
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            wait_until(notice.is_hidden, timeout=120, interval=0.2)
        finally:
            proc.stop()


def test_search_by_id_finds_the_task_and_the_list_shows_it(stack, page, tmp_path):
    task_id = send(stack, "eco.record", "findme", countdown=3000)
    page.goto(stack.url + "/scheduled")
    row = page.locator(f'tr[data-task-id="{task_id}"]')
    assert row.count() == 1 and "eco.record" in row.inner_text() and "findme" in row.inner_text()
    shoot(page, "dashboard-scheduled.png", tmp_path)
    page.fill("#search-id", task_id)
    page.press("#search-id", "Enter")
    page.wait_for_url("**/task?id=*")
    assert page.locator("h1 code").inner_text() == task_id
    assert "findme" in page.locator("pre.args").inner_text()


def test_cancel_from_the_page_means_the_worker_never_runs_it(stack, page):
    # A minute of room for the page and the clicks on a busy machine; the witness is due 3 s after
    # the victim. (Were the victim moved before the click, the page would not say it cancelled 1.)
    victim = send(stack, "eco.record", "victim", countdown=60)
    witness = send(stack, "eco.record", "witness", countdown=63)
    page.goto(f"{stack.url}/task?id={victim}")
    page.click("#cancel")
    page.click("#confirm")  # the confirmation page: nothing is cancelled before it
    assert "Cancelled 1 message" in page.locator("#outcome").inner_text()
    # The witness is due after the victim on the same queue and worker: once it ran, the victim
    # would have run before it, had it not been cancelled.
    wait_until(lambda: any(run["id"] == witness for run in stack.runs()), timeout=120)
    assert all(run["id"] != victim for run in stack.runs())
    assert stack.control.find(victim) == []


def test_reschedule_moves_the_task_and_the_worker_runs_it_then(stack, page):
    task_id = send(stack, "eco.record", "moved", countdown=7200)
    page.goto(f"{stack.url}/task?id={task_id}")
    page.fill("#reschedule-countdown input[name=countdown]", "4")
    asked_ms = stack.control.store.time_ms()
    page.click("#reschedule-countdown button")
    page.wait_for_url("**/task?id=*done=*")
    run = wait_until(lambda: next((x for x in stack.runs() if x["id"] == task_id), None), timeout=120)
    assert isinstance(run, dict)
    # The ETA inside the message was rewritten to the new time: 4 s after the click (however late
    # the click was, far from 2 h), not before it.
    assert asked_ms + 4_000 <= run["eta_ms"] <= asked_ms + 600_000
    assert run["ran_ms"] >= run["eta_ms"] - 1  # not before due (the worker's ETA is in whole ms)


def test_read_only_dashboard_refuses_actions(stack, page):
    task_id = send(stack, "eco.record", "keep", countdown=3600)
    page.goto(f"{stack.read_only_url}/task?id={task_id}")
    assert page.locator("#cancel").count() == 0
    assert page.locator(".mode.readonly").count() == 1
    token = next(c["value"] for c in page.context.cookies() if c["name"] == "kombu_delay_csrf")
    reply = page.request.post(
        f"{stack.read_only_url}/task/cancel", form={"id": task_id, "confirm": "yes", "csrf": token}
    )
    assert reply.status == 403 and "read-only" in reply.text()
    assert len(stack.control.find(task_id)) == 1


def test_csrf_is_enforced(stack, page):
    task_id = send(stack, "eco.record", "guarded", countdown=3600)
    page.goto(f"{stack.url}/task?id={task_id}")
    for form in ({"id": task_id, "confirm": "yes"}, {"id": task_id, "confirm": "yes", "csrf": "forged"}):
        reply = page.request.post(f"{stack.url}/task/cancel", form=form)
        assert reply.status == 403 and "CSRF" in reply.text()
    # The token is in the page's own form, and passes there.
    token = page.locator("form:has(#cancel) input[name=csrf]").get_attribute("value")
    ok = page.request.post(f"{stack.url}/task/cancel", form={"id": task_id, "csrf": token or ""})
    assert ok.status == 200 and "Are you sure" in ok.text()
    assert len(stack.control.find(task_id)) == 1


def test_script_in_a_payload_is_shown_as_text(stack, page):
    evil = "<script>window.__pwned = 1</script><img src=x onerror='window.__pwned = 2'>"
    task_id = send(stack, "eco.record", evil, countdown=3600)
    for url in (f"{stack.url}/scheduled", f"{stack.url}/task?id={task_id}"):
        page.goto(url)
        assert page.evaluate("window.__pwned") is None
        assert page.locator("img[src=x]").count() == 0
        assert "<script>window.__pwned = 1</script>" in page.locator("main").inner_text()
