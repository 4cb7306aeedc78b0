#!/usr/bin/env bash
# Prints the path of a working Python >= 3.12, or exits 1 with a message naming
# every candidate tried. Each candidate is actually run: a pyenv shim that exists
# on PATH but fails when run (as on these machines) is skipped.
set -u
min_minor=12
candidates=()
[ -n "${ATTN_STACK_PYTHON:-}" ] && candidates+=("$ATTN_STACK_PYTHON")
for v in 3.14 3.13 3.12; do candidates+=("python$v"); done
candidates+=(python3 python)
for root in "${PYENV_ROOT:-$HOME/.pyenv}/versions" /usr/local/bin /opt/python; do
  for p in "$root"/3.1[2-9]*/bin/python3 "$root"/python3.1[2-9]; do
    [ -e "$p" ] && candidates+=("$p")
  done
done
for c in "${candidates[@]}"; do
  out=$("$c" -c "import sys; ok = sys.version_info >= (3, $min_minor); print(sys.executable if ok else '')" 2>/dev/null) || continue
  if [ -n "$out" ]; then echo "$out"; exit 0; fi
done
{
  echo "error: attn-stack needs Python >= 3.$min_minor (jax 0.11 requires it); none of these worked:"
  printf '  %s\n' "${candidates[@]}"
  echo "Install one (e.g. 'pyenv install 3.12') or point ATTN_STACK_PYTHON at its interpreter."
} >&2
exit 1
