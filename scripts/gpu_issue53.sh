#!/usr/bin/env bash
# scripts/gpu_issue53.sh OUT COMMIT [SECONDS]: issues 53's and 52's GPU checks and targets in one command.
#
# For a lent GPU machine (docs/GPU.md, "Running them on a lent GPU machine": .gpu/ prepared and
# carried). Within SECONDS (default 540, one 10-minute command with room to spare):
#   1. gpu_check.sh: the build (the CUDA kernels gpu_bench then uses), the CUDA tests of the static
#      step, its graphs, late reads and host syncs, and the toy's static decodes on the CPU and the GPU
#      compared (graphs = eager bitwise); at most 37% of the time;
#   2. gpu_bench.sh: the 4-member stand-in (model1 trained TRAIN_SECONDS, default 150: 60 s left a model that
#      says "The ." to every sentence on an H200), the others derived; the
#      behaviour check, then the decodes in the targets' order (benchmarks/gpu_bench.py PRIORITY) and
#      the targets (benchmarks/gpu_targets.py), in the time left.
# OUT receives 6 files (a lent machine sends back 8 at most): check_summary.md, check_results.json,
# bench_summary.md, bench_results.json, bench_report.md and details.tar.gz (both runs' logs,
# hypotheses and plots), written on exit whatever happened.
set -uo pipefail
out=${1:?usage: gpu_issue53.sh OUT COMMIT [SECONDS]}
commit=${2:?usage: gpu_issue53.sh OUT COMMIT [SECONDS]}
total=${3:-540}
repo=$(cd "$(dirname "$0")/.." && pwd)
gpu=${GPU_DIR:-$repo/.gpu}
# CI's and a developer's dry run: DEVICE=cpu (the tiny stand-in, nothing timed means anything).
device=(--device "${DEVICE:-cuda}")
wheels=()
text=()
# The wheels (the lent machine's Python) and the stand-in's text (the full-size stand-in's BPE) are the GPU
# run's: a CPU dry run's pip refuses the wheels, and its tiny stand-in cannot take that text.
if [ "${DEVICE:-cuda}" != cpu ]; then
  [ -d "$gpu/wheels" ] && wheels=(--wheels "$gpu/wheels")
  [ -d "$gpu/standin-text" ] && text=(--standin-text "$gpu/standin-text")
fi
work=${TMPDIR:-/tmp}/gpu-issue53
start=$SECONDS
mkdir -p "$out" "$work"

collect() {
  for run in check bench; do
    cp "$work/$run/out/summary.md" "$out/${run}_summary.md" 2>/dev/null
    cp "$work/$run/out/results.json" "$out/${run}_results.json" 2>/dev/null
  done
  cp "$work/bench/out/plots/report.md" "$out/bench_report.md" 2>/dev/null
  (cd "$work" && tar czf "$out/details.tar.gz" --ignore-failed-read check/out/details.tar.gz \
      bench/out/details.tar.gz bench/out/plots 2>/dev/null)
  return 0
}
trap collect EXIT

bash "$repo/scripts/gpu_check.sh" "$work/check/out" "${device[@]}" --work-dir "$work/check/work" "${wheels[@]}" \
    --toy "$gpu/toy" --commit "$commit" --deadline $((total * 37 / 100)) --no-fp16 \
    --tests-k "cuda and (step_graphs or static or host_sync or late_reads or beam_step or indexed_attention or cache_slots)" \
    --methods greedy fixed-static fixed-static-graphs greedy-static-graphs
left=$((total - (SECONDS - start) - 10))
# The packages gpu_check installed serve gpu_bench too (installing them again costs half a minute).
site=$work/check/work/site
if [ -d "$site" ]; then
  wheels=()
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
bash "$repo/scripts/gpu_bench.sh" "$work/bench/out" "${device[@]}" --work-dir "$work/bench/work" "${wheels[@]}" \
    --commit "$commit" --deadline "$left" "${text[@]}" --train-seconds "${TRAIN_SECONDS:-150}" \
    --train-text "$gpu"/wmt/newstest201{3,4,5,6}.{de,en} \
    --source "$gpu/wmt/newstest2017.de" --reference "$gpu/wmt/newstest2017.en" --limit "${LIMIT:-300}" --beams 5 50
