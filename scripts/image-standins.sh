#!/usr/bin/env bash
# image-standins.sh: for a machine with a Docker daemon but no route to Docker
# Hub or gcr.io (an air-gapped build host, or the sandbox this project is
# developed in), build local stand-ins for deploy/Dockerfile's two base images
# under their public names, so that `make image` and `make image-check` run:
#
#   golang:<go.mod's go>-bookworm       a debootstrap'd Debian bookworm (minbase,
#                                       make, git, ca-certificates) with this
#                                       machine's Go toolchain in /usr/local/go
#   gcr.io/distroless/static-debian12:nonroot
#                                       an empty root with distroless's users
#                                       (root, nobody, nonroot = 65532), /tmp,
#                                       /home/nonroot and a CA bundle
#
# The stand-ins carry this machine's CA bundle, so a TLS-intercepting proxy
# it trusts is trusted inside the build too. Where the registries are
# reachable, do not use this: pull the real images. Needs root (debootstrap),
# debootstrap, a Debian mirror (MIRROR), Go at $(go env GOROOT).
set -euo pipefail

cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
gover=$(sed -n 's/^go \([0-9.]*\)$/\1/p' go.mod)
goroot=$(go env GOROOT)
[ "$(go env GOVERSION)" = "go$gover" ] || { echo "image-standins: Go here is $(go env GOVERSION), go.mod wants go$gover" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "image-standins: debootstrap bookworm (a few minutes)"
debootstrap --variant=minbase --include=make,git,ca-certificates bookworm "$work/build" "$MIRROR" >"$work/debootstrap.log" 2>&1 ||
	{ tail -20 "$work/debootstrap.log" >&2; exit 1; }
cp -a "$goroot" "$work/build/usr/local/go"
mkdir -p "$work/build/go"
cp /etc/ssl/certs/ca-certificates.crt "$work/build/etc/ssl/certs/ca-certificates.crt"
tar -C "$work/build" -c . | "$DOCKER" import \
	--change 'ENV PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	--change 'ENV GOPATH=/go' --change "ENV GOLANG_VERSION=$gover" --change 'WORKDIR /go' \
	- "golang:$gover-bookworm" >/dev/null
echo "image-standins: golang:$gover-bookworm"

rt="$work/runtime"
mkdir -p "$rt/etc/ssl/certs" "$rt/tmp" "$rt/home/nonroot"
chmod 1777 "$rt/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$rt/etc/passwd"
printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$rt/etc/group"
cp /etc/ssl/certs/ca-certificates.crt "$rt/etc/ssl/certs/"
chown 65532:65532 "$rt/home/nonroot"
tar -C "$rt" -c . | "$DOCKER" import --change 'USER 65532' --change 'WORKDIR /home/nonroot' \
	- gcr.io/distroless/static-debian12:nonroot >/dev/null
echo "image-standins: gcr.io/distroless/static-debian12:nonroot"
