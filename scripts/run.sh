#!/usr/bin/env bash
# Sets up .venv and runs the main job: `attn-stack generate` unless other arguments are given.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh
if [ $# -eq 0 ]; then set -- generate; fi
exec .venv/bin/attn-stack "$@"
