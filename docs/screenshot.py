"""Makes docs/serve-page.png: `kvchat serve tiny:llama` and three turns typed
into its chat page in headless Chromium. Run: python docs/screenshot.py"""

from __future__ import annotations

import sys
from pathlib import Path

from kvchat.serve.process import ServerProcess
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait


def main() -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1000,760"):
        options.add_argument(flag)
    command = [sys.executable, "-m", "kvchat.serve", "tiny:llama", "--port"]
    with ServerProcess(lambda port: [*command, str(port)]) as server:
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            driver.get(server.url + "/")
            wait = WebDriverWait(driver, 120)
            limit = driver.find_element(By.ID, "max")
            limit.clear()
            limit.send_keys("24")
            questions = [
                "Plan a day in Paris.",
                "Which museums open on Monday?",
                "And where to eat?",
            ]
            for n, text in enumerate(questions, 1):
                box = driver.find_element(By.ID, "input")
                box.send_keys(text, Keys.ENTER)
                wait.until(lambda d, n=n: len(d.find_elements(By.CSS_SELECTOR, ".stats")) == n)
            out = Path(__file__).with_name("serve-page.png")
            driver.save_screenshot(str(out))
            print(f"wrote {out}")
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
