#!/usr/bin/env bash
# test.sh - set up everything the test suite needs on a fresh machine, then run it.
#
#   system packages (apt): Slurm + munge + MariaDB/slurmdbd, podman + runc + debootstrap, iproute2
#   Python: .venv with ddp-job[dev] at the pinned versions
#   services: the tests start and stop their own Slurm cluster, network namespaces and podman images
#
# Usage: scripts/test.sh [pytest args]        (CI runs it with CI=true: no integration test may skip)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  for infra in tests/infra/slurm-cluster.sh tests/infra/podman-setup.sh; do
    [ -f "$infra" ] && bash "$infra" install
  done
fi
scripts/setup.sh dev,bench  # bench: Lightning, the reference of the overhead benchmark
# Three workers, one test file each: the Slurm, podman and netns files mostly wait on services and
# subprocesses, so they overlap well with the CPU-bound torchrun tests (22 min instead of ~55 serially).
exec .venv/bin/python -m pytest -n 3 --dist loadfile "$@"
