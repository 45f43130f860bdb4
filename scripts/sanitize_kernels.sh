#!/usr/bin/env bash
# The compiled kernels under AddressSanitizer and UBSan (issue 49, item 12): builds them with
# FAIRSEQ_STREAM_SANITIZE=1 (setup.py: -fsanitize=address,undefined,float-cast-overflow, no recovery) in a copy
# of this checkout, apart from its own build, and runs the kernel tests there, the fuzzed shapes
# (tests/test_kernel_fuzz.py) included. An out-of-bounds access, or undefined behaviour such as a NaN converted
# to an integer, stops the process with a report naming the source line: the run fails.
#
#   bash scripts/sanitize_kernels.sh [pytest arguments]
#
# Without arguments, or with options that name no test file (`-x`, `-k attention`), it runs KERNEL_TESTS below, with FAIRSEQ_STREAM_FUZZ_SHAPES (default 1000) shapes an op.
# FAIRSEQ_STREAM_SANITIZE_DIR (default build/sanitize) keeps the copy and its build: a second run recompiles
# only the sources that changed. The environment: .venv, or $FAIRSEQ_STREAM_VENV (made by scripts/setup_env.sh;
# nothing is installed into it). The first build takes several minutes (the kernels' usual compile, slower).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${FAIRSEQ_STREAM_VENV:-$REPO/.venv}
PYTHON=$VENV/bin/python
DIR=${FAIRSEQ_STREAM_SANITIZE_DIR:-$REPO/build/sanitize}
SRC=$DIR/src
KERNEL_TESTS=(tests/test_kernel_safety.py tests/test_kernel_fuzz.py tests/test_quantized_linear.py
  tests/test_int16_linear.py tests/test_attention.py tests/test_beam_step.py tests/test_output_layer.py
  tests/test_prepacked_linear.py tests/test_rnn_step.py tests/test_lean_step.py tests/test_search_loop.py
  tests/test_threads.py
  # Its decode runs with LD_PRELOAD set to a counting shim alone, which would load the module without ASan.
  --deselect tests/test_threads.py::test_a_two_thread_decode_enters_no_openmp_region)

if [ ! -x "$PYTHON" ]; then
  echo "fairseq-stream: no environment at $VENV (bash scripts/setup_env.sh makes it)" >&2
  exit 2
fi
CXX=${CXX:-c++}
ASAN_LIB=$("$CXX" -print-file-name=libasan.so)
STDCXX_LIB=$("$CXX" -print-file-name=libstdc++.so.6)
if [ ! -e "$ASAN_LIB" ]; then
  echo "fairseq-stream: $CXX has no AddressSanitizer runtime (libasan.so; Debian: apt-get install libasan8)" >&2
  exit 2
fi

# The checkout's files (tracked and new, not ignored) copied with their times, so that ninja recompiles only the
# sources that changed; the package, tests and scripts replaced whole, so that none deleted here stays there.
start=$(date +%s)
mkdir -p "$SRC"
rm -rf "$SRC/fairseq_stream" "$SRC/tests" "$SRC/scripts"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -f "$f" ] && printf '%s\0' "$f"
done | xargs -0 cp --parents -p -t "$SRC"

echo "fairseq-stream: building the kernels with sanitizers in $SRC (log: $DIR/build.log)"
if ! (cd "$SRC" && FAIRSEQ_STREAM_SANITIZE=1 CXX="$CXX" nice -n 10 "$PYTHON" setup.py build_ext --inplace) \
  > "$DIR/build.log" 2>&1; then
  tail -n 40 "$DIR/build.log" >&2
  echo "fairseq-stream: the sanitizer build failed (log: $DIR/build.log)" >&2
  exit 1
fi
module=$(ls "$SRC"/fairseq_stream/_ops_cpu*.so)
if ! ldd "$module" | grep -q libasan; then
  echo "fairseq-stream: $module is not linked with AddressSanitizer: the build did not take the flags" >&2
  exit 1
fi
built=$(date +%s)

# Python itself is not instrumented, so ASan's runtime must be loaded first (the module brings UBSan's), and
# libstdc++ with it: Python does not load it, and ASan, started before it, found no __cxa_throw to wrap and
# aborted at the first C++ exception (a TORCH_CHECK). detect_leaks=0: CPython and torch keep memory to the
# end by design. The reports go to files (pytest captures the tests' stderr, which an abort loses), printed
# below.
REPORTS=$DIR/reports
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
export LD_PRELOAD="$ASAN_LIB $STDCXX_LIB"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$REPORTS/asan}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:log_path=$REPORTS/ubsan}
export FAIRSEQ_STREAM_FUZZ_SHAPES=${FAIRSEQ_STREAM_FUZZ_SHAPES:-1000}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Arguments that name no test (pytest's options alone, `-x`, `-k attention`) run on the kernel tests: given to
# pytest as they were, they ran the whole suite under the sanitizers (and hung in a download test's curl).
names_a_test=no
for arg in "$@"; do
  if [ -e "$REPO/${arg%%::*}" ]; then names_a_test=yes; fi
done
if [ "$names_a_test" = no ]; then
  set -- "$@" "${KERNEL_TESTS[@]}"
fi
rc=0
(cd "$SRC" && PYTHONPATH="$SRC" "$PYTHON" -m pytest -n 0 -q -p no:cacheprovider "$@") || rc=$?
end=$(date +%s)
for report in "$REPORTS"/*; do
  [ -e "$report" ] || continue
  echo "---- $report ----"
  head -n 60 "$report"
  # A finding fails the run even where the process went on; a warning (ASan's on makecontext, which a
  # library of the test environment calls) does not.
  if grep -q "ERROR: AddressSanitizer\|runtime error:" "$report" && [ "$rc" -eq 0 ]; then rc=1; fi
done
echo "fairseq-stream: sanitizer run rc=$rc: build $((built - start)) s, tests $((end - built)) s"
exit "$rc"
