"""The CPU kernels in C (decode attention, per-layer operations, quantized linear layers),
built on first use with the system C compiler.

The sources are compiled into one shared library, once per machine, into a cache folder
(seconds), and loaded with ctypes; when no compiler is available the callers fall back to
torch. The kernels' OpenMP loops run on torch's own libgomp thread pool (one OpenMP
runtime in the process), so they use torch's thread count and never compete with torch's
threads.

One build runs on any CPU of its architecture: nothing is compiled for the build machine's
own instruction set (no -march=native). Only the instruction scheduling is tuned for the
building CPU (-mtune=native: same instructions, other order and choices), which makes the
decode step faster than -mtune=generic does.

The float kernels (`PER_ISA_SOURCES`) are compiled once per instruction set in `FLOAT_ISAS`
into differently named functions (`spruce_rms_norm_avx2`, ...); at load, each plain name
(`spruce_rms_norm`) is bound to the best variant this CPU runs (cpu_features.c), or to the
one `SPRUCE_CPU_ISA` names, and `use_isa` rebinds them (the tests run every variant). The
quantized kernels carry their own per-ISA functions (target attributes) and take the ISA as
an argument, by default the best one the bound float variant allows (cpu_quant_ops), so
`use_isa` and SPRUCE_CPU_ISA (portable, avx2, avx512) switch both kinds.
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
PER_ISA_SOURCES = [
    _HERE / "cpu_decode_attention.c",
    _HERE / "cpu_prefill_attention.c",
    _HERE / "cpu_layer_ops.c",
]
PER_ISA_SOURCES += [_HERE / "cpu_quant_gemm.c", _HERE / "cpu_decode_step.c"]
ONCE_SOURCES = [_HERE / "cpu_quant_ops.c", _HERE / "cpu_kquant_ops.c", _HERE / "cpu_features.c"]
ONCE_SOURCES += [_HERE / "cpu_quant_igemm.c"]
HEADERS = [
    _HERE / "cpu_decode_attention_impl.h",
    _HERE / "cpu_vector.h",
    _HERE / "cpu_register_vector.h",
]
HEADERS += [_HERE / "cpu_quant.h", _HERE / "cpu_parallel.h"]
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fPIC", "-Wno-psabi"]
FLOAT_ISAS = ("portable", "avx2", "avx512")  # index = spruce_float_best_isa()
_X86_FLAGS = {
    "portable": ["-march=x86-64", "-mtune=native", "-DSPRUCE_GENERIC_SHAPES"],
    "avx2": ["-march=x86-64", "-mtune=native", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-march=x86-64", "-mtune=native", "-mavx2", "-mfma", "-mf16c"]
    + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# other CPUs: one variant, the compiler's baseline (with every shape specialized, as before)
ISA_FLAGS = _X86_FLAGS if _X86 else {"portable": []}

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# fmt: off
SIGNATURES = {
    # q, q_stride, k_new, v_new, new_stride, new_slots, k_cache, v_cache, k_scale, v_scale, table, table_stride,
    # rows, seq_lens, out, batch, heads, kv_heads, dim, scale, window (0: none)
    "spruce_decode_attention_f32": [_P, _I64, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _P]
    + [_I64] * 4
    + [_F32, _I64],
    # q, q_stride, k, v, kv_stride, out, length, prefix, heads, kv_heads, dim, scale, window (0: none)
    "spruce_prefill_attention": [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32, _I64],
    "spruce_rms_norm": [_P, _P, _P, _P, _I64, _I64, _F32],  # x, residual, weight, out, rows, dim, eps
    "spruce_silu_mul": [_P, _P, _I64, _I64],  # gate_up, out, rows, inter
    "spruce_rotary": [_P, _I64, _I64, _I64, _I64, _P, _P, _P],  # x, row_stride, rows, heads, dim, pos, cos, sin
    "spruce_gemv": [_P, _I64, _I64, _P, _P, _I64, _P],  # x, rows, k, weight, bias, n, y
    "spruce_argmax_rows": [_P, _I64, _I64, _P, _P],  # x, rows, n, ids, values
    "spruce_quantize_rows_q16": [_P, _I64, _I64, _P, _P, _P, _I64],  # x, rows, k, qx, dx, sx, isa
    # type, blocks, n, k, qx, dx, sx, rows, bias, y, y_stride, isa
    "spruce_quant_gemv": [_I64, _P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64],
    # type, blocks, n, k, x, rows, bias, y, isa
    "spruce_quant_linear": [_I64, _P, _I64, _I64, _P, _I64, _P, _P, _I64],
    # type, blocks, n, k, x, rows, bias, y
    "spruce_quant_gemm": [_I64, _P, _I64, _I64, _P, _I64, _P, _P],
    "spruce_quant_igemm": [_I64, _P, _I64, _I64, _P, _I64, _P, _P, _I64],  # the same, isa
    "spruce_dequantize_rows": [_I64, _P, _I64, _P, _I64, _P],  # type, blocks, k, ids, count, out
    "spruce_quant_best_isa": [],
    "spruce_float_best_isa": [],
    "spruce_decode_layers": [_P, _I64, _P],  # layers, count, step (decode_plan.StepLayer, StepArgs)
    # layers, count, step, steps, embedding type (-1: float32), table, ids, best
    "spruce_decode_steps": [_P, _I64, _P, _I64, _I64, _P, _P, _P],
    "spruce_step_layout": [_P],  # out: the step structs' sizes and field offsets
}
# fmt: on
SIGNATURES["spruce_decode_attention_f16"] = SIGNATURES["spruce_decode_attention_f32"]
SIGNATURES["spruce_decode_attention_i8"] = SIGNATURES["spruce_decode_attention_f32"]
# the float kernels: one function per instruction set, `<name>_<isa>`
PER_ISA_KERNELS = (
    "spruce_decode_attention_f32",
    "spruce_decode_attention_f16",
    "spruce_decode_attention_i8",
)
PER_ISA_KERNELS += ("spruce_prefill_attention", "spruce_rms_norm")
PER_ISA_KERNELS += ("spruce_silu_mul", "spruce_rotary", "spruce_gemv", "spruce_quant_gemm")
PER_ISA_KERNELS += ("spruce_decode_layers", "spruce_argmax_rows")
PER_ISA_KERNELS += ("spruce_decode_steps", "spruce_step_layout")

_RESULT_TYPES = {  # the rest return nothing
    "spruce_decode_attention_f32": ctypes.c_int,
    "spruce_decode_attention_f16": ctypes.c_int,
    "spruce_decode_attention_i8": ctypes.c_int,
    "spruce_prefill_attention": ctypes.c_int,
    "spruce_quant_best_isa": _I64,
    "spruce_float_best_isa": _I64,
    "spruce_quant_linear": ctypes.c_int,
    "spruce_quant_gemm": ctypes.c_int,
    "spruce_quant_igemm": ctypes.c_int,
    "spruce_decode_layers": ctypes.c_int,
    "spruce_decode_steps": ctypes.c_int,
    "spruce_step_layout": _I64,
}

_library: ctypes.CDLL | None = None
_tried = False
_isa: str | None = None  # the float kernels' variant the plain names are bound to


def cache_dir() -> Path:
    root = os.environ.get("SPRUCE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "spruce"
    )
    return Path(root) / "kernels"


def _library_path() -> Path:
    """Named by what goes into the build (sources, flags, per-ISA flags, the compiler and
    the architecture); never by the build machine's own instruction set."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in PER_ISA_SOURCES + ONCE_SOURCES + HEADERS))
    key.update(repr((FLAGS, ISA_FLAGS, c_compiler(), platform.machine())).encode())
    return cache_dir() / f"spruce_cpu_kernels_{key.hexdigest()[:16]}.so"


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_commands(compiler: str, folder: Path) -> list[list[str]]:
    """One object per (float source, instruction set), one per other source."""
    commands = []
    for isa, flags in ISA_FLAGS.items():
        for src in PER_ISA_SOURCES:
            obj = folder / f"{src.stem}.{isa}.o"
            define = f"-DSPRUCE_ISA={isa}"
            commands.append([compiler, *FLAGS, *flags, define, "-c", str(src), "-o", str(obj)])
    base = ISA_FLAGS["portable"]
    for src in ONCE_SOURCES:
        obj = folder / f"{src.stem}.o"
        commands.append([compiler, *FLAGS, *base, "-c", str(src), "-o", str(obj)])
    return commands


def _build(target: Path) -> None:
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc / gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the CPU kernels (once per machine) into %s", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: build, then rename
        folder = Path(tmp)
        commands = compile_commands(compiler, folder)
        pipe = subprocess.PIPE
        jobs = [subprocess.Popen(c, stdout=pipe, stderr=pipe) for c in commands]  # in parallel
        errors = [job.communicate()[1] for job in jobs]  # all finished before any error is raised
        for command, job, stderr in zip(commands, jobs, errors):
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, command, stderr=stderr)
        objects = [c[-1] for c in commands]
        out = folder / target.name
        link = [compiler, "-shared", "-fopenmp", *objects, "-o", str(out), "-lm"]
        subprocess.run(link, check=True, capture_output=True)
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
        logger.warning(
            "CPU kernels unavailable (%s %s); using the torch path", e, detail.decode()[:200]
        )
        return None
    for name, argtypes in SIGNATURES.items():
        names = [f"{name}_{isa}" for isa in ISA_FLAGS] if name in PER_ISA_KERNELS else [name]
        for symbol in names:
            fn = getattr(lib, symbol)
            fn.argtypes = argtypes
            fn.restype = _RESULT_TYPES.get(name)
    _library = lib
    use_isa(startup_isa())
    return lib


def available_isas() -> list[str]:
    """The float kernels' variants this CPU runs, portable first (none without the library)."""
    if load_library() is None:
        return []
    best = int(_library.spruce_float_best_isa())
    return [isa for isa in FLOAT_ISAS[: best + 1] if isa in ISA_FLAGS]


def startup_isa() -> str:
    """The variant bound at load: the best this CPU runs, or the one SPRUCE_CPU_ISA names."""
    best = available_isas()[-1]
    wanted = os.environ.get("SPRUCE_CPU_ISA")
    if wanted and wanted not in available_isas():
        here = available_isas()
        logger.warning(
            "SPRUCE_CPU_ISA=%s: not one this CPU runs (%s); using %s", wanted, here, best
        )
        wanted = None
    return wanted or best


def current_isa() -> str | None:
    """The variant the float kernels run (None without the library)."""
    load_library()
    return _isa


def use_isa(isa: str) -> str:
    """Binds the float kernels' plain names to variant `isa`; returns the previous one."""
    global _isa
    lib = load_library()
    assert lib is not None and isa in available_isas(), f"{isa!r} is not available here"
    for name in PER_ISA_KERNELS:
        setattr(lib, name, getattr(lib, f"{name}_{isa}"))
    previous, _isa = _isa, isa
    return previous or isa
