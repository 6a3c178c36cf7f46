#!/usr/bin/env bash
# The browser the page test drives: Debian's chromium and chromium-driver, installed when missing.
# As root (CI) it installs them; elsewhere it says what to install and carries on (the test then
# skips locally; in CI it would fail, so CI must have them).
set -u
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
        { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null; }
    command -v chromium >/dev/null && command -v chromedriver >/dev/null && exit 0
    echo "install_browser.sh: could not install chromium and chromium-driver" >&2
    exit 1
fi
echo "install_browser.sh: chromium and chromedriver are missing (apt-get install chromium chromium-driver as root);" \
     "the page test skips without them outside CI" >&2
exit 0
