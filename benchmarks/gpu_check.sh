#!/usr/bin/env bash
# What a session lent a GPU runs there, in one call (the device tool; about 8 minutes on one
# H100 / H200): the CUDA tests (tests/test_cuda.py and the cuda variants of the
# device-parametrized tests, conftest.DEVICES, the real-size tier among them), then `make bench-gpu` (benchmarks/scale.py --gpu).
# The machine's python3 holds a CUDA torch; packages it lacks (opacus) travel as wheels in .whl/
# (see the device tool's notes) and are unpacked into /tmp/site. Logs and results go to $OUT
# (default benchmarks/results/gpu-run): pytest's log and junit XML, gpu.md, gpu.json.
#   bash benchmarks/gpu_check.sh [TEST_SECONDS] [BENCH_SECONDS]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
workers=$(python3 -c "import os; print(min(8, os.cpu_count() or 1))")
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n $workers" || echo "")
timeout "${1:-240}" python3 -m pytest -p no:cacheprovider -q $xdist -k cuda --junitxml "$OUT/cuda-tests.xml" \
  tests/test_cuda.py tests/test_every_rule_every_reader.py tests/test_zoo.py tests/test_segments.py \
  tests/test_moe.py tests/test_norm.py tests/test_kfac.py tests/test_scale.py tests/test_sample_groups.py \
  tests/test_separation.py tests/test_retracking.py tests/test_trainer_precision.py tests/test_setup_grad_scaler.py 2>&1 | tee "$OUT/cuda-tests-full.log" | tail -n 60 | tee "$OUT/cuda-tests.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/cuda-tests.log"
timeout "${2:-420}" python3 benchmarks/scale.py --gpu --out "$OUT/gpu.md" --json "$OUT/gpu.json" 2>"$OUT/bench.err"
echo "bench exit: $?"; tail -n 5 "$OUT/bench.err"
