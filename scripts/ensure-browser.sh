#!/usr/bin/env bash
# Installs Debian's chromium (headless-capable) for the dashboard's browser
# test (test/browser) when no Chromium is on PATH. Idempotent; prints the
# browser's path on success. CHROMIUM=/path/to/chrome skips the install.
set -euo pipefail
if [ -n "${CHROMIUM:-}" ] && [ -x "${CHROMIUM}" ]; then
	echo "${CHROMIUM}"
	exit 0
fi
for b in chromium chromium-browser google-chrome-stable google-chrome; do
	if command -v "$b" >/dev/null 2>&1; then
		command -v "$b"
		exit 0
	fi
done
echo "chromium missing: installing Debian package chromium" >&2
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
$SUDO apt-get update -qq >&2
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2
command -v chromium
