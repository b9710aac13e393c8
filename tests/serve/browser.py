"""Whether the browser test of ``vlfit serve`` runs, is skipped, or fails, for want of Debian's chromium.

``scripts/system-packages.sh`` (run by ``make test`` and ``.ci/run``) installs chromium and chromium-driver where it
can. Where they are still missing the test is skipped with the reason, except under CI (``CI=true``, as CI services
set it): there a missing browser fails the test, so CI never passes without having run it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Literal

DEBIAN_DRIVER = "/usr/bin/chromedriver"  # chromium-driver's, found even with /usr/bin off PATH
INSTALL_HINT = "scripts/system-packages.sh installs them where it can (apt-get, and root or sudo without a password)"


def find_browser() -> tuple[str | None, str | None]:
    """Paths of chromium and of chromedriver, each ``None`` when not installed."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (DEBIAN_DRIVER if os.path.exists(DEBIAN_DRIVER) else None)
    return browser, driver


def under_ci(environ: Mapping[str, str]) -> bool:
    """Whether a CI service runs the tests (``CI=true``, or ``1``, as GitHub, GitLab and others set it)."""
    return environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def browser_verdict(browser: str | None, driver: str | None, ci: bool) -> tuple[Literal["run", "skip", "fail"], str]:
    """What the browser test does: ``("run", "")``, or skip or fail with the reason to show.

    Args:
        browser: The chromium executable, or ``None``.
        driver: The chromedriver executable, or ``None``.
        ci: Whether CI runs the tests (a missing browser then fails the test instead of skipping it).
    """
    missing = [name for name, path in (("chromium", browser), ("chromium-driver", driver)) if path is None]
    if not missing:
        return "run", ""
    reason = f"the browser test needs Debian's {' and '.join(missing)}, not installed: {INSTALL_HINT}"
    if ci:
        return "fail", f"{reason} (CI=true: a missing browser fails this test instead of skipping it)"
    return "skip", reason
