"""The daemon's page in a real browser: Debian's Chromium (`make browser`) driven by
Playwright, against a real daemon on the embedded toy model (two MTP heads) with an
API key. Chromium is kept off the network: no name resolves, background services are
off, and every request the page makes is checked to go to the daemon only.

MTPLXD_PAGE_SCREENSHOTS=docs/ writes the screenshots the docs show (docs/page*.png)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.daemon_fixture import DaemonInfo, running_daemon

CHROMIUM = "/usr/bin/chromium"
KEY = "page-key"
OFFLINE_FLAGS = [
    "--no-sandbox",  # CI runs as root
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # nothing resolves but the daemon
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-domain-reliability", "--no-first-run", "--no-default-browser-check",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
    "--metrics-recording-only", "--disable-breakpad",
]
SHORT_MS = 20_000

sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip("Chromium is not installed: `make browser` installs it", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """A daemon on a fixed port, stopped and started again by the reconnect test."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stack: contextlib.ExitStack | None = None
        self.info: DaemonInfo | None = None

    def start(self) -> None:
        self._stack = contextlib.ExitStack()
        self.info = self._stack.enter_context(
            running_daemon(self.state_dir, None, "--api-key", KEY, "--port", str(self.port)))

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("state"))
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=OFFLINE_FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, daemon):
    """One tab for the whole module, the key given once; console errors and requests
    anywhere but the daemon are collected and checked at the end."""
    context = browser.new_context(viewport={"width": 1200, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(SHORT_MS)
    errors: list[str] = []
    elsewhere: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: None if r.url.startswith(daemon.url) else elsewhere.append(r.url))
    page.goto(daemon.url + "/")
    page.errors, page.elsewhere = errors, elsewhere  # type: ignore[attr-defined]
    yield page
    assert elsewhere == [], f"the page reached outside the daemon: {elsewhere}"
    context.close()


def shot(page, name: str, top_only: bool = False) -> None:
    folder = os.environ.get("MTPLXD_PAGE_SCREENSHOTS")
    if folder and top_only:
        page.locator("header").screenshot(path=str(Path(folder) / name))
    elif folder:
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def test_the_page_asks_for_the_key_then_shows_the_model_without_console_errors(page, daemon):
    page.wait_for_selector("#key-form:not([hidden])")
    assert page.inner_text("#conn") == "needs API key"
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_function("() => document.getElementById('conn').dataset.state === 'up'")
    assert not page.is_visible("#key-form")
    status = httpx.get(daemon.url + "/v1/status", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert page.inner_text("#model-name") == status["model"]["id"]
    facts = page.inner_text("#model-facts")
    assert "mimo" in facts and "MTP heads" in facts and "depth at T=0" in facts
    assert KEY not in page.url  # the key stays out of URLs: session storage and a header
    assert page.evaluate("sessionStorage.getItem('mtplxd.apiKey')") == KEY
    page.wait_for_timeout(1500)  # a few documents later: still no error
    assert page.errors == []


def test_a_chat_message_streams_an_answer_with_token_marks(page):
    assert page.inner_text("#play-acceptance") == "—"
    page.fill("#play-temperature", "0")
    page.fill("#play-max-tokens", "48")
    page.fill("#play-input", "def add(a, b):")
    page.click("#play-send")
    page.wait_for_function("() => document.getElementById('play-send').disabled === false "
                           "&& document.querySelectorAll('#play-output .tok').length > 0")
    assert page.locator("#play-output .tok").count() == 48
    assert page.locator("#play-output .tok.src-1").count() > 0  # accepted drafts of head 1
    assert page.locator("#play-output .tok.src-0").count() > 0  # the trunk's tokens
    first = page.inner_text("#play-acceptance")
    assert first.endswith("%") and float(page.inner_text("#play-tps")) > 0
    detail = page.inner_text("#play-detail")
    assert "drafted" in detail
    page.fill("#play-max-tokens", "6")
    page.fill("#play-input", "Write a story about a cat.")
    page.click("#play-send")
    page.wait_for_function("() => document.getElementById('play-send').disabled === false "
                           "&& document.querySelectorAll('#play-output .turn').length === 2")
    assert page.inner_text("#play-tokens") == "6"  # this answer's own figures
    assert page.inner_text("#play-detail") != detail and page.inner_text("#play-acceptance").endswith("%")
    page.wait_for_function("() => state.points.some((p) => p.acceptance.length > 0 && p.tokens_per_s > 0)")
    assert page.errors == []
    shot(page, "page.png")


def test_a_plain_completion_streams_after_its_prompt(page):
    page.select_option("#play-mode", "completion")
    page.fill("#play-temperature", "0")
    page.fill("#play-input", "import numpy as np\n")
    page.click("#play-send")
    page.wait_for_function("() => document.getElementById('play-send').disabled === false "
                           "&& document.querySelectorAll('#play-output .tok').length > 0")
    assert page.inner_text("#play-output").startswith("import numpy as np")
    assert page.locator("#play-output .tok").count() == int(page.inner_text("#play-tokens"))
    page.select_option("#play-mode", "chat")
    page.click("#play-clear")
    assert page.errors == []


def test_a_failed_request_shows_the_api_error(page):
    page.fill("#play-max-tokens", "100000")
    page.fill("#play-input", "hello")
    page.click("#play-send")
    page.wait_for_selector("#play-error:not([hidden])")
    assert "context length" in page.inner_text("#play-error")
    page.fill("#play-max-tokens", "48")
    page.errors.clear()  # the browser logs the refused request (400) itself


def test_a_second_clients_stream_appears_in_the_queue(page, daemon):
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    seen, done = threading.Event(), threading.Event()

    def other_client() -> None:
        with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            for _ in response.iter_lines():
                if seen.is_set() or done.is_set():
                    return

    worker = threading.Thread(target=other_client)
    worker.start()
    try:
        page.wait_for_selector("#jobs tbody tr[data-client='openai'] >> text=running")
        seen.set()
    finally:
        done.set()
        worker.join(30)
    row = page.inner_text("#jobs tbody tr")
    assert "normal" in row
    page.wait_for_selector("#jobs tbody tr", state="detached")  # the client left: its job ended


def test_a_stopped_daemon_is_shown_down_and_reconnected_when_it_returns(page, daemon):
    daemon.stop()
    page.wait_for_function("() => document.getElementById('conn').dataset.state === 'down'")
    assert page.inner_text("#conn").startswith("down")
    shot(page, "page-down.png", top_only=True)
    daemon.start()
    page.wait_for_function("() => document.getElementById('conn').dataset.state === 'up'", timeout=60_000)
    before = page.inner_text("#uptime")  # and the documents keep coming
    page.wait_for_function(f"() => document.getElementById('uptime').textContent !== {before!r}")
    page.errors[:] = [e for e in page.errors if "ERR_CONNECTION_REFUSED" not in e and "ERR_EMPTY_RESPONSE" not in e
                      and "net::" not in e]  # the browser's own log of the refused reconnects
    assert page.errors == []
