#!/usr/bin/env bash
# One-off GPU session script (2026-12-01); results go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=$(command -v python3)
t0=$SECONDS
{ $PY -c "import jax, optax, flax, platform; print('python', platform.python_version(), 'jax', jax.__version__, 'optax', optax.__version__, 'flax', flax.__version__); print(jax.devices())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; uptime; git log -1 --format=%H 2>/dev/null; } 2>&1 | tee $OUT/env.log
{ $PY -m pip install --no-index --no-deps .whl/setuptools-*.whl 2>&1 || $PY -m pip install --break-system-packages --no-index --no-deps .whl/setuptools-*.whl 2>&1
  timeout 120 $PY -m pip install --no-deps --no-build-isolation --no-index -e . 2>&1 || timeout 120 $PY -m pip install --break-system-packages --no-deps --no-build-isolation --no-index -e . 2>&1; } | tail -5 | tee $OUT/install.log
if ! $PY -c "from optax_decoupled import cpu_kernel as k; raise SystemExit(not k.available())"; then
  echo "kernel not built: OPTAX_DECOUPLED_NO_KERNEL=1, package on PYTHONPATH" | tee -a $OUT/install.log
  export OPTAX_DECOUPLED_NO_KERNEL=1 PYTHONPATH=$PWD
fi
echo "== setup done at $((SECONDS-t0)) s"
timeout 60 $PY benchmarks/excess_precision.py --json $OUT/excess_default.json 2>&1 | tee $OUT/excess.log
XLA_FLAGS=--xla_allow_excess_precision=false timeout 60 $PY benchmarks/excess_precision.py --json $OUT/excess_flag_false.json 2>&1 | tee -a $OUT/excess.log
timeout 60 $PY -m pytest -q -p no:cacheprovider -rfEs tests/test_storage.py -k "narrow or read_back" 2>&1 | tail -15 | tee $OUT/new_tests.log
# the same tests with narrow replaced by a plain cast: should fail on the GPU if the rewrite happens
cat > /tmp/conftest_patch.py <<'PY'
import optax_decoupled.storage as S
S.narrow = lambda v, d: v.astype(d)
PY
timeout 60 env PYTHONPATH=/tmp:${PYTHONPATH:-} $PY -c "import conftest_patch, pytest, sys; sys.exit(pytest.main(['-q','-p','no:cacheprovider','tests/test_storage.py','-k','read_back']))" 2>&1 | tail -8 | tee $OUT/new_tests_plain_cast.log
echo "== checks done at $((SECONDS-t0)) s"
timeout 70 $PY benchmarks/state_memory.py --sizes 1e8 --ragged --dtypes bfloat16 bfloat16-sr int8 --repeats 15 --json $OUT/state_gpu.json 2>&1 | tail -12 | tee $OUT/state.log
echo "== bench done at $((SECONDS-t0)) s"
OPTAX_DECOUPLED_SMOKE=1 OPTAX_DECOUPLED_OFFLINE=1 timeout -s INT -k 15 ${SUITE_S:-380} $PY -m pytest -q -p no:cacheprovider -rfEs --durations=15 -n 15 --dist worksteal --junitxml=$OUT/tests.xml tests > $OUT/tests.log 2>&1
echo "suite rc $?"; tail -40 $OUT/tests.log
gzip -f $OUT/tests.xml 2>/dev/null; gzip -kf $OUT/tests.log 2>/dev/null
echo "== all done at $((SECONDS-t0)) s"
