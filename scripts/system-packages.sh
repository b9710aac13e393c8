#!/usr/bin/env bash
# The system packages the tests need beyond pip's, installed with apt-get when they are missing and this machine
# allows it (apt-get, and root or sudo without a password). `make test` and .ci/run both call it.
#   chromium, chromium-driver (Debian's): tests/serve/test_server.py drives vlfit serve's page headless through
#   them (never a browser download).
#   nginx (Debian's): tests/serve/test_nginx_front.py runs deploy/nginx/'s front in front of vlfit serve (never a
#   server binary download).
# Where they stay missing it says so in one line and exits 0: the tests that need them are then skipped with the
# reason, or fail under CI=true, so CI never skips them silently (tests/serve/browser.py and tests/serve/nginx.py
# decide).
set -uo pipefail

browser_present() {
  { command -v chromium || command -v chromium-browser; } >/dev/null &&
    { command -v chromedriver >/dev/null || [ -x /usr/bin/chromedriver ]; }
}

nginx_present() {
  command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]  # /usr/sbin is off a user's PATH on Debian
}

missing() {
  local packages=""
  browser_present || packages="chromium chromium-driver"
  nginx_present || packages="${packages:+$packages }nginx"
  echo "$packages"
}

PACKAGES="$(missing)"
[ -z "$PACKAGES" ] && exit 0
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  SUDO="none"
fi
if [ "$SUDO" != none ] && command -v apt-get >/dev/null; then
  echo "installing $PACKAGES (apt-get) for the browser and nginx front tests of vlfit serve"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086  # one word per package
  $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends $PACKAGES
  [ -z "$(missing)" ] && exit 0
  why="apt-get install $PACKAGES failed (above)"
elif [ "$SUDO" = none ]; then
  why="installing them needs root or sudo without a password"
else
  why="installing them needs apt-get"
fi
PACKAGES="$(missing)"
echo "$PACKAGES not installed ($why): the tests of vlfit serve that need them are skipped; to run them, install them: sudo apt-get install $PACKAGES"
