"""The browser test's run / skip / fail decision, and scripts/system-packages.sh on a machine without chromium
(commands stubbed on PATH: nothing is installed or removed here)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.serve.browser import browser_verdict, under_ci

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "system-packages.sh"


def test_a_missing_browser_fails_under_ci_and_is_skipped_with_the_reason_elsewhere() -> None:
    verdict, reason = browser_verdict(None, "/usr/bin/chromedriver", ci=True)
    assert verdict == "fail" and "chromium" in reason and "CI=true" in reason
    verdict, reason = browser_verdict(None, None, ci=False)
    assert verdict == "skip"
    assert "chromium and chromium-driver, not installed" in reason and "scripts/system-packages.sh" in reason
    verdict, reason = browser_verdict("/usr/bin/chromium", None, ci=False)
    assert verdict == "skip" and "needs Debian's chromium-driver, not installed" in reason


@pytest.mark.parametrize("ci", [True, False])
def test_a_present_browser_runs(ci: bool) -> None:
    assert browser_verdict("/usr/bin/chromium", "/usr/bin/chromedriver", ci=ci) == ("run", "")


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("1", True), ("TRUE", True), ("", False),
                                                 ("false", False), ("0", False)])  # fmt: skip
def test_ci_is_read_from_the_environment(value: str, expected: bool) -> None:
    assert under_ci({"CI": value}) is expected
    assert under_ci({}) is False


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_script(tmp_path: Path, *, uid: int, sudo: bool, apt: bool) -> tuple[subprocess.CompletedProcess, str]:
    """The script with only stubs on PATH: no chromium, ``id -u`` = ``uid``, apt-get and sudo as asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "calls"
    _stub(bin_dir, "id", f"echo {uid}")
    if apt:
        _stub(bin_dir, "apt-get", f'echo "apt-get $*" >> {calls}')
    if sudo:
        _stub(bin_dir, "sudo", f'[ "$1" = -n ] && shift; echo "sudo" >> {calls}; "$@"')
    done = subprocess.run(["/bin/bash", str(SCRIPT)], env={"PATH": str(bin_dir)}, capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    return done, calls.read_text() if calls.exists() else ""


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="the script is a bash script")
def test_the_script_installs_with_apt_as_root_or_with_sudo_and_says_so_in_one_line_when_it_cannot(tmp_path) -> None:
    # nginx is found at /usr/sbin/nginx whatever PATH says (Debian's place, off a user's PATH).
    missing = "chromium chromium-driver" + ("" if os.path.exists("/usr/sbin/nginx") else " nginx")
    done, calls = _run_script(tmp_path / "root", uid=0, sudo=False, apt=True)
    assert done.returncode == 0
    assert calls.splitlines() == ["apt-get update -q", f"apt-get install -y -q --no-install-recommends {missing}"]
    assert f"apt-get install {missing} failed" in done.stdout.splitlines()[-1]  # the stub installs none

    done, calls = _run_script(tmp_path / "sudo", uid=1000, sudo=True, apt=True)
    assert calls.count("sudo") >= 2 and "apt-get install" in calls

    done, calls = _run_script(tmp_path / "user", uid=1000, sudo=False, apt=True)
    assert done.returncode == 0 and calls == "" and done.stderr == ""
    assert done.stdout.splitlines() == [
        f"{missing} not installed (installing them needs root or sudo without a password): the tests of vlfit serve "
        f"that need them are skipped; to run them, install them: sudo apt-get install {missing}"
    ]

    done, calls = _run_script(tmp_path / "no-apt", uid=0, sudo=False, apt=False)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1
    assert "(installing them needs apt-get)" in done.stdout
