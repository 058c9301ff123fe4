"""Random-weight GGUF files of real model shapes, written once into a cache folder.

`spruce bench shapes --model-shape 1b --quant Q4_K` writes the file if it is missing and
prints its path; `spruce bench offline --model-shape ...` runs on it. Shapes (`SHAPES`):
`1b` (Llama-3.2-1B: tied embeddings), `8b` (Llama-3.1-8B: untied output head) and `tiny`
(2 layers, for tests); the llama3 rope scaling is left out (rope theta 500000 alone).
Formats (`QUANTS`): Q4_0, Q8_0 and Q6_K put every linear layer and the embedding table in
that format; Q4_K is laid out like llama.cpp's Q4_K_M: Q6_K for the output head (the
embedding table when tied) and for attn_v and ffn_down in llama.cpp's "more bits" layers,
Q4_K elsewhere; F32 stays float (for llama-quantize). Norms are F32 ones.

Weights are normal with std 0.02, made and quantized a few rows at a time (our quantizers
without the K formats' scale search: `quantize_rows(search=False)`) and streamed into the
gguf package's writer, so an 8B file never sits in memory as floats. The tokenizer is the
bundled SmolLM2 model's, its token list padded to the shape's vocabulary with UNUSED
placeholder tokens, so the file loads in Spruce and in llama.cpp alike. A file is written
under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spruce.runtime.executor.kernels.cpu_quant_ops import row_bytes
from spruce.runtime.models.loading.quantize import quantize_rows

USES_ENGINE = False
FORMAT = 1  # in the file names: a change to what is written gets new files
STD = 0.02
CHUNK_VALUES = 1 << 22  # float values made at a time
UNUSED_TOKEN = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0
    context: int = 131072

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "tiny": Shape(256, 2, 4, 2, 512, 49152 + 256, tied=True, rope_theta=10000.0, context=8192),
    "1b": Shape(2048, 16, 32, 8, 8192, 128256, tied=True),
    "8b": Shape(4096, 32, 32, 8, 14336, 128256, tied=False),
}
QUANTS = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "F32")
FILE_TYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K": 15, "Q6_K": 18, "F32": 0}  # llama_ftype (Q4_K_M)


def add_shape_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--model-shape", choices=list(SHAPES), required=required,
        help="random weights in a real model's shape (written once into the cache)")  # fmt: skip
    parser.add_argument("--quant", type=str.upper, choices=QUANTS, default="Q4_0",
        help="--model-shape's weight format (Q4_K: Q4_K_M-like)")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, required=True)


def run(args: argparse.Namespace, engine_options: dict) -> int:
    print(model_file(args.model_shape, args.quant))
    return 0


def models_dir() -> Path:
    root = os.environ.get("SPRUCE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "spruce"
    )
    return Path(root) / "models"


def model_file(shape: str, quant: str, folder: Path | None = None) -> str:
    """The path of the `shape` / `quant` file, written first if it is missing."""
    path = (folder or models_dir()) / f"random-llama-{shape}-{quant}-v{FORMAT}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            write_model(shape, quant, temporary)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        print(f"wrote {path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return str(path)


def tensor_plan(shape: Shape, quant: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, torch-order dims, ggml type) of every tensor, in file order."""
    kv = shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        plan += [
            (f"blk.{i}.attn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.attn_k.weight", (kv, shape.hidden)),
            (f"blk.{i}.attn_v.weight", (kv, shape.hidden)),
            (f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden)),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden)),
            (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate)),
        ]
    plan.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, shape.hidden)))
    return [(name, dims, tensor_type(name, dims, quant, shape)) for name, dims in plan]


def tensor_type(name: str, dims: tuple[int, ...], quant: str, shape: Shape) -> str:
    if len(dims) == 1 or quant != "Q4_K":
        return "F32" if len(dims) == 1 else quant
    head = name == "output.weight" or (name == "token_embd.weight" and shape.tied)
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    more_bits = name.endswith(("attn_v.weight", "ffn_down.weight")) and _more_bits(
        layer, shape.layers
    )
    return "Q6_K" if head or more_bits else "Q4_K"


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def write_model(name: str, quant: str, path: Path, seed: int = 0) -> None:
    import gguf

    shape = SHAPES[name]
    plan = tensor_plan(shape, quant)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random-weight llama, {name} shape")
    _add_metadata(writer, shape, quant)
    for name, dims, kind in plan:
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            size = (dims[0], row_bytes(kind.lower(), dims[1]))
            raw = gguf.GGMLQuantizationType[kind]
            writer.add_tensor_info(name, size, np.dtype(np.uint8), size[0] * size[1], raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, kind in plan:
        writer.write_tensor_data(_tensor_data(rng, dims, kind))
    writer.close()


def _tensor_data(rng: np.random.Generator, dims: tuple[int, ...], kind: str) -> np.ndarray:
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    rows, cols = dims
    width = cols if kind == "F32" else row_bytes(kind.lower(), cols)
    out = np.empty((rows, width), dtype=np.float32 if kind == "F32" else np.uint8)
    step = max(1, CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        values = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        values *= np.float32(STD)
        quantized = values if kind == "F32" else quantize_rows(values, kind.lower(), search=False)
        out[start : start + step] = quantized
    return out


def _add_metadata(writer, shape: Shape, quant: str) -> None:
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(FILE_TYPES[quant])
    writer.add_quantization_version(2)
    for key, value in tokenizer_metadata(shape.vocab).items():
        _add_value(writer, key, value)


def tokenizer_metadata(vocab: int) -> dict:
    """The bundled model's tokenizer.* metadata, its tokens padded to `vocab` with UNUSED
    placeholders."""
    from spruce.runtime.models.loading.files import default_model_path
    from spruce.runtime.models.loading.gguf import read_gguf

    meta = read_gguf(default_model_path()).metadata
    fields = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = [int(t) for t in fields["tokenizer.ggml.token_type"]]
    assert vocab >= len(tokens), f"a vocabulary of {vocab} cannot hold {len(tokens)} tokens"
    padding = range(len(tokens), vocab)
    fields["tokenizer.ggml.tokens"] = tokens + [f"<|placeholder_{i}|>" for i in padding]
    fields["tokenizer.ggml.token_type"] = types + [UNUSED_TOKEN] * len(padding)
    return fields


def _add_value(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        writer.add_uint32(key, int(value))
    elif isinstance(value, (float, np.floating)):
        writer.add_float32(key, float(value))
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))
