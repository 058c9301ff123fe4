"""Writes a random-weight model with SmolLM2-135M-Instruct's exact shape and tokenizer
(the real weights are too large to send to the GPU machine)."""

import json
import shutil
import sys

import torch
import transformers

out = sys.argv[1]
here = sys.argv[2]
config = json.load(open(f"{here}/config.json"))
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0, 0.02)
model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{here}/{name}", f"{out}/{name}")
json.dump(config, open(f"{out}/config.json", "w"))
print("model written", out)
