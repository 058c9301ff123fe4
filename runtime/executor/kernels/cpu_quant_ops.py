"""Linear layers on quantized weights on the CPU (runtime/kernels/cpu_quant_ops.c,
cpu_kquant_ops.c, cpu_quant_igemm.c and cpu_quant_gemm.c).

Weights stay in llama.cpp's block formats (`QUANT_TYPES`: blocks of 32 values, or
super-blocks of 256 for the K formats), as uint8 tensors of shape [n, k / block_size *
block_bytes]. `kernel` picks one of three for the row count (`linear` calls it):
  integer  up to `integer_max_rows` activation rows (decode, small batches: 8 to 12, by
           instruction set and format), quantized to 16-bit blocks, meet each weight row
           in integer dot products, the weights read from memory once;
  igemm    more rows of a 32-value format on a CPU with AVX-512 VNNI or AVX2: the same
           quantized activations and integer products, the vector lanes activation rows
           (`integer_gemm_linear`);
  gemm     more rows otherwise: a float32 GEMM that dequantizes the weights as it packs
           them (`gemm_linear`; its activations stay float).

The instruction set (`ISAS`) is chosen at run time: the best this CPU runs, capped by the
float kernels' variant (SPRUCE_CPU_ISA at start, `cpu_library.use_isa` later: portable caps
it at scalar, avx2 at AVX2), unless the caller forces one (the tests run every available one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.runtime.executor.kernels.cpu_library import FLOAT_ISAS, current_isa, load_library

BLOCK = 32


@dataclass(frozen=True, slots=True)
class QuantType:
    name: str
    ggml_id: int  # the ggml type id: the C kernels and GGUF files use it
    block_bytes: int
    block_size: int = BLOCK  # values per block


QUANT_TYPES = {
    "q8_0": QuantType("q8_0", 8, 34),
    "q4_0": QuantType("q4_0", 2, 18),
    "q4_1": QuantType("q4_1", 3, 20),
    "q4_k": QuantType("q4_k", 12, 144, 256),
    "q5_k": QuantType("q5_k", 13, 176, 256),
    "q6_k": QuantType("q6_k", 14, 210, 256),
}
ISAS = ("scalar", "avx2", "avx512vnni")  # index = the C kernels' ISA number
# Up to this many activation rows the integer kernel beats the next one (`kernel`), per
# instruction set: past it the next kernel, which shares more of its per-block work between
# rows, wins. The K formats have no tiled integer path (one weight row at a time), so the
# GEMM wins there at fewer rows.
INTEGER_MAX_ROWS = {"scalar": 8, "avx2": 12, "avx512vnni": 10}
K_INTEGER_MAX_ROWS = 8
# The integer GEMM's instruction sets: vpmaddwd + vpaddd on 256-bit vectors, vpdpwssd on
# 512-bit ones. It takes over where the integer kernel stops (INTEGER_MAX_ROWS) and stays
# ahead of the float GEMM at decode batch sizes, so it needs no row limit of its own.
IGEMM_ISAS = ("avx2", "avx512vnni")

_cpu_best: int | None = None  # this CPU's best, uncapped (asked once)


def available() -> bool:
    return load_library() is not None


def best_isa() -> str:
    """The fastest instruction set of this CPU the kernels have a variant for."""
    return ISAS[_best_index()]


def _best_index() -> int:
    """This CPU's best, capped by the float kernels' bound variant (portable: scalar, avx2: AVX2)."""
    return min(_cpu_best_index(), FLOAT_ISAS.index(current_isa()))


def _cpu_best_index() -> int:
    global _cpu_best
    if _cpu_best is None:
        _cpu_best = int(load_library().spruce_quant_best_isa())
    return _cpu_best


def available_isas() -> list[str]:
    """Every variant this CPU can run (the portable one included), whichever is bound."""
    return list(ISAS[: _cpu_best_index() + 1]) if available() else []


def row_bytes(qtype: str, k: int) -> int:
    kind = QUANT_TYPES[qtype]
    assert k % kind.block_size == 0, (
        f"{qtype} rows hold multiples of {kind.block_size} values, not {k}"
    )
    return k // kind.block_size * kind.block_bytes


def quantize_activations(
    x: torch.Tensor, isa: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, k] float32 -> (qx int16 [rows, k], dx [rows, k / 32], sx [rows, k / 32]):
    per block of 32, dx = max|x| / 32767, qx = round(x / dx) (ties to even), sx = sum(qx)."""
    x = x.contiguous()
    rows, k = x.shape
    qx = torch.empty(rows, k, dtype=torch.int16)
    dx, sx = torch.empty(rows, k // BLOCK), torch.empty(rows, k // BLOCK)
    load_library().spruce_quantize_rows_q16(
        x.data_ptr(), rows, k, qx.data_ptr(), dx.data_ptr(), sx.data_ptr(),
        ISAS.index(isa or best_isa()),
    )  # fmt: skip
    return qx, dx, sx


def linear(
    x: torch.Tensor,
    qtype: str,
    blocks: torch.Tensor,
    bias: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """x [rows, k] float32 @ W.T (+ bias), W given as `blocks` of `qtype`, [n, row_bytes]."""
    chosen = kernel(qtype, x.shape[0], isa)
    if chosen == "integer":
        return integer_linear(x, qtype, blocks, bias, isa)
    if chosen == "igemm":
        return integer_gemm_linear(x, qtype, blocks, bias, isa)
    return gemm_linear(x, qtype, blocks, bias)


def kernel(qtype: str, rows: int, isa: str | None = None) -> str:
    """The kernel `linear` takes for `rows` activation rows of `qtype` on `isa` (by default
    the best one allowed here): "integer", "igemm" or "gemm" (the module docstring)."""
    isa = isa or best_isa()
    if rows <= integer_max_rows(qtype, isa):
        return "integer"
    return "igemm" if igemm_runs(qtype, isa) else "gemm"


def igemm_runs(qtype: str, isa: str | None = None) -> bool:
    """Whether the integer GEMM runs `qtype` on `isa` (default: the best allowed here)."""
    return (isa or best_isa()) in IGEMM_ISAS and QUANT_TYPES[qtype].block_size == BLOCK


def integer_max_rows(qtype: str, isa: str | None = None) -> int:
    """Up to how many activation rows `linear` takes the integer kernel for `qtype`."""
    if QUANT_TYPES[qtype].block_size != BLOCK:
        return K_INTEGER_MAX_ROWS
    return INTEGER_MAX_ROWS[isa or best_isa()]


def integer_linear(
    x: torch.Tensor,
    qtype: str,
    blocks: torch.Tensor,
    bias: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """`linear` through the integer kernel (any number of rows): one C call quantizes the
    activations and meets the weights."""
    isa_index = ISAS.index(isa) if isa else _best_index()
    return _call_linear(load_library().spruce_quant_linear, x, qtype, blocks, bias, isa_index)


def integer_gemm_linear(
    x: torch.Tensor,
    qtype: str,
    blocks: torch.Tensor,
    bias: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """`linear` through the integer GEMM (cpu_quant_igemm.c: the integer kernel's quantized
    activations and products, the vector lanes activation rows) on `isa` (default: the best
    allowed here); needs AVX2 or AVX-512 VNNI and a 32-value format."""
    isa_index = ISAS.index(isa) if isa else _best_index()
    return _call_linear(load_library().spruce_quant_igemm, x, qtype, blocks, bias, isa_index)


def gemm_linear(
    x: torch.Tensor, qtype: str, blocks: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear` through the float32 GEMM that dequantizes the weights as it packs them
    (cpu_quant_gemm.c; the activations stay float: no quantization error from them)."""
    return _call_linear(load_library().spruce_quant_gemm, x, qtype, blocks, bias)


def _call_linear(
    kernel, x: torch.Tensor, qtype: str, blocks: torch.Tensor, bias: torch.Tensor | None, *extra
) -> torch.Tensor:
    """y = kernel(type, blocks, n, k, x, rows, bias, y, *extra); a nonzero return means the
    kernel could not allocate its work buffers (1) or does not run here (2)."""
    x = x.contiguous()
    rows, k = x.shape
    n = blocks.shape[0]
    assert (
        blocks.dtype == torch.uint8
        and blocks.is_contiguous()
        and blocks.shape[1] == row_bytes(qtype, k)
    )
    y = torch.empty(rows, n)
    bias_ptr = None if bias is None else bias.contiguous().data_ptr()
    type_id = QUANT_TYPES[qtype].ggml_id
    failed = kernel(
        type_id, blocks.data_ptr(), n, k, x.data_ptr(), rows, bias_ptr, y.data_ptr(), *extra
    )
    if failed == 2:
        raise ValueError(
            f"the integer GEMM needs AVX2 or AVX-512 VNNI and a 32-value format, not {qtype}"
        )
    if failed:
        raise MemoryError(
            f"no memory for the work buffers of a {rows} x {k} quantized linear layer"
        )
    return y


def int64(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int64, without a torch call where it is already: at batch-1 decode
    each call runs from caches the weights have just swept, so it is slow."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def dequantize(
    qtype: str, blocks: torch.Tensor, k: int, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The weight rows `ids` (all rows when None) as float32 [len(ids), k]."""
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    ids_ptr, count = None, blocks.shape[0]
    if ids is not None:
        ids = int64(ids)
        ids_ptr, count = ids.data_ptr(), ids.numel()
    out = torch.empty(count, k)
    type_id = QUANT_TYPES[qtype].ggml_id
    load_library().spruce_dequantize_rows(
        type_id, blocks.data_ptr(), k, ids_ptr, count, out.data_ptr()
    )
    return out
