#!/usr/bin/env bash
# Prints the path of a protoc for the build, for PROTOC: the build scripts of our protos
# (proto/build.rs) and of etcd-client run it.
#
# The machine's own (`protoc` on PATH) when it has one. Otherwise Google's release build of
# protoc 31.1 (linux x86-64, statically linked) as the crate protoc-bin-vendored-linux-x86_64
# 3.2.0 carries it, downloaded from crates.io (a registry every build uses already), checked
# against the sha256 crates.io publishes for it (the one Cargo itself checks), and cached under
# ${TANDEM_CACHE:-~/.cache/tandem}. So a machine with Rust and no protoc builds with
#
#   export PROTOC="$(bash scripts/get-protoc.sh)"
#   PROTOC_FROM_CRATES=1 bash scripts/get-protoc.sh   # skip the machine's protoc (CI does)
set -euo pipefail

if [ -z "${PROTOC_FROM_CRATES:-}" ] && command -v protoc >/dev/null 2>&1; then
  command -v protoc
  exit 0
fi

CRATE=protoc-bin-vendored-linux-x86_64
VERSION=3.2.0
SHA256=b38b07546580df720fa464ce124c4b03630a6fb83e05c336fea2a241df7e5d78
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *) echo "no pinned protoc for $(uname -s) $(uname -m): install protoc (3.15 or later)" >&2; exit 1 ;;
esac
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}"
DEST="$CACHE/$CRATE-$VERSION"

if [ -x "$DEST/bin/protoc" ]; then echo "$DEST/bin/protoc"; exit 0; fi
mkdir -p "$CACHE"
tmp="$(mktemp -d "$CACHE/protoc.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
curl -sSfL --retry 3 -o "$tmp/crate.tar.gz" \
  "https://static.crates.io/crates/$CRATE/$CRATE-$VERSION.crate"
got="$(sha256sum "$tmp/crate.tar.gz" | cut -d' ' -f1)"
if [ "$got" != "$SHA256" ]; then
  echo "$CRATE $VERSION: sha256 $got, expected $SHA256" >&2
  exit 1
fi
tar -xzf "$tmp/crate.tar.gz" -C "$tmp"
chmod 755 "$tmp/$CRATE-$VERSION/bin/protoc"
# A rename, so that a concurrent run sees a whole folder or none.
mv -T "$tmp/$CRATE-$VERSION" "$DEST" 2>/dev/null || [ -x "$DEST/bin/protoc" ]
echo "$DEST/bin/protoc"
