#!/usr/bin/env bash
# One GPU session's checks, in priority order (each bounded, none stops the others, all of them
# within BUDGET seconds, 480 = 8 minutes: a step gets what is left, and is skipped under 10 s):
# the device, the CUDA unit tests (`pytest -m gpu`), the local spec's packed attention one-call vs
# per-row (tools/bench/bench_local_attention.py: mixed rows and the equal-rows scaling rows), the
# bf16 packed training step's tokens/s and MFU per variant (tools/bench/bench_gpu.py: per-row
# baseline, one call, one call + fused elementwise; Qwen2.5-0.5B then 1.5B shapes), packed vs
# padded micro-batches with every attention variant (tools/bench/bench_trainer_step.py --fused),
# engine (HF) vs trainer log-probs, trained-positions log-prob head vs full logits, the weight push
# per weight_sync.mode (tools/bench/bench_weight_sync.py, 0.5B and 1.5B shapes) and the bf16 gap
# decomposition (tools/bench/bench_bf16_gap.py).
# Figures go to $OUT (default results/gpu_check) as JSON, with the whole log in $OUT/log.
#
#     bash tools/gpu_check.sh            # PYTHONPATH must reach megatron_stepwise and megatron-core
#     DRY=1 bash tools/gpu_check.sh      # the same Python steps on the CPU at tiny shapes, limits x10
#                                        # (the suite's check of this script: tests/integration/test_gpu_check.py)
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_check}
BUDGET=${BUDGET:-480}
SCALE=1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -n "$DRY" ]; then  # CPU, tiny shapes: every Python entry point below, in seconds
  export CUDA_VISIBLE_DEVICES=""
  DEV="--device cpu"
  ATTN="--quick"
  GPU05="--model tiny --quick --prompts 1 --samples 2"
  GPU15="$GPU05"
  V15="per_row"  # the 0.5B step already compiles the fused variant once
  AGREE="--model tiny --prompts 1 --samples 2"
  LOGPROBS="--tokens 256 --hidden 64 --vocab 512 --chunk 64 --reps 1 --masked 0.5"
  STEP="--quick"
  BF16="--quick"
  SYNC="--quick"
  SCALE=${DRY_SCALE:-10}  # a shared CPU is slower than the GPU the limits are set for
  BUDGET=${BUDGET_DRY:-3000}
else
  DEV="--device cuda"
  ATTN="--lengths 3072 512 256 128 64 64 --total 4096 --rows 1 4 16 64 --heads 14 --kv-heads 2 --repeats 5"
  GPU05="--model qwen2.5-0.5b --prompts 8 --warmup 1 --repeats 2"
  GPU15="--model qwen2.5-1.5b --prompts 8 --warmup 1 --repeats 2"
  V15="fused per_row"
  AGREE="--model qwen2.5-0.5b"
  LOGPROBS="--dtype bf16 --tokens 4096 --hidden 896 --vocab 151936 --chunk 294 --reps 5"
  STEP="--hidden 1024 --layers 8 --prompts 8 --samples 8 --repeats 2"
  BF16="--prompts 4 --samples 4 --obs-len 1000"
  SYNC="--models qwen2.5-0.5b qwen2.5-1.5b --repeat 2"
fi
step() {  # step SECONDS NAME COMMAND...: at most SECONDS, and no more than the budget has left
  local limit=$(($1 * SCALE)) name=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 10 ]; then echo; echo "=== $name: skipped, ${left}s of the ${BUDGET}s budget left"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo; echo "=== $name ($(date -u +%T), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
}
{
  if [ -z "$DRY" ]; then
    step 20 device nvidia-smi
    step 60 pytest-gpu $PY -m pytest -q -m gpu tests/unit/test_gpu.py -p no:cacheprovider
  fi
  step 60 versions $PY -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| megatron-core', m.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  step 45 attention $PY tools/bench/bench_local_attention.py $DEV $ATTN --out "$OUT/attention.json"
  step 150 bench_gpu-0.5b $PY tools/bench/bench_gpu.py $DEV $GPU05 --variants per_row one_call fused --out "$OUT/bench_gpu_0.5b.json"
  step 120 bench_gpu-1.5b $PY tools/bench/bench_gpu.py $DEV $GPU15 --variants $V15 --out "$OUT/bench_gpu_1.5b.json"
  step 90 packed-vs-padded $PY tools/bench/bench_trainer_step.py $DEV $STEP --fused --out "$OUT/trainer_step.json"
  step 60 engine-agreement $PY tools/bench/bench_engine_agreement.py $DEV $AGREE --out "$OUT/engine_agreement.json"
  step 40 logprobs-head $PY tools/bench/bench_logprobs.py $DEV $LOGPROBS --out "$OUT/logprobs.json"
  # seconds and MB/s of each weight_sync.mode (disk, tensor, distributed) at the 0.5B and 1.5B shapes
  step 120 weight-push $PY tools/bench/bench_weight_sync.py $SYNC --out "$OUT/weight_sync.json"
  # the bf16 gap decomposition (results/bf16_gap_cpu.md is its CPU run)
  step 90 bf16-gap $PY tools/bench/bench_bf16_gap.py $DEV $BF16 --out "$OUT/bf16_gap.json"
} 2>&1 | tee "$OUT/log"
