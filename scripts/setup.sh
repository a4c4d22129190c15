#!/usr/bin/env bash
# Creates .venv in the repository root and installs the project with the given extras, once per change of
# pyproject.toml. Usage: scripts/setup.sh [extras]   (e.g. "embedded" or "dev")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-embedded}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=".venv/.chorus-installed-${extras//,/-}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch is pinned to the CPU wheel (see pyproject.toml); everything else comes from PyPI.
  .venv/bin/python -m pip install --quiet -e ".[${extras}]"
  echo "$want" > "$stamp"
fi
