# Sourced by the one-call GPU scripts (cascade_dtype_check.sh, kernels_beside_fa3.sh,
# profile_kernels.sh) from the repo root, with OUT set: picks the interpreter, records the
# machine, and runs each benchmark under a time limit and a budget shared by all of them.
#
#   PY                 the first of $PYTHON, python3, python, python3.12 that imports jax (else exit 1)
#   WORK               default /tmp/gpu_runs_work: JAX's compilation cache (JAX_COMPILATION_CACHE_DIR,
#                      unless set), FA3's wheel, reports; shared by the scripts, so a second run on
#                      one machine compiles nothing. $OUT and $WORK are created.
#   STAMP              <device kind>_<date>, for the result files' names
#   $OUT/machine.txt   date, commit, GPUs, jax, its devices and the first one's kind
#   run_cmd NAME LIMIT CMD...   CMD cut at LIMIT s or at what is left of BUDGET (default 230 s),
#                      its output in ${LOG_DIR:-$OUT}/NAME.log, a line in $OUT/runs.txt, the log's tail
#   run NAME LIMIT ARGS...      run_cmd with "$PY" ARGS...
#   install_fa3        when flash_attn3_jax does not import: the first flash_attn3_jax-*.whl under
#                      .whl/ (or .whl/fa3/) installed with --no-deps into $WORK/site, on PYTHONPATH

WORK=${WORK:-/tmp/gpu_runs_work}
mkdir -p "$OUT" "$WORK"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jax-cache}
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
  "$PY" -c "import jax; d = jax.devices(); print('jax', jax.__version__, d); print('device kind:', d[0].device_kind)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
KIND=$(sed -n 's/^device kind: //p' "$OUT/machine.txt")
STAMP="$(echo "${KIND:-unknown}" | tr 'A-Z ' 'a-z_')_$(date -u +%F)"

run_cmd() {  # name, time limit (s), command...: one run, cut at its limit or the budget left
  local name=$1 limit=$2 left
  shift 2
  left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped ($left s of the budget left)" | tee -a "$OUT/runs.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS log="${LOG_DIR:-$OUT}/$name.log"
  timeout -k 5 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/runs.txt"
  tail -n 12 "$log"
}

run() {  # name, time limit (s), python arguments...: run_cmd with the interpreter
  local name=$1 limit=$2
  shift 2
  run_cmd "$name" "$limit" "$PY" "$@"
}

install_fa3() {  # FA3's carried wheel into $WORK/site when it does not import (never a dependency)
  "$PY" -c "import flash_attn3_jax" 2>/dev/null && return
  local wheel
  wheel=$(ls .whl/flash_attn3_jax-*.whl .whl/fa3/flash_attn3_jax-*.whl 2>/dev/null | head -n 1)
  if [ -z "$wheel" ]; then
    echo "no flash_attn3_jax wheel under .whl/: the FA3 rows will say why they are missing"
    return
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$wheel" &&
    export PYTHONPATH="$WORK/site:$PYTHONPATH"
}
