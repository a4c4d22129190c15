#!/usr/bin/env bash
# The test command: sets up .venv and the system tools the integration tests use, then runs lint, type
# checks and the whole test suite against real services. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# Independent peers and real servers the integration tests drive: kcat (a second Kafka client) and
# Prometheus (scrapes the services, evaluates dashboards and alert rules).
missing=()
command -v kcat >/dev/null || missing+=(kcat)
command -v prometheus >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "warning: ${missing[*]} not installed and cannot be installed here; tests that need them will fail" >&2
  fi
fi

scripts/setup.sh dev
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
