"""The HTML report in a real browser: Debian's headless Chromium through Selenium.

Chromium and chromedriver come from Debian (``chromium``, ``chromium-driver``: never a
browser download); the test skips when either is missing, unless
``GPUHEALTH_TEST_SERVERS=required`` (CI), in which case it fails. Flags as in infra.md
section 6, with a fresh ``--user-data-dir``. The page is loaded from a ``file://`` URL: it
must need nothing else (no network, no script).
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from dashboards.report import ReportOptions, build_report, render_html
from storage.history import IncidentHistory
from storage.importers import import_titan
from tests.servers import servers_required

FIXTURES = Path(__file__).parents[1] / "fixtures" / "history"
CHROMIUM = ("/usr/bin/chromium", "chromium")
CHROMEDRIVER = ("/usr/bin/chromedriver", "chromedriver")


def _binary(names: tuple[str, ...], package: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    message = f"{names[-1]} not found (apt-get install {package})"
    if servers_required():
        pytest.fail(f"GPUHEALTH_TEST_SERVERS=required but {message}")
    pytest.skip(message)
    raise AssertionError("unreachable")


@pytest.fixture
def report_page(tmp_path: Path) -> Path:
    result = import_titan(FIXTURES / "titan")
    with IncidentHistory(tmp_path / "history.sqlite") as store:
        store.upsert_inventory(result.inventory)
        store.upsert_incidents(result.incidents)
        figures = build_report(store, ReportOptions(source="titan"), now=lambda: 1.8e9)
    page = tmp_path / "report.html"
    page.write_text(render_html(figures), encoding="utf-8")
    return page


@pytest.fixture
def browser(tmp_path: Path):
    chromium = _binary(CHROMIUM, "chromium")
    driver_path = _binary(CHROMEDRIVER, "chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        if servers_required():
            pytest.fail("GPUHEALTH_TEST_SERVERS=required but selenium is not installed")
        pytest.skip("selenium is not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=driver_path, log_output=str(tmp_path / "driver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def test_report_renders_in_chromium(browser, report_page: Path, tmp_path: Path) -> None:
    browser.get(report_page.as_uri())
    assert browser.title == "GPU fleet reliability report"
    # The page itself has no script; these calls only read the rendered DOM.
    images = browser.execute_script(
        "return Array.from(document.images).map("
        "i => [i.complete, i.naturalWidth, i.naturalHeight, i.alt]);")
    assert len(images) >= 3, images
    for complete, width, height, alt in images:
        assert complete, alt
        assert width > 100, (alt, width)
        assert height > 50, (alt, height)
    sections = browser.execute_script(
        "return Array.from(document.querySelectorAll('section h2')).map(h => h.textContent);")
    assert "Availability and GPU-hours lost" in sections
    assert "Caveats" in sections
    height = browser.execute_script("return document.documentElement.scrollHeight;")
    browser.set_window_size(1200, min(int(height) + 100, 12000))
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot))
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe

    from PIL import Image

    data = shot.read_bytes()
    assert len(data) > 30_000
    with Image.open(io.BytesIO(data)) as image:
        assert image.width >= 1000
        assert image.height > 2000
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000)
    assert colours is not None
    assert len(colours) > 50


def test_console_errors_are_caught(browser, tmp_path: Path) -> None:
    """The check above can fail: a page with a missing image logs a SEVERE entry."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><head><title>x</title></head><body>'
                    '<img src="missing.png" alt="missing"></body></html>')
    browser.get(page.as_uri())
    images = browser.execute_script("return Array.from(document.images).map("
                                    "i => i.naturalWidth);")
    assert images == [0]
    assert any(e["level"] == "SEVERE" for e in browser.get_log("browser"))
