"""The CPU kernels in C (decode attention, per-layer operations), built on first use with
the system C compiler.

The sources are compiled together into one shared library, once per machine, into a
cache folder (seconds), and loaded with ctypes; when no compiler is available the callers
fall back to torch. The kernels' OpenMP loops run on torch's own libgomp thread pool (one
OpenMP runtime in the process), so they use torch's thread count and never compete with
torch's threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("spruce")

_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_decode_attention.c", _HERE / "cpu_layer_ops.c", _HERE / "cpu_quant_ops.c"]
HEADERS = [_HERE / "cpu_decode_attention_impl.h", _HERE / "cpu_vector.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    # q, q_stride, k_new, v_new, new_stride, new_slots, k_cache, v_cache, table, table_stride,
    # rows, seq_lens, out, batch, heads, kv_heads, dim, scale, window (0: none)
    "spruce_decode_attention_f32": [_P, _I64, _P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P]
    + [_I64] * 4
    + [_F32, _I64],
    "spruce_rms_norm": [_P, _P, _P, _P, _I64, _I64, _F32],  # x, residual, weight, out, rows, dim, eps
    "spruce_silu_mul": [_P, _P, _I64, _I64],  # gate_up, out, rows, inter
    "spruce_rotary": [_P, _I64, _I64, _I64, _I64, _P, _P, _P],  # x, row_stride, rows, heads, dim, pos, cos, sin
    "spruce_gemv": [_P, _I64, _I64, _P, _P, _I64, _P],  # x, rows, k, weight, bias, n, y
    "spruce_quantize_rows_q16": [_P, _I64, _I64, _P, _P, _P],  # x, rows, k, qx, dx, sx
    # type, blocks, n, k, qx, dx, sx, rows, bias, y, y_stride, isa
    "spruce_quant_gemv": [_I64, _P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64],
    "spruce_dequantize_rows": [_I64, _P, _I64, _P, _I64, _P],  # type, blocks, k, ids, count, out
    "spruce_quant_best_isa": [],
}
SIGNATURES["spruce_decode_attention_f16"] = SIGNATURES["spruce_decode_attention_f32"]

_RESULT_TYPES = {  # the rest return nothing
    "spruce_decode_attention_f32": ctypes.c_int,
    "spruce_decode_attention_f16": ctypes.c_int,
    "spruce_quant_best_isa": _I64,
}

_library: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    root = os.environ.get("SPRUCE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "spruce")
    return Path(root) / "kernels"


def _library_path() -> Path:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS))
    key.update((" ".join(FLAGS) + platform.machine()).encode())
    return cache_dir() / f"spruce_cpu_kernels_{key.hexdigest()[:16]}.so"


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(target: Path) -> None:
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc / gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the CPU kernels (once per machine) into %s", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: build, then rename
        out = Path(tmp) / target.name
        command = [compiler, *FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
        os.replace(out, target)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) when they cannot be built here."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    path = _library_path()
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("CPU kernels unavailable (%s %s); using the torch path", e, detail.decode()[:200])
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _RESULT_TYPES.get(name)
    _library = lib
    return lib
