#!/usr/bin/env bash
# What a session with a lent GPU runs: named steps, each under its own time limit, every log and JSON
# written into one folder (GPU_SESSION_OUT, default /tmp/gpu_session) and, where the device tool's $OUT is
# set, packed into $OUT/gpu_session.tgz (the tool returns at most 8 files).
#
#   bash benchmarks/gpu_session.sh tests update_tests          # the CUDA tests (each under 120 s), then the
#                                                              # Triton update's, compiled
#   bash benchmarks/gpu_session.sh pass step profile           # the pass at K = 64..512, the
#                                                              # step's overhead, per-update profiles,
#                                                              # one validation scoring's and the pass's
#                                                              # at batch 50,000
#   bash benchmarks/gpu_session.sh paper                       # the 1.6-million-star K = 512 fit
#   bash benchmarks/gpu_session.sh concurrent                  # one such fit alone, then four at once
#   bash benchmarks/gpu_session.sh chunks                      # the pass at batch 50,000 by chunk size
#   bash benchmarks/gpu_session.sh launch                      # the pass's kernels alone by launch shape,
#                                                              # the log-sum-exp kernel against torch's
#   bash benchmarks/gpu_session.sh lockstep                    # 10 starts in one replayed step against one
#                                                              # fit (K = 64 and 512, batch 500)
#
# PASS_KS, PASS_KERNELS, STEP_BACKENDS, PROFILE_KS and PAPER_METHODS narrow the pass, step, profile and
# paper steps (default: all).
#
# The GPU machine has torch, triton, numba, numpy, pandas, pyarrow and scikit-learn but no network: the
# project is used from src/ when it is not installed. The paper and concurrent steps make the DR2-like
# mock, which needs astropy: carry its wheels (astropy, pyerfa, astropy-iers-data) and put them on
# PYTHONPATH first. What the H100 took, in seconds (2026-11-26, the second session's last call): tests 95
# and the update kernel's tests 37, pass 51 (PASS_KS=512 PASS_KERNELS=triton), step over 40 (triton; now
# 90 allowed, as it times the Triton update beside torch's), profile 11 and 13 (K = 512, ordinary and
# graphed), paper 82 (minibatch EM, 40 of them making the mock); a machine's start about 30. On the H200
# (2026-11-27): tests 134 (34 tests; the compiled backend's first compile 24 s of it), update_tests 45, step
# 67, pass 53, profile 13 + 14 + 15 (evaluation), paper 89-92 (48 making the mock). In a 15-minute device
# budget that is one call of "step pass profile paper tests" with those narrowings and STEP_BACKENDS=triton
# PROFILE_KS=512 PAPER_METHODS=minibatch_em (about 7 minutes with the start), and a second for the checks of
# what the first found, or for "concurrent". Since fits in lockstep share one replayed step on CUDA and SGD's
# update became two Triton kernels (neither yet run on a GPU), the next call is "tests update_tests lockstep"
# first (the CUDA tests, the update kernels' tests compiled, 10 starts against one), then "step" with
# STEP_BACKENDS=triton and "paper" with PAPER_METHODS=minibatch_em if time is left.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_SESSION_OUT:-/tmp/gpu_session}"
mkdir -p "$out"
python3 -c "import scalable_xd" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
: > "$out/steps.tsv"
touch "$out/.started"  # the JSONs written since are packed
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > "$out/nvidia_smi.csv"

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
    tests) step tests 300 python3 -m pytest -v -m cuda --timeout 120 --durations 10 tests/fit/test_cuda.py \
             tests/fit/test_cuda_engine.py ;;
    update_tests) step tests_cuda_rules 150 python3 -m pytest -q tests/fit/test_cuda_rules.py ;;
    pass) step pass 120 python3 benchmarks/bench_fit.py --device cuda --n-components ${PASS_KS:-64 128 256 512} \
            --batch-sizes 500 50000 --repeats 10 --skip-epochs --kernels ${PASS_KERNELS:-triton unrolled} --label gpu ;;
    chunks) # the pass at K = 512, batch 50,000 cut into chunks of 4, 16 and 32 M pairs (4 M: the default on
            # CUDA), its per-chunk tests at each chunk (a wait for the device each) and deferred as fits run them
            for checks in "" --deferred-checks; do
              step "chunks${checks:+_deferred}" 60 python3 benchmarks/bench_fit.py --device cuda --n-components 512 \
                --batch-sizes 50000 --dtypes float32 --kernels triton --max-pairs 4194304 16777216 33554432 \
                --repeats 10 --skip-epochs --skip-baselines $checks --label "gpu_chunks${checks:+_deferred}"
            done ;;
    launch) step launch 120 python3 benchmarks/bench_triton_launch.py --device cuda ;;
    step) for backend in ${STEP_BACKENDS:-triton unrolled}; do
            step "step_$backend" 90 python3 benchmarks/bench_step.py --device cuda --n-components 64 512 \
              --backend "$backend" --label "gpu_$backend"
          done ;;
    profile) for k in ${PROFILE_KS:-64 512}; do  # the uncaptured step, then the body a graph replays
               for kind in ordinary graphed; do
                 step "profile_K${k}_$kind" 30 python3 benchmarks/profile_batch.py --device cuda --n-components "$k" \
                   --batch-size 500 --backend triton --step "$kind"
               done
             done
             step profile_evaluation 60 python3 benchmarks/profile_batch.py --device cuda --n-components 512 \
               --batch-size 65536 --updates 3 --backend triton --step evaluation
             # the pass at batch 50,000 (the 1e10 pairs/s target's): the device time of each torch operation
             # on the (K, B) arrays between its two kernels
             step profile_pass 60 python3 benchmarks/profile_batch.py --device cuda --n-components 512 \
               --batch-size 50000 --updates 3 --backend triton ;;
    paper) for method in ${PAPER_METHODS:-minibatch_em sgd}; do
             step "paper_$method" 170 python3 benchmarks/bench_paper_fit.py --device cuda --method "$method" \
               --kernel triton --label "gpu_$method"
           done ;;
    concurrent) # several fits at once on one GPU, the grid's route to its target: a short minibatch-EM fit of the
                # paper-scale data alone (which prepares the data where the paper step has not), then four at
                # once; their JSONs (each fit's own seconds) go to concurrent_1/ and concurrent_4/
                for n in 1 4; do
                  step "concurrent_$n" 200 bash -c "for i in \$(seq $n); do BENCH_RESULTS=$out/concurrent_$n \
                    python3 benchmarks/bench_paper_fit.py --device cuda --method minibatch_em --epochs 5 --kernel triton \
                    --label concurrent_\$i & done; wait"
                done ;;
    lockstep) # n_init = 10 against one fit, both methods, 200,000 stars, 2 epochs: the GPU target of the issue
              # on many fits at once (10 starts of minibatch EM at K = 512 in at most 2x one fit's time)
              step lockstep 240 python3 benchmarks/bench_lockstep.py --device cuda --n 200000 --k 64 512 --epochs 2 \
                --starts 10 --rounds 2 --train-score-rows 10000 ;;
    *) echo "unknown step $name: say tests, update_tests, pass, chunks, launch, step, profile, paper, concurrent or lockstep" >&2
       exit 2 ;;
  esac
done
# The session's record beside the benchmarks' JSON: device, driver and versions, and every step's exit status
# and seconds (appended to the record of an earlier call on the same device and versions, whose notes,
# written by hand, say what each call found).
python3 - "$out" <<'EOF_RECORD'
import csv, importlib.util, json, re, sys
from datetime import datetime, timezone
from pathlib import Path

import torch

out = Path(sys.argv[1])
name, driver, memory, sm_clock = (f.strip() for f in (out / "nvidia_smi.csv").read_text().split(","))
record = Path("benchmarks/results") / f"gpu_session_{re.sub('[^a-z0-9]+', '_', name.lower())}.json"  # one a device
version = lambda m: getattr(importlib.import_module(m), "__version__", None) if importlib.util.find_spec(m) else None
setup = {"device": name, "driver": driver, "memory": memory, "max_sm_clock": sm_clock, "torch": torch.__version__,
         "cuda": torch.version.cuda, "triton": version("triton"), "numba": version("numba")}
steps = [{"step": s, "exit_status": int(rc), "seconds": int(t)} for s, rc, t in csv.reader(open(out / "steps.tsv"), delimiter="\t")]
when = datetime.now(timezone.utc).isoformat(timespec="seconds")
old = json.loads(record.read_text()) if record.exists() else {}
same = {k: old.get(k) for k in setup} == setup  # else a new record: another device or other versions
earlier, notes = (old.get("steps", []), old.get("notes", [])) if same else ([], [])
call = max((s.get("call", 0) for s in earlier), default=0) + 1
steps = earlier + [{**s, "call": call, "when": when} for s in steps]
record.write_text(json.dumps({**setup, "notes": notes, "steps": steps}, indent=1) + "\n")
EOF_RECORD
find benchmarks/results -name "*.json" -newer "$out/.started" -exec cp {} "$out/" \;
if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu_session.tgz" -C "$out" --exclude gpu_session.tgz --exclude .started .; fi
cat "$out/steps.tsv"
