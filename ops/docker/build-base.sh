#!/usr/bin/env bash
# A Debian bookworm base image made locally, for machines that cannot pull from an image
# registry: debootstrap (minbase) into a temporary directory, then `docker import`.
# Both Dockerfiles take `ARG BASE`; with a registry, use debian:bookworm-slim instead.
#
#   ops/docker/build-base.sh [IMAGE]      # default genpipe/debian:bookworm; no-op if present
#
# An IMAGE outside genpipe/ (GENPIPE_BASE_IMAGE=debian:bookworm-slim, a registry's) is
# pulled instead: made here under that name, it would pass for the registry's own.
#
# Env: GENPIPE_DEBIAN_MIRROR (default: the mirror apt already uses for bookworm, else
# http://deb.debian.org/debian). Needs debootstrap, root (or sudo without a password)
# and a Docker engine.
set -euo pipefail

IMAGE="${1:-${GENPIPE_BASE_IMAGE:-genpipe/debian:bookworm}}"
PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"  # (debootstrap is in /usr/sbin: not on a user's PATH on Debian)

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE: present"
  exit 0
fi
if [[ "$IMAGE" != genpipe/* ]]; then
  echo "base image $IMAGE: pulling (not one of genpipe's: built here only as genpipe/...)"
  docker pull -q "$IMAGE" >/dev/null || {
    echo "error: could not pull $IMAGE; where no registry answers, unset GENPIPE_BASE_IMAGE to build" \
         "genpipe/debian:bookworm here with debootstrap" >&2; exit 1; }
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "error: debootstrap not found (apt-get install -y debootstrap)" >&2; exit 1; }
SUDO=""  # debootstrap makes device nodes and chroots: root's
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null && sudo -n true 2>/dev/null || {
    echo "error: debootstrap needs root: run this as root (or with sudo) once to build $IMAGE," \
         "or set GENPIPE_BASE_IMAGE=debian:bookworm-slim where a registry answers" >&2; exit 1; }
  SUDO="sudo -n"
fi

apt_mirror() {  # the first http(s) Debian mirror apt is configured with, if any
  grep -hsE '^(deb |URIs:)' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
      /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | grep -oE 'https?://[^ ]+/debian/?' | grep -v security | head -n1
}
MIRROR="${GENPIPE_DEBIAN_MIRROR:-$(apt_mirror || true)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

ROOTFS="$(mktemp -d /tmp/genpipe-rootfs.XXXXXX)"
trap '$SUDO rm -rf "$ROOTFS"' EXIT
echo "base image $IMAGE: debootstrap --variant=minbase bookworm from $MIRROR"
# (sudo resets the environment: a proxy the mirror needs is handed on)
$SUDO env "http_proxy=${http_proxy:-}" "https_proxy=${https_proxy:-}" "no_proxy=${no_proxy:-}" \
  debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
  tail -n 20 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"
  echo "error: debootstrap failed" >&2; exit 1; }
rm -f "$ROOTFS.log"
# Like the registry image: no apt lists or caches in the layer.
$SUDO sh -c 'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb' \
  sh "$ROOTFS"
$SUDO tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' \
  --message "debootstrap --variant=minbase bookworm $MIRROR" - "$IMAGE" >/dev/null
echo "base image $IMAGE: built ($(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec))"
