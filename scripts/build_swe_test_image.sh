#!/usr/bin/env bash
# Builds the SWE-bench-style test image from corral-test/python (scripts/build_test_images.sh makes
# it first), without any registry:
#   corral-test/swe-textkit:bookworm  the repository examples/swe/testbed committed at /testbed
#       (owned by root, the commit examples/swe/instances.jsonl names as base_commit), pytest,
#       and a virtual environment at /opt/venv activated from /root/.bashrc
#   the same image in Podman's storage (when podman is installed)
#   $CACHE_DIR/swe-textkit-<suite>-rootfs  its root filesystem, exported, for the local backend
#   $CACHE_DIR/swe-textkit-<suite>-apptainer  the same as an Apptainer sandbox directory (when
#       Apptainer is installed)
# Cached by a key over this script, the repository's files and the python image's own key, so a
# second run takes a second.
set -euo pipefail

SUITE=${SUITE:-bookworm}
CACHE_DIR=${CACHE_DIR:-/var/cache/corral-test-images}
here=$(cd "$(dirname "$0")" && pwd)
data="$here/../examples/swe"
image="corral-test/swe-textkit:$SUITE"
prefix="$CACHE_DIR/swe-textkit-$SUITE"

label() { "$@" -f '{{index .Config.Labels "io.corral.test-key"}}' 2>/dev/null || true; }
base_key=$(label docker image inspect "corral-test/python:$SUITE")
[[ -n "$base_key" ]] || { echo "corral-test/python:$SUITE is missing: run scripts/build_test_images.sh" >&2; exit 1; }
key=$( (echo "$base_key"; cat "$here/build_swe_test_image.sh"; cd "$data/testbed" && find . -type f ! -path "*/__pycache__/*" | LC_ALL=C sort | xargs sha256sum) \
  | sha256sum | cut -c1-16)

if [[ "$(label docker image inspect "$image")" != "$key" ]]; then
  # The commit's identity and dates are fixed, so base_commit is the same on every machine.
  docker build -q -t "$image" --label "io.corral.test-key=$key" -f - "$data" >/dev/null <<DOCKERFILE
FROM corral-test/python:$SUITE
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3-pytest \\
    && rm -rf /var/lib/apt/lists/* \\
    && python3 -m venv --system-site-packages /opt/venv \\
    && echo '. /opt/venv/bin/activate' >>/root/.bashrc
COPY testbed /testbed
RUN cd /testbed && git init -q && git add -A \\
    && GIT_AUTHOR_DATE=2024-01-01T00:00:00Z GIT_COMMITTER_DATE=2024-01-01T00:00:00Z \\
       git -c user.name=corral -c user.email=corral@example.invalid commit -q -m "textkit 0.1"
WORKDIR /testbed
DOCKERFILE
fi
if command -v podman >/dev/null 2>&1 && [[ "$(label podman image inspect "$image")" != "$key" ]]; then
  docker save "$image" | podman load -q >/dev/null
fi
rootfs="$prefix-rootfs-$key"
if [[ ! -d "$rootfs" ]]; then
  container=$(docker create "$image" /bin/true)
  rm -rf "$rootfs.tmp" && mkdir -p "$rootfs.tmp"
  docker export "$container" | tar -C "$rootfs.tmp" --numeric-owner -xpf -
  docker rm -f "$container" >/dev/null
  # Every user reaches the image (the local backend binds it for an unprivileged sandbox uid).
  chmod 755 "$rootfs.tmp"
  mv "$rootfs.tmp" "$rootfs"
fi
ln -sfn "$rootfs" "$prefix-rootfs"
apptainer=$(command -v apptainer || command -v singularity || true)
if [[ -n "$apptainer" && ! -d "$prefix-apptainer-$key" ]]; then
  # From the exported directory (a local copy; a SIF would add a squashfs pass): Apptainer adds
  # the metadata (/.singularity.d) its instances start from.
  "$apptainer" build -F --sandbox "$prefix-apptainer-$key.tmp" "$rootfs" >/dev/null
  mv "$prefix-apptainer-$key.tmp" "$prefix-apptainer-$key"
fi
[[ -d "$prefix-apptainer-$key" ]] && ln -sfn "$prefix-apptainer-$key" "$prefix-apptainer"
# Directories made under an older key are stale.
find "$CACHE_DIR" -maxdepth 1 -type d -name "swe-textkit-$SUITE-*-*" ! -name "*-$key" -exec rm -rf {} +
echo "swe image: $image$(command -v podman >/dev/null 2>&1 && echo ' (also in podman)'), $prefix-rootfs${apptainer:+, $prefix-apptainer} (key $key)"
