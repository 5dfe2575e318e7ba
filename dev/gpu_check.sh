#!/bin/bash
# The device checks prepared for a lent GPU (H200 image: torch 2.11, transformers 5.17),
# so the transformers 5.24 wheel travels in .whl (see the closing notes). Run from
# the repository root with OUT set to a folder for the logs.
# One device call: fp32 equality (eager), bf16 equality (eager + compiled), random 7B/0.5B timings.
export PYTHONUNBUFFERED=1
nvidia-smi -L
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -c "import torch,transformers;print('torch',torch.__version__,'transformers',transformers.__version__,torch.cuda.get_device_name())"
t0=$(date +%s)
timeout 90 python3 -m app gpucheck --no-timing --dtype fp32 --compile off --equality-prompts 2 > $OUT/eq_fp32.json 2> $OUT/eq_fp32.err; echo "fp32 equality rc=$? $(( $(date +%s)-t0 ))s"; grep "^gpucheck" $OUT/eq_fp32.err
t0=$(date +%s)
timeout 210 python3 -m app gpucheck --no-timing --equality-prompts 2 > $OUT/eq_bf16.json 2> $OUT/eq_bf16.err; echo "bf16 equality rc=$? $(( $(date +%s)-t0 ))s"; grep "^gpucheck" $OUT/eq_bf16.err; grep -m3 -B2 "Error" $OUT/eq_bf16.err | tail -12
t0=$(date +%s)
timeout 270 python3 -m app gpucheck --no-equality --k 1,4,8 --steps 10 > $OUT/timing.json 2> $OUT/timing.err; echo "timing rc=$? $(( $(date +%s)-t0 ))s"; grep "^gpucheck" $OUT/timing.err | cut -c1-600; grep -m3 -B2 "Error" $OUT/timing.err | tail -12
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv
