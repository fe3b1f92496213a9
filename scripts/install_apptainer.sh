#!/usr/bin/env bash
# install_apptainer.sh -- installs Apptainer (the singularity backend's engine) on Debian 12
# (bookworm) or Debian 13 (trixie), amd64, as root. Idempotent: re-running is a no-op once
# installed (about 15 s the first time). `corral doctor` names it where Apptainer is missing.
#
# Neither bookworm nor trixie ships apptainer; Debian sid does (apptainer 1.4.x, needs
# glibc >= 2.38). This script:
#   * reads sid (+ trixie) package lists into a PRIVATE apt state dir (host apt config is
#     not modified; signatures are checked with the host's debian-archive-keyring),
#   * `apt-get download`s apptainer (and, on glibc < 2.38 hosts, libc6) from sid,
#   * host glibc >= 2.38 (Debian 13+): installs the sid .deb unchanged with apt-get
#     (its dependencies come from the host's own suite);
#   * host glibc < 2.38 (Debian 12): repacks the .deb as <version>+privglibc1:
#       - sid's glibc goes to /usr/lib/x86_64-linux-gnu/apptainer/glibc/
#       - patchelf sets PT_INTERP + DT_RPATH of /usr/bin/apptainer and
#         /usr/lib/x86_64-linux-gnu/apptainer/bin/starter to that private glibc
#         (no LD_LIBRARY_PATH, nothing leaks into containers or helper processes),
#       - offsetpreload.so (LD_PRELOADed into the host's fuse2fs) is rebuilt from the
#         Debian source package against the host glibc if a C compiler is present,
#       - the "libc6 (>= 2.38)" dependency is relaxed, then it is installed with apt-get,
#         so dpkg owns every file (`dpkg -L apptainer`; remove with `apt-get purge apptainer`).
#   * If root lacks capabilities in its bounding set (some VMs/containers drop e.g.
#     CAP_SYS_RESOURCE), `root default capabilities = full` makes every run fail with
#     "Requesting capability set ... while permitted capability set is ...". Then the
#     script switches apptainer.conf to `root default capabilities = file` and grants
#     root exactly the capabilities of the bounding set (APPTAINER_FIX_CAPS=0 disables).
#   * If systemd is not PID 1 (containers, minimal VMs), sets `systemd cgroups = no` so that
#     --memory/--cpus and `instance stats` use the cgroupfs manager.
#   * finishes with a smoke test (`apptainer version`, `apptainer buildcfg`).
#
# Environment knobs:
#   APPTAINER_SUITE   suite to take apptainer from      (default: sid)
#   GLIBC_SUITE       suite to take the private glibc from (default: same as APPTAINER_SUITE)
#   MIRROR            Debian mirror                      (default: the one in this machine's apt sources)
#   WORKDIR           download/repack dir                (default: /var/cache/apptainer-install)
#   FORCE=1           reinstall even if already installed
#   PRIVATE_GLIBC=1   force the private-glibc repack even on a glibc >= 2.38 host
#   APPTAINER_FIX_CAPS=0  never touch 'root default capabilities'
#   APPTAINER_FIX_CGROUPS=0  never touch 'systemd cgroups' (set to "no" when systemd is not init)
#   SKIP_APT_UPDATE=1 do not run the host 'apt-get update'
#   BUILD_OFFSETPRELOAD=auto|1|0  rebuild offsetpreload.so against the host glibc:
#                     auto = if a C compiler exists, 1 = install gcc+libc6-dev if needed, 0 = never
#   APT_CHECK_VALID_UNTIL=true  enforce Valid-Until of the sid InRelease (off by default,
#                     so that snapshot/frozen mirrors work; signatures are always checked)
set -euo pipefail

APPTAINER_SUITE=${APPTAINER_SUITE:-sid}
GLIBC_SUITE=${GLIBC_SUITE:-$APPTAINER_SUITE}
# the Debian mirror this machine's apt already uses (deb822 sources first, then sources.list)
MIRROR=${MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null)}
MIRROR=${MIRROR:-$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
WORKDIR=${WORKDIR:-/var/cache/apptainer-install}
FORCE=${FORCE:-0}
PRIVATE_GLIBC=${PRIVATE_GLIBC:-auto}
APPTAINER_FIX_CAPS=${APPTAINER_FIX_CAPS:-1}
APPTAINER_FIX_CGROUPS=${APPTAINER_FIX_CGROUPS:-1}
SKIP_APT_UPDATE=${SKIP_APT_UPDATE:-0}
BUILD_OFFSETPRELOAD=${BUILD_OFFSETPRELOAD:-auto}
# Signatures are always verified; Valid-Until is not checked by default for the private sid
# lists because frozen/snapshot mirrors serve an "expired" sid InRelease.
APT_CHECK_VALID_UNTIL=${APT_CHECK_VALID_UNTIL:-false}
SUFFIX=+privglibc1
LIBDIR=/usr/lib/x86_64-linux-gnu/apptainer
PGLIBC=$LIBDIR/glibc
export DEBIAN_FRONTEND=noninteractive

log() { printf '[install_apptainer] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root"
[ "$(dpkg --print-architecture)" = amd64 ] || die "only amd64 is supported"
# shellcheck source=/dev/null
[ -r /etc/os-release ] && . /etc/os-release
[ "${ID:-}" = debian ] || log "warning: not Debian (ID=${ID:-?}); continuing anyway"
DEB_MAJOR=$(cut -d. -f1 /etc/debian_version 2>/dev/null || echo '?')
HOST_GLIBC=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
ver_ge() { dpkg --compare-versions "$1" ge "$2"; }
if [ "$PRIVATE_GLIBC" = auto ]; then
  if ver_ge "$HOST_GLIBC" 2.38; then PRIVATE_GLIBC=0; else PRIVATE_GLIBC=1; fi
fi
log "Debian ${DEB_MAJOR} (${VERSION_CODENAME:-?}), host glibc ${HOST_GLIBC}, private glibc: ${PRIVATE_GLIBC}"

# ---------------------------------------------------------------- fix capabilities
fix_caps() {
  [ "$APPTAINER_FIX_CAPS" = 1 ] || return 0
  local conf=/etc/apptainer/apptainer.conf last bnd full missing caps i name
  [ -f "$conf" ] || return 0
  last=$(cat /proc/sys/kernel/cap_last_cap)
  bnd=$((16#$(awk '/^CapBnd:/{print $2}' /proc/self/status)))
  full=$(( (1 << (last + 1)) - 1 ))
  missing=$(( full & ~bnd ))
  if [ "$missing" = 0 ]; then
    log "root has the full capability bounding set; leaving 'root default capabilities' as is"
    return 0
  fi
  log "bounding set lacks capabilities (mask 0x$(printf %x $missing)); using 'root default capabilities = file'"
  caps=""
  for i in $(seq 0 "$last"); do
    if (( bnd & (1 << i) )); then
      name=$(capsh --decode="$(printf %x $((1 << i)))" 2>/dev/null | sed 's/.*=//') || true
      [[ "$name" == cap_* ]] && caps="$caps${caps:+,}${name^^}"
    fi
  done
  sed -i 's/^root default capabilities = .*/root default capabilities = file/' "$conf"
  apptainer capability add --user root "$caps" >/dev/null 2>&1 || die "apptainer capability add failed"
}

fix_cgroups() {
  [ "$APPTAINER_FIX_CGROUPS" = 1 ] || return 0
  local conf=/etc/apptainer/apptainer.conf
  [ -f "$conf" ] || return 0
  if [ ! -d /run/systemd/system ]; then
    # without systemd as init, 'systemd cgroups = yes' makes --memory/--cpus/... fail with
    # "cannot use systemd cgroups manager, systemd not running as init on this host"
    log "systemd is not init; setting 'systemd cgroups = no' (cgroupfs manager)"
    sed -i 's/^systemd cgroups = .*/systemd cgroups = no/' "$conf"
  fi
}

cleanup_workdir() {   # keep only the repacked .deb (if any); apt state + downloads are ~180 MB
  cd /
  rm -rf "$WORKDIR/apt" "$WORKDIR/debs" "$WORKDIR/repack" "$WORKDIR/libc6" "$WORKDIR/src"
}

smoke() {
  apptainer version >/dev/null 2>&1 || return 1
  apptainer buildcfg >/dev/null 2>&1 || return 1
}

# ---------------------------------------------------------------- idempotency check
inst_ver=$(dpkg-query -W -f='${Status} ${Version}' apptainer 2>/dev/null | awk '$3=="installed"{print $4}') || true
if [ "$FORCE" != 1 ] && [ -n "$inst_ver" ] && smoke; then
  if [ "$PRIVATE_GLIBC" = 0 ] || [[ "$inst_ver" == *"$SUFFIX" ]]; then
    log "apptainer $inst_ver already installed and working; nothing to do (FORCE=1 to reinstall)"
    fix_caps
    fix_cgroups
    exit 0
  fi
fi

# ---------------------------------------------------------------- host dependencies
if [ "$SKIP_APT_UPDATE" != 1 ]; then apt-get update -qq; fi
HOST_PKGS="ca-certificates squashfs-tools uidmap containernetworking-plugins libseccomp2
  libsqlite3-0 e2fsprogs fuse2fs squashfuse fuse-overlayfs libcap2-bin xz-utils"
[ "$PRIVATE_GLIBC" = 1 ] && HOST_PKGS="$HOST_PKGS patchelf"
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $HOST_PKGS >/dev/null

# ---------------------------------------------------------------- private apt state for sid
A=$WORKDIR/apt
mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/etc/sources.list.d" "$A/etc/preferences.d" "$WORKDIR/debs"
KR=/usr/share/keyrings/debian-archive-keyring.gpg
{
  for s in $(printf '%s\n' "$APPTAINER_SUITE" "$GLIBC_SUITE" | sort -u); do
    echo "deb [signed-by=$KR] $MIRROR $s main"
  done
} > "$A/etc/sources.list"
APTO=(-o "Dir::Etc::SourceList=$A/etc/sources.list" -o "Dir::Etc::SourceParts=$A/etc/sources.list.d"
      -o "Dir::Etc::Preferences=$A/etc/preferences" -o "Dir::Etc::PreferencesParts=$A/etc/preferences.d"
      -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache" -o "APT::Sandbox::User=root"
      -o "Acquire::Languages=none" -o "Acquire::Check-Valid-Until=$APT_CHECK_VALID_UNTIL")
log "fetching package lists for: $(awk '{print $4}' "$A/etc/sources.list" | xargs)"
apt-get "${APTO[@]}" update -qq

cd "$WORKDIR/debs"
rm -f ./*.deb
apt-get "${APTO[@]}" download -qq "apptainer/$APPTAINER_SUITE" >/dev/null
APPDEB=$(ls apptainer_*_amd64.deb)
APPVER=$(dpkg-deb -f "$APPDEB" Version)
log "downloaded $APPDEB"

if [ "$PRIVATE_GLIBC" = 0 ]; then
  # Debian 13+: the sid binary runs on the host glibc; apt resolves the deps from the host suite.
  apt-get install -y -qq --reinstall -o Dpkg::Options::=--force-confnew "./$APPDEB" >/dev/null
  fix_caps
  fix_cgroups
  smoke || die "apptainer installed but does not run"
  cleanup_workdir
  log "installed apptainer $APPVER (unmodified $APPTAINER_SUITE package)"
  exit 0
fi

# ---------------------------------------------------------------- Debian 12: repack with a private glibc
apt-get "${APTO[@]}" download -qq "libc6/$GLIBC_SUITE" >/dev/null
LIBCDEB=$(ls libc6_*_amd64.deb)
LIBCVER=$(dpkg-deb -f "$LIBCDEB" Version)
log "downloaded $LIBCDEB"

R=$WORKDIR/repack
rm -rf "$R" "$WORKDIR/libc6"
dpkg-deb -R "$APPDEB" "$R"
dpkg-deb -x "$LIBCDEB" "$WORKDIR/libc6"
mkdir -p "$R$PGLIBC"
# the loader and libraries only (no gconv / locale / docs); ~5 MB
for d in "$WORKDIR/libc6/lib/x86_64-linux-gnu" "$WORKDIR/libc6/usr/lib/x86_64-linux-gnu"; do
  if [ -d "$d" ]; then find "$d" -maxdepth 1 \( -type f -o -type l \) -name '*.so*' -exec cp -a {} "$R$PGLIBC/" \; ; fi
done
cp -a "$WORKDIR/libc6/usr/share/doc/libc6/copyright" "$R$PGLIBC/COPYRIGHT.glibc" 2>/dev/null || true
echo "glibc $LIBCVER from Debian $GLIBC_SUITE (libc6_${LIBCVER}_amd64.deb), private to apptainer" > "$R$PGLIBC/README"
[ -x "$R$PGLIBC/ld-linux-x86-64.so.2" ] || die "no ld-linux-x86-64.so.2 in $LIBCDEB"

for b in "$R/usr/bin/apptainer" "$R$LIBDIR/bin/starter" "$R$LIBDIR/bin/starter-suid"; do
  [ -f "$b" ] || continue
  patchelf --set-interpreter "$PGLIBC/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$PGLIBC" "$b"
  log "patched $(basename "$b"): interp=$(patchelf --print-interpreter "$b") rpath=$(patchelf --print-rpath "$b")"
done

# offsetpreload.so is LD_PRELOADed into the *host* fuse2fs (glibc 2.36) and references
# __isoc23_strtol@GLIBC_2.38; rebuild it against the host glibc when a compiler exists.
OPL="$R$LIBDIR/lib/offsetpreload.so"
if [ -f "$OPL" ] && grep -q '__isoc23_' "$OPL"; then
  if [ "$BUILD_OFFSETPRELOAD" = 1 ] && ! command -v cc >/dev/null 2>&1; then
    apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
  fi
  if [ "$BUILD_OFFSETPRELOAD" != 0 ] && command -v cc >/dev/null 2>&1; then
    SRCV=${APPVER%-*}; SRCV=${SRCV#*:}
    rm -rf "$WORKDIR/src" && mkdir -p "$WORKDIR/src"
    got=""
    for z in xz gz bz2; do   # apt's own downloader: no curl/wget needed
      if /usr/lib/apt/apt-helper download-file "$MIRROR/pool/main/a/apptainer/apptainer_${SRCV}.orig.tar.$z" \
           "$WORKDIR/src/orig.tar.$z" >/dev/null 2>&1; then got="$WORKDIR/src/orig.tar.$z"; break; fi
    done
    if [ -n "$got" ] && tar -xf "$got" -C "$WORKDIR/src" --wildcards '*/tools/offsetpreload.c'; then
      log "rebuilding offsetpreload.so against host glibc from $(basename "$got")"
      cc -O2 -shared -fPIC -o "$OPL" "$WORKDIR"/src/*/tools/offsetpreload.c -ldl
      strip "$OPL" 2>/dev/null || true
    else
      log "warning: could not fetch apptainer_${SRCV}.orig.tar.*; offsetpreload.so left as is"
    fi
    rm -rf "$WORKDIR/src"
  else
    log "warning: no C compiler (BUILD_OFFSETPRELOAD=1 installs gcc); offsetpreload.so left as is (only LD_PRELOADed into fuse2fs for"
    log "         ext3 overlay partitions inside SIF files in unprivileged/userns mode)"
  fi
fi

C=$R/DEBIAN/control
sed -i -e "s/^Version: .*/Version: ${APPVER}${SUFFIX}/" \
       -e '/^Depends:/s/libc6 (>= [^)]*)/libc6 (>= 2.34)/' "$C"
sed -i '/^Built-Using:/d;/^Static-Built-Using:/d' "$C"
sed -i "s|^Description: .*|&\\
 [local repack: private glibc $LIBCVER in $PGLIBC for Debian 12]|" "$C"
(cd "$R" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum > DEBIAN/md5sums)
OUT="$WORKDIR/apptainer_${APPVER}${SUFFIX}_amd64.deb"
dpkg-deb --root-owner-group -Zgzip -z1 -b "$R" "$OUT" >/dev/null   # fast; xz takes ~16 s
log "built $OUT"
apt-get install -y -qq --reinstall --allow-downgrades -o Dpkg::Options::=--force-confnew "$OUT" >/dev/null
rm -rf "$R" "$WORKDIR/libc6"
fix_caps
fix_cgroups
smoke || die "apptainer installed but does not run"
cleanup_workdir
log "installed apptainer ${APPVER}${SUFFIX}: $(apptainer version)"
