"""CPU decode attention in C, built on first use with the system C compiler.

On CPUs the torch path must gather every request's K/V into a temporary before attending,
which costs more memory traffic than the attention itself; the C kernel reads the pool in
place. The shared library is compiled once per machine into a cache folder (seconds) and
loaded with ctypes; when no compiler is available the caller falls back to torch.
The kernel's OpenMP loop runs on torch's own libgomp thread pool (one OpenMP runtime in
the process), so it uses torch's thread count and never competes with torch's threads.
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

import torch

logger = logging.getLogger("spruce")

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
HEADER = Path(__file__).with_name("cpu_decode_attention_impl.h")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
_library: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    root = os.environ.get("SPRUCE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "spruce")
    return Path(root) / "kernels"


def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + HEADER.read_bytes() + " ".join(FLAGS).encode() + platform.machine().encode())
    return cache_dir() / f"cpu_decode_attention_{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc / gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: build, then rename
        out = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], check=True, capture_output=True)
        os.replace(out, target)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (logged once) when it cannot be built here."""
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
        logger.warning("CPU attention kernel unavailable (%s %s); using the torch path", e, detail.decode()[:200])
        return None
    for fn in (lib.spruce_decode_attention_f32, lib.spruce_decode_attention_f16):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float]
    _library = lib
    return lib


class CpuDecodeAttention:
    """decode(q, k_cache, v_cache, table, rows, seq_lens) -> out: q float32, the caches
    float32 or float16 (half the memory traffic), all CPU tensors."""

    def __init__(self) -> None:
        self.lib = load_library()

    @property
    def available(self) -> bool:
        return self.lib is not None

    def __call__(self, q, k_cache, v_cache, table, rows, seq_lens, scale: float) -> torch.Tensor:
        assert q.dtype == torch.float32 and table.dtype == torch.int32
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.float16)
        q = q.contiguous()
        rows, seq_lens = rows.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        batch, heads, dim = q.shape
        args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), table.stride(0),
                rows.data_ptr(), seq_lens.data_ptr(), out.data_ptr())  # fmt: skip
        shape = (heads, k_cache.shape[1], dim, scale)
        fn = self.lib.spruce_decode_attention_f16 if k_cache.dtype == torch.float16 else self.lib.spruce_decode_attention_f32
        if fn(*args, 0, batch, *shape):
            raise ValueError(f"CPU attention kernel: unsupported shape (heads {heads}, head_dim {dim})")
        return out
