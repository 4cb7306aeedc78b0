#!/usr/bin/env bash
# Sets up .venv and runs the main job: `attn-stack generate` unless other arguments are given
# (`scripts/run.sh serve ...` adds the serve extra: the HTTP server's dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = serve ]; then scripts/setup_venv.sh serve; else scripts/setup_venv.sh; fi
if [ $# -eq 0 ]; then set -- generate; fi
exec .venv/bin/attn-stack "$@"
