# Sourced by the one-call GPU scripts (cascade_dtype_check.sh, kernels_beside_fa3.sh) from the repo
# root, with OUT set: picks the interpreter, records the machine, and runs each benchmark under a
# time limit and a budget shared by all of them.
#
#   PY                 the first of $PYTHON, python3, python, python3.12 that imports jax (else exit 1)
#   $OUT/machine.txt   date, commit, GPUs, jax and its devices
#   run NAME LIMIT ARGS...   "$PY" ARGS... cut at LIMIT s or at what is left of BUDGET (default
#                      230 s), its output in $OUT/NAME.log, a line in $OUT/runs.txt, the log's tail

PY=
for candidate in ${PYTHON:-} python3 python python3.12; do  # the first interpreter with jax
  if command -v "$candidate" >/dev/null && "$candidate" -c "import jax" 2>/dev/null; then PY=$candidate; break; fi
done
if [ -z "$PY" ]; then echo "no python with jax found (set PYTHON)" | tee "$OUT/runs.txt"; exit 1; fi
BUDGET=${BUDGET:-230}  # seconds for every run together
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi -L 2>/dev/null
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

run() {  # name, time limit (s), python arguments...: one run, cut at its limit or the budget left
  local name=$1 limit=$2 left
  shift 2
  left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped ($left s of the budget left)" | tee -a "$OUT/runs.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  timeout -k 5 "$limit" "$PY" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/runs.txt"
  tail -n 12 "$OUT/$name.log"
}
