"""Headless Chromium for the tests of pages: Debian's chromium, driven by Playwright
(the ``browser`` fixture in conftest.py opens one for a module)."""

import os
import shutil

import pytest

CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
needs_chromium = pytest.mark.skipif(
    not shutil.which(CHROMIUM) and not os.environ.get("SESSIONACTORS_REQUIRE_CHROMIUM"),
    reason=f"no {CHROMIUM} (Debian's chromium package; .ci/run installs it)",
)
