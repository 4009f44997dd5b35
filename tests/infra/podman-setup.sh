#!/usr/bin/env bash
# podman-setup.sh - make this machine able to build and run docker/Dockerfile without a Docker
# engine: podman (Debian package) as root, a private podman config, and a locally made stand-in
# for the CUDA base image (no container registry is reachable here).
#
# Idempotent and cached: packages are installed only when missing, the config is rewritten (cheap),
# the debootstrap rootfs and the imported base image are reused when they exist.
#
# Usage:  tests/infra/podman-setup.sh            then:  source "$PODMAN_STATE/env.sh"
# Env knobs (defaults in brackets):
#   PODMAN_STATE [/var/tmp/ddp-job-podman]  config, storage, rootfs cache, env.sh
#   BASE_TAG [localhost/ddp-job-base:bookworm]  tag of the stand-in base image
#   SUITE [bookworm]   Debian suite of the stand-in (Python 3.11; Ubuntu 24.04 has 3.12)
#   INCLUDE [python3,python3-venv,ca-certificates]  packages baked into the stand-in
#   SKIP_APT [0]       1 = never call apt-get (fail if podman is missing)
# Prints the env lines to export; writes them to $PODMAN_STATE/env.sh too.
set -euo pipefail

STATE=${PODMAN_STATE:-/var/tmp/ddp-job-podman}
BASE_TAG=${BASE_TAG:-localhost/ddp-job-base:bookworm}
SUITE=${SUITE:-bookworm}
INCLUDE=${INCLUDE:-python3,python3-venv,ca-certificates}
SKIP_APT=${SKIP_APT:-0}

log() { printf '== %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { echo "podman-setup.sh: must run as root (podman runs rootful here); run it with sudo" >&2; exit 2; }
mkdir -p "$STATE"/{etc,storage,run,tmp}

# ------------------------------------------------------------------ 1. packages
need=()
for b in podman debootstrap runc; do command -v "$b" >/dev/null || need+=("$b"); done
if [ ${#need[@]} -gt 0 ]; then
  [ "$SKIP_APT" = 1 ] && { echo "podman-setup.sh: missing ${need[*]} and SKIP_APT=1; install podman debootstrap runc" >&2; exit 2; }
  log "apt-get install podman debootstrap runc (missing: ${need[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq podman debootstrap >/dev/null
  # crun (podman's default runtime) rejects this machine's hybrid cgroup layout; runc copes.
  apt-get install -y -qq --no-install-recommends runc >/dev/null
fi

# ------------------------------------------------------------------ 2. private podman config
# Pointed at through CONTAINERS_CONF / CONTAINERS_STORAGE_CONF so /etc/containers is not edited
# and the storage (with the cached base image) lives in one directory CI can keep.
cat > "$STATE/etc/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$STATE/storage"
runroot = "$STATE/run"
CONF
cat > "$STATE/etc/containers.conf" <<CONF
[containers]
log_driver = "k8s-file"
# The machine lacks CAP_SYS_RESOURCE, so the runtime cannot raise rlimits above the host's hard
# limits; podman's defaults (nofile 1048576) fail with "error setting rlimit".
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
# No systemd here: cgroupfs, and events to a file instead of journald.
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$STATE/run/events.log"
tmp_dir = "$STATE/run/libpod-tmp"
# crun 1.8: "cgroups in hybrid mode not supported"; runc 1.1 handles the hybrid v1/v2 layout.
runtime = "runc"
CONF
cat > "$STATE/env.sh" <<CONF
export CONTAINERS_CONF="$STATE/etc/containers.conf"
export CONTAINERS_STORAGE_CONF="$STATE/etc/storage.conf"
export DDP_JOB_BASE_IMAGE="$BASE_TAG"
CONF
# shellcheck disable=SC1091
. "$STATE/env.sh"
export TMPDIR="$STATE/tmp"

# ------------------------------------------------------------------ 3. stand-in base image
if podman image exists "$BASE_TAG"; then
  log "base image $BASE_TAG exists (cached)"
else
  if [ ! -e "$STATE/rootfs/.complete" ]; then
    # The Debian (non-security) mirror apt is configured with: the only one reachable here.
    mirror=$(
      { grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null || true
        grep -h '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true
      } | awk '{print $2}' | grep -v -- '-security' | grep -i debian | head -1 || true)
    [ -n "$mirror" ] || { echo "podman-setup.sh: no Debian mirror in /etc/apt/sources.list*; add one" >&2; exit 2; }
    log "debootstrap --variant=minbase $SUITE (+ $INCLUDE) from $mirror"
    rm -rf "$STATE/rootfs"
    start=$(date +%s)
    if ! debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$STATE/rootfs" "$mirror" >"$STATE/debootstrap.log" 2>&1; then
      tail -20 "$STATE/debootstrap.log" >&2; exit 1
    fi
    rm -rf "$STATE"/rootfs/var/cache/apt/archives/*.deb "$STATE"/rootfs/var/lib/apt/lists/*
    touch "$STATE/rootfs/.complete"
    log "debootstrap took $(( $(date +%s) - start )) s"
  fi
  log "podman import the rootfs as $BASE_TAG"
  tar -C "$STATE/rootfs" --exclude=./.complete -c . \
    | podman import --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
fi
cat "$STATE/env.sh"
