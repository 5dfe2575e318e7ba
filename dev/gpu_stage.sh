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
pip download -q --no-deps -d .whl/wheels \
  "transformers==$(python -c 'import transformers; print(transformers.__version__)')" \
  "huggingface_hub==$(python -c 'import huggingface_hub; print(huggingface_hub.__version__)')" \
  "tokenizers==$(python -c 'import tokenizers; print(tokenizers.__version__)')" \
  "safetensors==$(python -c 'import safetensors; print(safetensors.__version__)')"
tar -cf .whl/wheels.tar -C .whl wheels && rm -rf .whl/wheels
split -b 7M .whl/wheels.tar .whl/part- && rm .whl/wheels.tar
ls -la .whl
