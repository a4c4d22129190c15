#!/usr/bin/env bash
# The run command: sets up .venv with the embedded stand-ins and runs the demo. Extra arguments go to
# `chorus demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh embedded
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/chorus demo "$@"
