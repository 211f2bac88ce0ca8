#!/usr/bin/env bash
# Installs what the test suite needs when it is missing. Tests start their own
# redis-server on a free port unless REDIS_ADDR is set, so the binary must exist.
set -euo pipefail
if [ -z "${REDIS_ADDR:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
	echo "redis-server missing: installing Debian package redis-server"
	if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
	$SUDO apt-get update -qq && $SUDO DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
fi
"$(dirname "$0")/ensure-browser.sh" >/dev/null # chromium for test/browser (the dashboard test)
