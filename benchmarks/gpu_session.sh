#!/usr/bin/env bash
# What a session with a lent GPU runs: named steps, each under its own time limit, every log and JSON
# written into one folder (GPU_SESSION_OUT, default /tmp/gpu_session) and, where the device tool's $OUT is
# set, packed into $OUT/gpu_session.tgz (the tool returns at most 8 files).
#
#   bash benchmarks/gpu_session.sh tests pass step profile     # CUDA tests, the pass at K = 64..512, the
#                                                              # step's overhead, per-update profiles
#   bash benchmarks/gpu_session.sh paper                       # the 1.6-million-star K = 512 fit
#
# The GPU machine has torch, triton, numba, numpy, pandas, pyarrow and scikit-learn but no network: the
# project is used from src/ when it is not installed, and nothing else is needed by these steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_SESSION_OUT:-/tmp/gpu_session}"
mkdir -p "$out"
python3 -c "import scalable_xd" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/nvidia_smi.csv"
python3 -c "
import importlib, json, torch
v = lambda name: getattr(importlib.import_module(name), '__version__', None) if importlib.util.find_spec(name) else None
print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'triton': v('triton'), 'numba': v('numba'),
                  'device': torch.cuda.get_device_name(0)}))" > "$out/versions.json"

# step NAME LIMIT_S COMMAND...: run one step, its output in NAME.log, its exit status and seconds in steps.tsv.
step() {
  local name=$1 limit=$2; shift 2
  local tick=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - tick))" | tee -a "$out/steps.tsv"
}

for name in "$@"; do
  case "$name" in
    tests) step tests 170 python3 -m pytest -q -m cuda tests/test_cuda.py tests/test_cuda_graphs.py ;;
    pass) step pass 170 python3 benchmarks/bench_fit.py --device cuda --n-components 64 128 256 512 \
            --batch-sizes 500 50000 --repeats 10 --skip-epochs --label gpu ;;
    step) for backend in triton unrolled; do
            step "step_$backend" 60 python3 benchmarks/bench_step.py --device cuda --n-components 64 512 \
              --backend "$backend" --label "gpu_$backend"
          done ;;
    profile) for k in 64 512; do
               step "profile_K$k" 50 python3 benchmarks/profile_batch.py --device cuda --n-components "$k" \
                 --batch-size 500 --backend triton
             done ;;
    paper) for method in minibatch_em sgd; do
             step "paper_$method" 280 python3 benchmarks/bench_paper_fit.py --device cuda --method "$method" \
               --kernel triton --label "gpu_$method"
           done ;;
    *) echo "unknown step $name: say tests, pass, step, profile or paper" >&2; exit 2 ;;
  esac
done
cp benchmarks/results/*gpu*.json benchmarks/results/*cuda*.json "$out/" 2>/dev/null
if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu_session.tgz" -C "$out" .; fi
column -t "$out/steps.tsv"
