#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the default test suite on the CPU.
# Extra arguments go to pytest. Exit code 5 (no tests collected) is an error.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh test || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "attn-stack: pytest collected no tests; treating that as a failure" >&2; exit 1; fi
exit $rc
