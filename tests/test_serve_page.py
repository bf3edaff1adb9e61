"""The page of `elmo serve` in a real headless browser (Debian's chromium, driven by Selenium
through Debian's chromedriver; never a downloaded browser): typing sentences shows the nearest
occurrences per layer and draws the PCA pictures, and a screenshot of it is not blank."""

from __future__ import annotations

import io
import shutil

import pytest

from tests.serving import Server, save_tiny_model

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver; "
                ".ci/run installs them)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1300,1500",
                "--disable-dev-shm-usage"]
APPLE = ["I ate an apple and a pear .", "The apple pie was sweet .", "Apple sold more phones this year .",
         "She bought an apple from the market .", "Shares of apple rose today ."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(save_tiny_model(tmp_path_factory.mktemp("page")))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in BROWSER_ARGS:
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def results_shown(driver) -> bool:
    return len(driver.find_elements(By.CSS_SELECTOR, "section.layer")) == 3


def open_page(server, browser) -> None:
    """Load the page and wait until its starting text (GET /explore/examples) is in."""
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "sentences").get_property("value"))


def test_the_page_starts_with_the_demos_play_sentences(server, browser):
    open_page(server, browser)
    assert browser.find_element(By.ID, "word").get_property("value") == "play"
    assert len(browser.find_element(By.ID, "sentences").get_property("value").splitlines()) == 24
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 60).until(results_shown)
    assert len(browser.find_elements(By.CSS_SELECTOR, "section.layer svg circle")) == 3 * 24


def test_typed_sentences_show_nearest_occurrences_and_a_picture(server, browser, tmp_path):
    from PIL import Image

    open_page(server, browser)
    for field, text in (("query", "I like to eat apple ."), ("word", "apple"), ("sentences", "\n".join(APPLE))):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(text)
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 60).until(results_shown)
    layers = browser.find_elements(By.CSS_SELECTOR, "section.layer")
    for number, layer in enumerate(layers):
        assert layer.find_element(By.TAG_NAME, "h2").text.startswith(f"layer {number} ")
        rows = layer.find_elements(By.CSS_SELECTOR, "table.neighbours tr")
        assert len(rows) == 4  # "Apple" (capitalised) is another word: 4 occurrences of "apple"
        assert all(row.find_element(By.TAG_NAME, "mark").text == "apple" for row in rows)
        assert len(layer.find_elements(By.CSS_SELECTOR, "svg circle")) == 4
        assert layer.find_element(By.CSS_SELECTOR, "svg .query-star").text == "\u2605"
    assert "error" not in browser.find_element(By.ID, "status").get_attribute("class")
    png = browser.find_element(By.ID, "results").screenshot_as_png
    (tmp_path / "page.png").write_bytes(png)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    white = max(count for count, _ in colours)
    assert len(colours) > 50, "the picture is nearly blank"
    assert image.width * image.height - white > 0.05 * image.width * image.height  # more than background
    assert any(abs(r - 31) < 20 and abs(g - 119) < 20 and abs(b - 180) < 20 for _, (r, g, b) in colours), \
        "no point of the first cluster's colour was drawn"


def test_a_bad_word_shows_the_servers_message_and_no_stale_results(server, browser):
    open_page(server, browser)
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 60).until(results_shown)  # the results of a good question...
    word = browser.find_element(By.ID, "word")
    word.clear()
    word.send_keys("zebra")
    browser.find_element(By.ID, "go").click()
    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, 30).until(lambda d: "error" in status.get_attribute("class"))
    assert "'zebra' is not a token of the query sentence" in status.text
    assert not browser.find_elements(By.CSS_SELECTOR, "section.layer")  # ...are not left under the error
    assert browser.find_element(By.ID, "go").is_enabled()


def test_the_page_shows_progress_while_it_waits(server, browser):
    """The server's answer held back (the page's fetch stubbed until released): a bar and a
    clock show, the button is off and the last results are gone; the answer puts them back."""
    open_page(server, browser)
    go, progress, status = (browser.find_element(By.ID, name) for name in ("go", "progress", "status"))
    go.click()
    WebDriverWait(browser, 60).until(results_shown)
    assert not progress.is_displayed()
    browser.execute_script("const real = window.fetch; window.fetch = (...args) => new Promise("
                           "(resolve) => { window.release = () => resolve(real(...args)); });")
    go.click()
    WebDriverWait(browser, 10).until(lambda d: status.text.endswith(" 1 s"))  # the clock runs
    assert status.text == "embedding 24 sentences... 1 s"
    assert progress.is_displayed() and not go.is_enabled()
    assert not browser.find_elements(By.CSS_SELECTOR, "section.layer")
    browser.execute_script("window.release()")
    WebDriverWait(browser, 60).until(results_shown)
    assert not progress.is_displayed() and go.is_enabled() and status.text.startswith("query: ")
