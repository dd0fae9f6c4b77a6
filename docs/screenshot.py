"""Makes docs/serve-page.png: `kvchat serve tiny:llama` and three turns typed
into its chat page in headless Chromium. Run: python docs/screenshot.py"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvchat.serve", "tiny:llama", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1000,760"):
        options.add_argument(flag)
    driver = None
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        driver.get(url + "/")
        wait = WebDriverWait(driver, 120)
        limit = driver.find_element(By.ID, "max")
        limit.clear()
        limit.send_keys("24")
        questions = ["Plan a day in Paris.", "Which museums open on Monday?", "And where to eat?"]
        for n, text in enumerate(questions, 1):
            box = driver.find_element(By.ID, "input")
            box.send_keys(text, Keys.ENTER)
            wait.until(lambda d, n=n: len(d.find_elements(By.CSS_SELECTOR, ".stats")) == n)
        out = Path(__file__).with_name("serve-page.png")
        driver.save_screenshot(str(out))
        print(f"wrote {out}")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
