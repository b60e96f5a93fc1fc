"""The chat page in a real headless browser (Debian's chromium driven by playwright): send a message,
watch the answer stream in with the drafted/own colouring and live stats; save a screenshot.

Chromium is installed with apt-get when missing (as root); the test skips only if that is impossible.
Set SPECULANT_ARTIFACTS to a folder to keep the screenshot (else pytest's tmp_path)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from server_util import MODEL, Server

pytestmark = pytest.mark.real


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=900)
        if path := shutil.which("chromium"):
            return path
    pytest.skip("no chromium and it cannot be installed here (needs root and apt-get): "
                "`apt-get install chromium` to run this test")


@pytest.fixture(scope="module")
def server():
    s = Server("--draft", MODEL, "--method", "hybrid")
    yield s
    assert s.stop() == 0, s.output()


def test_chat_page_streams_and_colours_drafted_tokens(server, tmp_path):
    from playwright.sync_api import sync_playwright

    out = Path(os.environ.get("SPECULANT_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.includes('smollm2')", timeout=30000)
            page.fill("#max_tokens", "120")
            page.fill("#input", "Write a Python function that returns the squares of a list of numbers, "
                                "then show an example call.")
            page.keyboard.press("Enter")
            page.wait_for_selector(".msg.assistant span", timeout=60000)  # the first streamed piece
            page.wait_for_selector(".msg.assistant[data-state=done]", timeout=120000)
            answer = page.inner_text(".msg.assistant")
            drafted = page.eval_on_selector_all(".msg.assistant span.drafted", "els => els.length")
            own = page.eval_on_selector_all(".msg.assistant span.own", "els => els.length")
            stats = page.inner_text("#stats")
            meta = page.inner_text(".msg.assistant .meta")
            page.screenshot(path=str(out / "chat_page.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    assert len(answer) > 40 and "def" in answer
    assert drafted > 0 and own > 0  # both kinds of token shown, coloured apart
    assert "acceptance" in stats and "tokens/s –" not in stats  # live numbers, not placeholders
    assert "hybrid" in meta and "finish" in meta
    assert (out / "chat_page.png").stat().st_size > 10000
