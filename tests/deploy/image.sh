#!/usr/bin/env bash
# shellcheck disable=SC2015  # ok() and bad() never fail
# Builds the Tandem image from deploy/Containerfile with podman and starts the cluster from it:
# tests/deploy/entrypoints.sh with RUNNER=podman runs router, prefill and decode as containers
# of the image, with the manifests' commands, args and environment.
#
#   bash tests/deploy/image.sh
#
# What differs from a build with registry access, and why: no container registry is reachable
# from the project's machines (only Debian's, PyPI's, npm's and crates.io), so neither
# rust:bookworm nor debian:bookworm-slim can be pulled. The base image is made here instead:
# `debootstrap --variant=minbase bookworm` from Debian's mirror, imported as
# localhost/debian:bookworm-slim (once; kept in podman's store). And the image is built at the
# Containerfile's `prebuilt` target, which puts the binaries already built in
# ${BIN_DIR:-target/release} (debug info stripped, as the builder stage does) on the same
# `base` stage that the default `runtime` target uses; the `builder` stage (a second release
# build inside the container) is the part not exercised here.
#
# Needs (Debian): podman, runc, debootstrap; uses tests/deploy/containers.conf (runc and lower
# ulimits, which this sandbox needs). Ends with entrypoints.sh's `<n> passed, <m> failed`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/tests/deploy/containers.conf}"
BIN_DIR="$(cd "${BIN_DIR:-target/release}" && pwd)"
IMAGE="${IMAGE:-localhost/tandem:test}"
BASE="${RUNTIME_IMAGE:-localhost/debian:bookworm-slim}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || {
    echo "no $tool: apt-get install podman runc debootstrap" >&2; exit 1; }
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

t0=$SECONDS
if ! podman image exists "$BASE"; then
  echo "== base image $BASE: debootstrap bookworm (minbase) from $MIRROR"
  debootstrap --variant=minbase bookworm "$tmp/rootfs" "$MIRROR" >"$tmp/debootstrap.log" 2>&1 \
    || { tail -n 20 "$tmp/debootstrap.log"; exit 1; }
  rm -rf "$tmp/rootfs/var/cache/apt/archives/"*.deb "$tmp/rootfs/var/lib/apt/lists/"*
  tar -C "$tmp/rootfs" -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$tmp/rootfs"
  echo "   $((SECONDS - t0)) s"
fi

echo "== image $IMAGE (deploy/Containerfile, target prebuilt, binaries from $BIN_DIR)"
t1=$SECONDS
mkdir -p "$tmp/ctx/bin"
for b in tandem-router tandem-prefill tandem-decode tandem-fetch; do
  strip --strip-debug -o "$tmp/ctx/bin/$b" "$BIN_DIR/$b"
done
podman rmi -f "$IMAGE" >/dev/null 2>&1 || true
podman build --quiet -f deploy/Containerfile --target prebuilt \
  --build-arg RUNTIME_IMAGE="$BASE" -t "$IMAGE" "$tmp/ctx" >/dev/null
echo "   $((SECONDS - t1)) s, $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"

passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $*"; }
bad() { failed=$((failed + 1)); echo "FAIL $*"; }
[ "$(podman image inspect --format '{{index .Labels "io.tandem.cpu-baseline"}}' "$IMAGE")" = x86-64-v3 ] \
  && ok "label io.tandem.cpu-baseline=x86-64-v3" || bad "no cpu-baseline label"
user="$(podman run --rm "$IMAGE" id -u 2>&1)"
[ "$user" = 10001 ] && ok "runs as uid 10001" || bad "runs as $user"
for b in tandem-router tandem-prefill tandem-decode tandem-fetch; do
  podman run --rm "$IMAGE" "$b" --help >/dev/null 2>&1 && ok "$b --help in the image" \
    || bad "$b --help in the image"
done

# The cluster from the image; entrypoints.sh prints its own tally.
rc=0
RUNNER=podman IMAGE="$IMAGE" bash tests/deploy/entrypoints.sh | tee "$tmp/entrypoints.log" || rc=$?
e_passed="$(tail -n 1 "$tmp/entrypoints.log" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\1/p')"
e_failed="$(tail -n 1 "$tmp/entrypoints.log" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\2/p')"
passed=$((passed + ${e_passed:-0}))
failed=$((failed + ${e_failed:-1}))
[ "$rc" = 0 ] || [ "${e_failed:-1}" != 0 ] || failed=$((failed + 1))
echo "image test: $((SECONDS - t0)) s in all"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
