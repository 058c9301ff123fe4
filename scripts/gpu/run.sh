#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with .gpu/ (see prepare.sh) carried along;
# results and logs go to $OUT (or ./gpu-results when OUT is unset).
# One prepared GPU check: install, GPU tests, per-backend benchmark. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
python3 .gpu/make_model.py /tmp/smol .gpu 2>&1 | tail -1
timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/executor/test_triton_kernels.py tests/runtime/executor/test_attention_backends.py 2>&1 | tee $OUT/gpu_tests.log | tail -15
timeout 200 spruce bench gpu --skip-tests --model /tmp/smol --num-prompts ${NPROMPTS:-128} --output-len 128 --output-json $OUT/gpu_bench.json --log-level warning 2>&1 | tee $OUT/gpu_bench.log | tail -20
# speculative decoding on the GPU: drafts as decode rows sharing a request's row (triton), outputs
# identical with and without (the benchmark fails otherwise), and the speed-up where rows are cheap
timeout 120 spruce bench spec --model /tmp/smol --num-prompts 32 --batch1-prompts 4 --output-len 128 --output-json $OUT/spec.json 2>&1 | grep -v INFO | tee $OUT/spec.log | tail -8
