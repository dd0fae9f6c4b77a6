"""The chat page at / in a real headless Chromium (Debian's chromium and
chromium-driver, driven by selenium): a person types, the reply streams in,
and each turn shows what was reused and prefilled, and the TTFT."""

from __future__ import annotations

import re

import pytest
from helpers import reference_turn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from serving import Server, reference_model

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def page_server():
    server = Server("tiny:llama")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _stats(turn) -> dict[str, str]:
    return {
        span.get_attribute("class"): span.text.split(" ", 1)[1]
        for span in turn.find_elements(By.CSS_SELECTOR, ".stats span")
    }


def test_the_page_chats_and_shows_the_cache_at_work(page_server, browser, tokenizer, tmp_path):
    model = reference_model("llama")
    browser.get(page_server.url + "/")
    wait = WebDriverWait(browser, 120)
    wait.until(lambda d: d.find_element(By.ID, "model").text == "tiny:llama")
    messages = []
    for turn, text in enumerate(["Tell me about Paris.", "And about its museums?"]):
        box = browser.find_element(By.ID, "input")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)
        # The turn is done when its stats line appears under the reply.
        wait.until(
            lambda d, n=turn + 1: len(d.find_elements(By.CSS_SELECTOR, ".assistant .stats")) == n
        )
        reply_turn = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")[-1]
        reply = reply_turn.find_element(By.CSS_SELECTOR, ".msg").get_attribute("textContent")
        messages.append({"role": "user", "content": text})
        want, prompt, _ = reference_turn(model, tokenizer, messages, 128)  # the page's default
        assert reply == want, turn  # the page shows exactly the reply
        stats = _stats(reply_turn)
        reused, prefilled = int(stats["reused"]), int(stats["prefilled"])
        assert reused + prefilled == prompt.numel()
        assert re.fullmatch(r"\d+ ms", stats["ttft"])
        if turn == 0:
            assert reused == 0
        else:
            assert reused > 0.5 * prompt.numel(), stats
        messages.append({"role": "assistant", "content": want})
    browser.save_screenshot(str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000
