#!/usr/bin/env bash
# What a session with a lent GPU runs first (issue 16), in two commands of under 10 minutes each, every
# result written as JSON into one folder (default: $OUT, the device tool's return folder):
#
#   bash benchmarks/gpu_session.sh measure [FOLDER]   # CUDA tests, the pass at K = 64..512, batch profiles
#   bash benchmarks/gpu_session.sh paper   [FOLDER]   # the 1.6-million-star K = 512 fit end to end
#
# Both install the project first when it is not importable (the GPU machine starts bare).
set -euo pipefail
cd "$(dirname "$0")/.."
step="${1:?say measure or paper}"
out="${2:-${OUT:?give a folder or set OUT}}"
mkdir -p "$out"
python -c "import scalable_xd" 2>/dev/null || pip install -q -e ".[test]"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia_smi.csv"
python -c "import torch, json; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,
  'triton': __import__('triton').__version__ if __import__('importlib').util.find_spec('triton') else None}))" \
  > "$out/versions.json"
case "$step" in
  measure)
    python -m pytest -q -m cuda tests/test_cuda.py > "$out/pytest_cuda.txt" 2>&1 || true
    python benchmarks/bench_fit.py --device cuda --n-components 64 128 256 512 --batch-sizes 500 50000 \
      --label gpu > "$out/bench_fit.log" 2>&1
    for k in 64 512; do
      python benchmarks/profile_batch.py --device cuda --n-components "$k" --batch-size 500 --backend compiled \
        > "$out/profile_K$k.log" 2>&1
    done
    ;;
  paper)
    python benchmarks/bench_paper_fit.py --device cuda > "$out/bench_paper_fit.log" 2>&1
    ;;
  *) echo "unknown step $step: say measure or paper" >&2; exit 2 ;;
esac
cp benchmarks/results/*.json "$out/"
