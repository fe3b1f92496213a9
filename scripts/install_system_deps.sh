#!/usr/bin/env bash
# Installs the Debian packages that `make demo` and `make test` need and that are missing (the
# Makefile runs this first). Every requirement is probed; when all are there it says so and touches
# nothing (no apt-get update). As root with apt-get it installs what is missing; otherwise it prints
# what is missing and the command that installs it, and exits 0: the tests that need a missing part
# skip and say why. CORRAL_SKIP_SYSTEM_DEPS=1 skips all of this.
#
# Not installed here: docker, podman, apptainer (their backends' tests skip without them; CI
# installs them, see .ci/run).
set -euo pipefail

if [[ "${CORRAL_SKIP_SYSTEM_DEPS:-}" == 1 ]]; then
  exit 0
fi

# Probe with the sbin directories too (chroot lives in /usr/sbin): a PATH without them is not
# something a package fixes.
PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
PYTHON="${PYTHON:-python3}"

packages=()  # Debian packages to install, each once
reasons=()   # what is missing, for the message

need() {  # need PACKAGE WHAT-IS-MISSING
  local p
  reasons+=("$2")
  for p in ${packages[@]+"${packages[@]}"}; do [[ "$p" == "$1" ]] && return 0; done
  packages+=("$1")
}
have() { command -v "$1" >/dev/null 2>&1; }
# Exit 0 when every module named can be found by python $1 (find_spec: no import cost).
has_modules() {
  local py=$1; shift
  "$py" -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' \
    "$@" >/dev/null 2>&1
}

# The local backend: bubblewrap makes the sandboxes (util-linux unshare + chroot is the fallback);
# commands enter them with nsenter, drop to the sandbox's uid with setpriv, terminals use setsid.
have bwrap || need bubblewrap "bwrap"
for tool in nsenter unshare setpriv setsid; do
  have "$tool" || need util-linux "$tool"
done
have chroot || need coreutils "chroot"
# Container images (docker-archive:, oci:, docker: ...) are exported by skopeo and unpacked by umoci.
have skopeo || need skopeo "skopeo"
have umoci || need umoci "umoci"
# Copy-on-write sandbox storage (local.storage = "btrfs", docker.storage = "auto"/"btrfs": forks, snapshots and the
# engines' disk caps) formats and manages its pool with btrfs-progs.
have mkfs.btrfs || need btrfs-progs "mkfs.btrfs"
have btrfs || need btrfs-progs "btrfs"
# Files go in and out of sandboxes as tar streams; the tests run ps and git inside "host" sandboxes.
have tar || need tar "tar"
have ps || need procps "ps"
have git || need git "git"
# The reward-hack red team builds the library its /etc/ld.so.preload hack plants.
have cc || need gcc "cc"
# The coding CLIs (Qwen Code, Pi, ...) are npm packages run by Node.js, on the host and in "host"
# sandboxes (make coding-clis installs them).
have node || need nodejs "node"
have npm || need npm "npm"
# Kernels in "host" sandboxes run the host's python3 as a sandbox finds it: the first on the PATH
# the daemon gives commands (daemon/commands.py DEFAULT_PATH), normally Debian's /usr/bin/python3.
sandbox_python=$(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin command -v python3 || true)
if [[ -z "$sandbox_python" ]]; then
  need python3-ipykernel "python3 for sandboxes"
elif ! has_modules "$sandbox_python" ipykernel; then
  if [[ "$sandbox_python" == /usr/bin/python3 ]]; then
    need python3-ipykernel "ipykernel for /usr/bin/python3"
  else
    echo "warning: sandboxes on the local backend run $sandbox_python, which has no ipykernel: install it there ($sandbox_python -m pip install ipykernel), or kernel tests skip" >&2
  fi
fi
# `$PYTHON -m venv .venv` (the Makefile) needs venv and ensurepip, which Debian packages apart.
if ! have "$PYTHON"; then
  need python3-venv "$PYTHON"
elif ! has_modules "$PYTHON" venv ensurepip; then
  if [[ "$("$PYTHON" -c 'import sys; print(sys.base_prefix)' 2>/dev/null)" == /usr ]]; then
    need python3-venv "the venv module of $PYTHON"
  else
    echo "warning: $PYTHON ($(command -v "$PYTHON")) has no venv/ensurepip module; 'make venv' needs a Python that has (e.g. make PYTHON=/usr/bin/python3 with python3-venv installed)" >&2
  fi
fi

if ((${#packages[@]} == 0)); then
  echo "system packages: all present (bubblewrap, util-linux, procps, git, gcc, python3-venv, python3-ipykernel, skopeo, umoci, btrfs-progs, nodejs, npm)"
  exit 0
fi

missing=$(printf '%s, ' "${reasons[@]}"); missing=${missing%, }
if [[ "$(id -u)" == 0 ]] && have apt-get; then
  echo "system packages: installing ${packages[*]} (missing: $missing)"
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine may be running unattended-upgrades: wait for the dpkg lock instead of failing.
  apt-get -o DPkg::Lock::Timeout=600 update -q
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${packages[@]}"
  exit 0
fi

if [[ "$(id -u)" == 0 ]]; then
  fix="apt-get install --no-install-recommends ${packages[*]}"
  hint=" (Debian/Ubuntu package names; this machine has no apt-get)"
else
  fix="sudo apt-get install --no-install-recommends ${packages[*]}"
  hint=" (not root: not installed here)"
fi
echo "missing: $missing ; install with: $fix$hint" >&2
exit 0
