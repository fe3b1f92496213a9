#!/usr/bin/env bash
# Builds the container images the tests use, from scratch, without any registry:
#   corral-test/base:bookworm    a debootstrap --variant=minbase root filesystem, `docker import`ed
#   corral-test/python:bookworm  base + python3, ipykernel, venv, procps, git (apt inside the build)
#   $CACHE_DIR/python-<suite>-<key>.sif  the same image as a SIF for Apptainer (when installed)
#   corral-test/python:bookworm in Podman's storage too (when podman is installed)
#   corral-test/swe-textkit:bookworm and its root filesystem (scripts/build_swe_test_image.sh)
# The root filesystem tarball is cached under $CACHE_DIR, keyed by this script's content, so a
# second run on the same machine takes seconds; a fresh machine needs about two minutes.
# Needs root, debootstrap and a running Docker engine.
set -euo pipefail

SUITE=${SUITE:-bookworm}
CACHE_DIR=${CACHE_DIR:-/var/cache/corral-test-images}
here=$(cd "$(dirname "$0")" && pwd)
key=$(sha256sum "$here/build_test_images.sh" | cut -c1-16)
rootfs_tar="$CACHE_DIR/$SUITE-minbase-$key.tar"

mirror() {
  # The machine's own Debian mirror (deb822 or one-line sources), else the default one.
  local uri
  uri=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
  [[ -n "$uri" ]] || uri=$(grep -hsE '^deb ' /etc/apt/sources.list | awk '{print $2}' | head -n1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

mkdir -p "$CACHE_DIR"
# Files cached under an older key are stale.
find "$CACHE_DIR" -maxdepth 1 -type f \( -name "*-minbase-*.tar" -o -name "python-*.sif" \) ! -name "*$key*" -delete
if [[ ! -s "$rootfs_tar" ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "debootstrap $SUITE from $(mirror)"
  debootstrap --variant=minbase "$SUITE" "$work/rootfs" "$(mirror)" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log"; exit 1; }
  tar -C "$work/rootfs" -cf "$rootfs_tar.tmp" .
  mv "$rootfs_tar.tmp" "$rootfs_tar"
fi

image_id() { docker image inspect -f '{{index .Config.Labels "io.corral.test-key"}}' "$1" 2>/dev/null || true; }

if [[ "$(image_id corral-test/base:$SUITE)" != "$key" ]]; then
  docker import --change "LABEL io.corral.test-key=$key" "$rootfs_tar" "corral-test/base:$SUITE" >/dev/null
fi
if [[ "$(image_id corral-test/python:$SUITE)" != "$key" ]]; then
  docker build -q -t "corral-test/python:$SUITE" --label "io.corral.test-key=$key" - >/dev/null <<DOCKERFILE
FROM corral-test/base:$SUITE
RUN apt-get update -q && apt-get install -y -q --no-install-recommends \
      python3 python3-ipykernel python3-venv procps git iproute2 \
    && rm -rf /var/lib/apt/lists/*
DOCKERFILE
fi
# Podman keeps its own image store: the same image, copied over from Docker's.
if command -v podman >/dev/null 2>&1 \
    && [[ "$(podman image inspect -f '{{index .Config.Labels "io.corral.test-key"}}' "corral-test/python:$SUITE" 2>/dev/null || true)" != "$key" ]]; then
  docker save "corral-test/python:$SUITE" | podman load -q >/dev/null
fi
sif="$CACHE_DIR/python-$SUITE-$key.sif"
apptainer=$(command -v apptainer || command -v singularity || true)
if [[ -n "$apptainer" && ! -s "$sif" ]]; then
  "$apptainer" build -F "$sif.tmp" "docker-daemon://corral-test/python:$SUITE" >/dev/null
  mv "$sif.tmp" "$sif"
fi
[[ -s "$sif" ]] && ln -sf "$sif" "$CACHE_DIR/python-$SUITE.sif"
echo "images: corral-test/base:$SUITE corral-test/python:$SUITE${apptainer:+ $CACHE_DIR/python-$SUITE.sif}$(command -v podman >/dev/null 2>&1 && echo ' (also in podman)') (key $key)"
"$here/build_swe_test_image.sh"
