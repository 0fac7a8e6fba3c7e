"""Headless Chromium for the console tests (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium).

No browser is downloaded: the binaries must be on the machine (``deploy/setup.sh``
installs them when it runs as root). Where they are missing, the tests that
need a browser skip and say what to install.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER_CANDIDATES = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1360,2000",
)


def _first(paths: tuple[str, ...], name: str) -> str | None:
    return next((p for p in paths if Path(p).exists()), None) or shutil.which(name)


def start_chromium(profile_dir: Path):
    """A Selenium ``webdriver.Chrome`` on the system Chromium with a fresh profile and browser logs on.

    Skips the calling test when Selenium, Chromium or its driver is missing.
    """
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    binary, driver = _first(CHROMIUM_CANDIDATES, "chromium"), _first(DRIVER_CANDIDATES, "chromedriver")
    if binary is None or driver is None:
        pytest.skip(
            "headless Chromium not found: install Debian's `chromium` and `chromium-driver` (deploy/setup.sh does as root)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(
        options=options,
        service=Service(executable_path=driver, log_output=str(profile_dir.parent / "chromedriver.log")),
    )


def console_errors(driver) -> list[dict]:
    """Browser log entries of level SEVERE since the last call (console errors, failed loads, CSP violations)."""
    return [entry for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]
