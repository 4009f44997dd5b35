#!/usr/bin/env bash
# setup.sh - create .venv and install ddp-job with the pinned versions (constraints.txt).
#
# Usage: scripts/setup.sh [EXTRAS]     e.g. scripts/setup.sh dev   (default: no extras)
# Idempotent: a second run only reinstalls what changed. torch/torchvision come from the local wheel
# store on machines that have one (pip's own config), otherwise from PyPI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
extras=${1:-}
spec="."
[ -n "$extras" ] && spec=".[$extras]"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e "$spec"
