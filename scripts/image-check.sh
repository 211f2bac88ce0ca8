#!/usr/bin/env bash
# image-check.sh: build the container image (`make image`) and check what the
# manifests rely on, by running it:
#   - it runs as the numeric non-root user 65532:65532, entrypoint kvrouter;
#   - every binary in it prints --version with this checkout's commit;
#   - two kvsim engines and a kvrouter, each in its own container of the
#     image, serve a completion through the router (host network, free ports).
# Needs a Docker daemon. IMAGE, IMAGE_TAG, DOCKER and IMAGE_BUILD_FLAGS as in
# the Makefile;
# SKIP_BUILD=1 checks an image already built.
set -euo pipefail

cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
IMAGE=${IMAGE:-ghcr.io/kvrouter/kvrouter}
IMAGE_TAG=${IMAGE_TAG:-check}
ref="$IMAGE:$IMAGE_TAG"
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)

fail() { echo "image-check: FAIL: $*" >&2; exit 1; }

if [ "${SKIP_BUILD:-}" != 1 ]; then
	make --no-print-directory image DOCKER="$DOCKER" IMAGE="$IMAGE" IMAGE_TAG="$IMAGE_TAG" COMMIT="$commit" \
		IMAGE_BUILD_FLAGS="${IMAGE_BUILD_FLAGS:-}"
fi

user=$("$DOCKER" inspect "$ref" --format '{{.Config.User}}')
[ "$user" = "65532:65532" ] || fail "image user is '$user', want 65532:65532"
entry=$("$DOCKER" inspect "$ref" --format '{{json .Config.Entrypoint}}')
[ "$entry" = '["/usr/local/bin/kvrouter"]' ] || fail "entrypoint $entry"
echo "image-check: $ref runs as $user, entrypoint $entry"

for b in kvrouter kvbridge kvsim kvbench kvctl; do
	v=$("$DOCKER" run --rm --network none --entrypoint "/usr/local/bin/$b" "$ref" --version)
	case "$v" in
	"$b "*"(commit $commit,"*) echo "image-check: $v" ;;
	*) fail "$b --version printed '$v', want commit $commit" ;;
	esac
done

# Free loopback ports for two engines and the router's two listeners.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
sim=$(free_port); zmq=$(free_port); replay=$(free_port); api=$(free_port); admin=$(free_port)
# kvsim serves instance i on --port+i: make sure the second port is free too.
while ! python3 -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',$((sim + 1))))" 2>/dev/null; do sim=$(free_port); done

work=$(mktemp -d)
names=()
cleanup() {
	for n in "${names[@]}"; do "$DOCKER" rm -f "$n" >/dev/null 2>&1 || true; done
	rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/router.yaml" <<EOF
listen: "127.0.0.1:$api"
admin_listen: "127.0.0.1:$admin"
pools:
  - name: sim
    model: sim-model
    routing:
      strategy: prefix_aware
    health:
      path: /health
      interval: 1s
    instances:
      - id: sim-0
        url: http://127.0.0.1:$sim
      - id: sim-1
        url: http://127.0.0.1:$((sim + 1))
EOF
chmod 0644 "$work/router.yaml"
chmod 0755 "$work"

tag=$$
names+=("kvrouter-check-sim-$tag" "kvrouter-check-router-$tag")
"$DOCKER" run -d --name "kvrouter-check-sim-$tag" --network host --entrypoint /usr/local/bin/kvsim "$ref" \
	--instances 2 --port "$sim" --zmq-port "$zmq" --replay-port "$replay" --model sim-model >/dev/null
"$DOCKER" run -d --name "kvrouter-check-router-$tag" --network host -v "$work:/config:ro" "$ref" \
	--config /config/router.yaml >/dev/null

ready=""
for _ in $(seq 1 60); do
	if curl -fsS "http://127.0.0.1:$admin/readyz" >/dev/null 2>&1; then ready=1; break; fi
	sleep 1
done
if [ -z "$ready" ]; then
	"$DOCKER" logs "kvrouter-check-router-$tag" >&2 || true
	"$DOCKER" logs "kvrouter-check-sim-$tag" >&2 || true
	fail "router not ready on :$admin after 60 s"
fi

resp=$(curl -sS -D "$work/headers" -H 'content-type: application/json' \
	-d '{"model":"sim-model","prompt":"hello from a container","max_tokens":4}' \
	"http://127.0.0.1:$api/v1/completions")
grep -qi '^x-kvrouter-instance: sim-[01]' "$work/headers" || { cat "$work/headers" >&2; fail "no x-kvrouter-instance header"; }
case "$resp" in
*'"choices"'*) ;;
*) fail "completion answered: $resp" ;;
esac
echo "image-check: a completion through kvrouter to kvsim, both in containers of $ref: $(grep -i '^x-kvrouter-instance' "$work/headers" | tr -d '\r')"
echo "image-check: OK"
