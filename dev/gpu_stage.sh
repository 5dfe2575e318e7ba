#!/bin/bash
# Stage what the GPU image lacks (it has transformers 5.17; the app needs >= 5.24) in pieces small
# enough to travel beside the checkout (the device tool carries 64 MiB in all). Run here, from the
# repository root; it writes .whl/part-* (ignored) and prints the device calls to make, one per part,
# back to back (a warm machine keeps /tmp for about 30 s idle):
#   run(carry=[".whl/part-aa"], command="mkdir -p /tmp/whl && cp .whl/part-aa /tmp/whl/")
#   ... and for the last part, the check itself:
#   run(carry=[".whl/part-ac"], command="cp .whl/part-ac /tmp/whl/ && OUT=$OUT bash dev/gpu_check.sh")
set -e
rm -rf .whl && mkdir -p .whl/wheels
version() { pip show "$1" | sed -n 's/^Version: //p'; }
# transformers and what its import checks or needs that the image's older set lacks (regex for every
# Python the image may run; the hub's HTTP client). hf-xet, the hub's upload path, is left out: offline.
pip download -q --no-deps -d .whl/wheels $(for p in transformers huggingface_hub tokenizers safetensors \
  httpx2 httpcore2 truststore click; do echo "$p==$(version $p)"; done)
for py in 310 311 312 313; do
  pip download -q --no-deps --only-binary=:all: --python-version $py --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl/wheels "regex==$(version regex)"
done
tar -cf .whl/wheels.tar -C .whl wheels && rm -rf .whl/wheels
split -n 3 .whl/wheels.tar .whl/part- && rm .whl/wheels.tar  # three parts of about 7 MiB
ls -la .whl
