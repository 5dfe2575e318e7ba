#!/bin/bash
# The device checks prepared for a lent GPU (image: torch 2.11, transformers 5.17, no gradio), in one
# call that finishes inside 8 minutes. Run from the repository root with OUT set to a folder for the
# logs, after dev/gpu_stage.sh's parts have reached /tmp/whl (it prints the calls).
# Each gpucheck times the dynamic cache, the static cache's plain passes and its CUDA graphs, with the
# fused pass's layers (the default) and with transformers' own (and probes whether fixed-width rows are
# exact), or checks the bundled family's outputs on the dynamic cache and the graphs. About 7 minutes
# in all on an H200 (fp32 equality 78 s, bf16 equality under 130 s, SmolLM2's shape about 90 s and the
# 7B shape about 90 s, each with its fourth column); each step's JSON goes to $OUT.
export PYTHONUNBUFFERED=1 USE_HUB_KERNELS=NO HF_HUB_OFFLINE=1
nvidia-smi -L
if ls /tmp/whl/part-* >/dev/null 2>&1; then
  cat /tmp/whl/part-* | tar -xf - -C /tmp/whl
  for w in /tmp/whl/wheels/*.whl; do  # one at a time: the regex wheels of other Pythons are refused
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" 2>/dev/null
  done
  export PYTHONPATH=/tmp/site
fi
python3 -c "import torch,transformers;print('torch',torch.__version__,'transformers',transformers.__version__,torch.cuda.get_device_name())"
step() {  # name, seconds, gpucheck arguments...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" python3 -m app gpucheck "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "$name rc=$? $(( $(date +%s) - t0 ))s"; grep "^gpucheck" "$OUT/$name.err" | cut -c1-900; grep -m3 -B2 "Error" "$OUT/$name.err" | tail -12
}
step eq_fp32 90 --no-timing --dtype fp32 --compile off --equality-prompts 1
step eq_bf16 130 --no-timing --compile off --equality-prompts 1  # 90 s cut off its second draft on an H200
step smollm2 170 --shapes smollm2 --no-equality --compile off --k 4 --steps 20  # torch.compile's column: 2.21 ms, kept in the docs
step qwen 170 --no-equality --compile off --k 4 --steps 10
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv
