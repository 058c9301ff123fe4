#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for a GPU check on a machine that cannot download anything:
# wheels the GPU image lacks (the project's dependencies beyond its torch, triton, numpy, ...), and SmolLM2-135M's config + tokenizer taken from the bundled
# GGUF (the weights themselves are too large to send, so the check uses random weights of
# the same shape; throughput does not depend on the values).
# Usage, from the repository root, in the project's venv:  bash scripts/gpu/prepare.sh
set -euo pipefail
mkdir -p .gpu/whl
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "outlines-core==0.2.14" "interegular==0.3.3" "orjson==3.13.0" "pyzmq==27.3.0" \
    "google-re2==1.1.20251105" "llguidance==1.9.1" "pydantic==2.14.4" "pydantic-core==2.50.5" \
    "annotated-types==0.8.0" "typing-inspection==0.4.5" "jsonschema==4.26.0" \
    "jsonschema-specifications==2025.9.1" "referencing==0.37.0" "rpds-py==2026.9.1" \
    "fastapi==0.165.0" "starlette==1.10.0" "uvicorn==0.55.0"
cp scripts/gpu/make_model.py scripts/gpu/run.sh .gpu/
python - <<'PY'
import json

import torch

from spruce.runtime.models.loading.gguf import read_gguf
from spruce.runtime.models.loading.gguf_convert import gguf_to_hf
from spruce.runtime.models.loading.files import default_model_path
from spruce.runtime.text.tokenizer import Tokenizer

gguf = read_gguf(default_model_path())
config, _ = gguf_to_hf(gguf, torch.float32)
config["torch_dtype"] = "bfloat16"
json.dump(config, open(".gpu/config.json", "w"), indent=1)
tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
tokenizer.backend.save(".gpu/tokenizer.json")
json.dump({"eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token, "add_bos_token": False,
           "chat_template": tokenizer.chat_template}, open(".gpu/tokenizer_config.json", "w"))
print("prepared .gpu/ for bash .gpu/run.sh (carry .gpu)")
PY
