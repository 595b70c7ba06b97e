#!/usr/bin/env bash
# One GPU session's checks, in priority order (each bounded, none stops the others): the device,
# the CUDA unit tests (`pytest -m gpu`), the bf16 packed training step's tokens/s and MFU
# (tools/bench/bench_gpu.py, Qwen2.5-0.5B then 1.5B shapes), engine (HF) vs trainer log-probs,
# trained-positions log-prob head vs full logits, and packed vs padded micro-batches.
# Figures go to $OUT (default ./gpu_out) as JSON, with the whole log in $OUT/log.
#
#     bash tools/gpu_check.sh            # PYTHONPATH must reach megatron_stepwise and megatron-core
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
step() {  # step SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  echo; echo "=== $name ($(date -u +%T), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
}
{
  step 20 device nvidia-smi
  step 60 versions $PY -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| megatron-core', m.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  step 60 pytest-gpu $PY -m pytest -q -m gpu tests/unit/test_gpu.py -p no:cacheprovider
  step 120 bench_gpu-0.5b $PY tools/bench/bench_gpu.py --model qwen2.5-0.5b --prompts 8 --warmup 1 --repeats 3 --out "$OUT/bench_gpu_0.5b.json"
  step 90 engine-agreement $PY tools/bench/bench_engine_agreement.py --model qwen2.5-0.5b --out "$OUT/engine_agreement.json"
  step 60 logprobs-head $PY tools/bench/bench_logprobs.py --device cuda --dtype bf16 --tokens 4096 --hidden 896 --vocab 151936 --chunk 294 --reps 5 --out "$OUT/logprobs.json"
  step 90 packed-vs-padded $PY tools/bench/bench_trainer_step.py --device cuda --hidden 1024 --layers 8 --prompts 8 --samples 8 --repeats 3 --out "$OUT/trainer_step.json"
  step 120 bench_gpu-1.5b $PY tools/bench/bench_gpu.py --model qwen2.5-1.5b --prompts 8 --warmup 1 --repeats 2 --out "$OUT/bench_gpu_1.5b.json"
} 2>&1 | tee "$OUT/log"
# issue 59 item 3, the bf16 gap decomposition (results/bf16_gap_cpu.md is its CPU run):
{ step 150 bf16-gap $PY tools/bench/bench_bf16_gap.py --device cuda --prompts 4 --samples 4 --obs-len 1000 --out "$OUT/bf16_gap.json"; } 2>&1 | tee -a "$OUT/log"
