"""A real headless browser for pages the project writes: the system chromium, driven by
selenium through the system chromedriver (Debian packages ``chromium`` and
``chromium-driver``; tests/conftest.py installs them where it can).

:func:`open_page` opens one local file and says what a person opening it would meet:
what the console said, every request the page made, the text on screen, and whether
given elements are shown with a size.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
FLAGS = (
    "--headless=new",
    "--no-sandbox",  # root, in a container
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-extensions",
    "--disable-background-networking",  # the browser's own calls home are not the page's
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--window-size=1400,1000",
)
VISIBILITY = """
return arguments[0].map(id => {
  const element = document.getElementById(id);
  if (!element) return [id, false, false, 0, 0];
  const box = element.getBoundingClientRect();
  const shown = element.checkVisibility({checkOpacity: true, checkVisibilityCSS: true});
  return [id, true, shown, box.width, box.height];
});
"""


@dataclass(frozen=True)
class Element:
    present: bool
    shown: bool
    width: float
    height: float

    @property
    def visible(self) -> bool:
        """Rendered, not hidden, and with an area."""
        return self.present and self.shown and self.width > 0 and self.height > 0


@dataclass
class PageResult:
    url: str
    console: list[tuple[str, str]]
    """(level, message): SEVERE, WARNING, INFO... (uncaught exceptions and failed loads too)."""
    requests: list[str]
    """Every URL the page asked for, the page itself first."""
    text: str
    """``document.body.innerText``: what is on screen."""
    elements: dict[str, Element] = field(default_factory=dict)

    @property
    def errors(self) -> list[str]:
        return [message for level, message in self.console if level == "SEVERE"]

    @property
    def warnings(self) -> list[str]:
        return [message for level, message in self.console if level == "WARNING"]

    @property
    def foreign_requests(self) -> list[str]:
        """Requests for anything but the page itself: a self-contained page makes none."""
        return [url for url in self.requests if url.split("#")[0] != self.url]


def browser_missing() -> str | None:
    """What to install when there is no browser to drive, else None."""
    if not any(shutil.which(name) for name in CHROMIUM) or not shutil.which("chromedriver"):
        return "a headless browser: apt-get install chromium chromium-driver"
    return None


def start_browser(logs: bool = False):
    """A fresh headless chromium driven by selenium (``logs``: keeping the console and
    the network log); the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = browser_missing()
    if missing:
        raise RuntimeError(f"the browser needs {missing}")
    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(name) for name in CHROMIUM if shutil.which(name))
    for flag in FLAGS:
        options.add_argument(flag)
    if logs:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    # An explicit chromedriver: selenium must not go looking for one to download.
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def open_page(path: Path, element_ids: tuple[str, ...] | list[str] = ()) -> PageResult:
    """Open ``path`` in a fresh headless chromium, wait for it to load, and report."""
    url = Path(path).resolve().as_uri()
    driver = start_browser(logs=True)
    try:
        driver.set_page_load_timeout(30)
        driver.get(url)
        driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "requestAnimationFrame(() => requestAnimationFrame(() => done()));"  # laid out and painted
        )
        text = driver.execute_script("return document.body ? document.body.innerText : ''")
        boxes = driver.execute_script(VISIBILITY, list(element_ids))
        resources = driver.execute_script("return performance.getEntriesByType('resource').map(entry => entry.name)")
        console = [(entry["level"], entry["message"]) for entry in driver.get_log("browser")]
        requests = []
        for entry in driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                requests.append(message["params"]["request"]["url"])
    finally:
        driver.quit()
    requests += [name for name in resources if name not in requests]
    elements = {box[0]: Element(present=box[1], shown=box[2], width=box[3], height=box[4]) for box in boxes}
    return PageResult(url=url, console=console, requests=requests, text=text, elements=elements)
