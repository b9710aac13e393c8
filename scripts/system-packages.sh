#!/usr/bin/env bash
# The system packages the tests need beyond pip's, installed with apt-get when they are missing and this machine
# allows it (apt-get, and root or sudo without a password). `make test` and .ci/run both call it.
#   chromium, chromium-driver (Debian's): tests/serve/test_server.py drives vlfit serve's page headless through
#   them (never a browser download).
# Where they stay missing it says so in one line and exits 0: that one test is then skipped with the reason, or
# fails under CI=true, so CI never skips it silently (tests/serve/browser.py decides).
set -uo pipefail
PACKAGES="chromium chromium-driver"

present() {
  { command -v chromium || command -v chromium-browser; } >/dev/null &&
    { command -v chromedriver >/dev/null || [ -x /usr/bin/chromedriver ]; }
}

present && exit 0
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  SUDO="none"
fi
if [ "$SUDO" != none ] && command -v apt-get >/dev/null; then
  echo "installing $PACKAGES (apt-get) for the browser test of vlfit serve"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends $PACKAGES
  present && exit 0
  why="apt-get install $PACKAGES failed (above)"
elif [ "$SUDO" = none ]; then
  why="installing them needs root or sudo without a password"
else
  why="installing them needs apt-get"
fi
echo "$PACKAGES not installed ($why): the browser test of vlfit serve is skipped; to run it, install them: sudo apt-get install $PACKAGES"
