"""The chat page at / in headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium): typed messages get streamed replies, the conversation goes on over turns, Shift+Enter
is a new line, Alt+N starts over. The replies are the model's greedy ones (`chat` at temperature 0)."""

import os
import shutil

import pytest

from nanoeuler_core.inference.chat import chat
from test_serve import alpaca_run, model_tok, server  # noqa: F401  (fixtures)

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

DRIVER = shutil.which("chromedriver") or "/usr/lib/chromium/chromedriver"
pytestmark = pytest.mark.skipif(shutil.which("chromium") is None or not os.path.exists(DRIVER),
                                reason="needs Debian's chromium and chromium-driver (the README's test command "
                                       "installs them)")
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def user(text):
    return {"role": "user", "content": text}


def test_the_page_streams_replies_over_turns_and_starts_over(server, browser, model_tok):  # noqa: F811
    model, tok = model_tok
    browser.get(server[0] + "/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: "tiny-sft" in d.find_element(By.ID, "model").text)
    browser.find_element(By.TAG_NAME, "summary").click()   # settings: greedy, short replies
    for field, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)

    box = browser.find_element(By.ID, "input")
    two_lines = ("Add 2", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "and 3.")   # Shift+Enter: a new line, not sent
    box.send_keys(*two_lines)
    assert box.get_attribute("value") == "Add 2\nand 3." and not browser.find_elements(By.CSS_SELECTOR, "#log li")

    def ask(*keys):
        box.send_keys(*keys, Keys.ENTER)
        wait.until(lambda d: d.find_element(By.ID, "composer").get_attribute("data-state") == "idle"
                   and d.find_elements(By.CSS_SELECTOR, "#log li.assistant:not(.streaming)"))
        return browser.find_elements(By.CSS_SELECTOR, "#log li")[-1]

    conversation = [user("Add 2\nand 3.")]
    first = ask()
    expected = chat(model, tok, conversation, max_new_tokens=MAX_TOKENS, temperature=0.0)
    assert first.find_element(By.CLASS_NAME, "text").get_property("textContent") == expected
    assert int(first.get_attribute("data-chunks")) > 1                        # it arrived in pieces
    conversation += [{"role": "assistant", "content": expected}, user("Reverse the word: night")]
    second = ask("Reverse the word: night")
    assert second.find_element(By.CLASS_NAME, "text").get_property("textContent") == \
        chat(model, tok, conversation, max_new_tokens=MAX_TOKENS, temperature=0.0)
    assert [li.get_attribute("class") for li in browser.find_elements(By.CSS_SELECTOR, "#log li")] == \
        ["user", "assistant", "user", "assistant"]
    assert browser.switch_to.active_element == box                            # ready for the next message

    box.send_keys(Keys.ALT, "n")                                              # New chat
    assert not browser.find_elements(By.CSS_SELECTOR, "#log li")
    third = ask(*two_lines)                                                   # a fresh conversation
    assert third.find_element(By.CLASS_NAME, "text").get_property("textContent") == expected
