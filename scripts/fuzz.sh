#!/usr/bin/env bash
# Runs every Go fuzz target in the module for $1 (a Go duration) each.
set -euo pipefail
t=${1:-30s}
cd "$(dirname "$0")/.."
found=0
while IFS= read -r f; do
	pkg=./$(dirname "$f")
	for target in $(grep -oE '^func (Fuzz[A-Za-z0-9_]+)\(' "$f" | sed -E 's/^func (Fuzz[A-Za-z0-9_]+)\(/\1/'); do
		found=1
		echo "fuzz $pkg $target ($t)"
		go test -run '^$' -fuzz "^${target}\$" -fuzztime "$t" "$pkg"
	done
done < <(git ls-files '*_test.go' | xargs grep -l '^func Fuzz' 2>/dev/null || true)
[ "$found" = 1 ] || echo "no fuzz targets"
