"""The C side of the automaton (automaton.c: the lazy DFA and the token-trie walk of a mask),
built on first use with the system C compiler and loaded with ctypes.

The library is built once per machine into a cache folder (`$SPRUCE_CACHE_DIR/kernels`, else
`~/.cache/spruce/kernels`), named by a hash of what goes into it (source, flags, compiler,
architecture), in a temporary folder there and renamed into place, so concurrent builders
never see half a file. Plain portable C, nothing tuned to the building CPU. When it cannot be
built or loaded (no compiler), one warning is logged and the Python path is used; the
environment variable SPRUCE_AUTOMATON=python selects that path too (the tests compare both).
(constrained/ does not import spruce.runtime, so this builder is its own, small one.)"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("spruce")

SOURCE = Path(__file__).with_name("automaton.c")
FLAGS = ["-O2", "-shared", "-fPIC"]
ERR_LIMIT = -3  # automaton.c: more new states than the caller's bound
ERR_MEMORY = -4  # automaton.c: an allocation past the memory limit (or malloc failed)
ERR_STATE = -5  # automaton.c: a state the DFA does not have

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
SIGNATURES = {  # name: (result, arguments)
    # num_nfa, num_edges, num_eps, start, final, edge_at, edge_low, edge_high, edge_to, eps_at, eps_to, mem_limit,
    # need (out)
    "spruce_dfa_new": (_P, [_I32] * 5 + [_P] * 6 + [_I64, _P]),
    "spruce_dfa_free": (None, [_P]),
    "spruce_dfa_allocated": (_I64, [_P]),
    "spruce_dfa_needed": (_I64, [_P]),
    "spruce_dfa_num_states": (_I32, [_P]),
    "spruce_dfa_is_accepting": (_I32, [_P, _I32]),
    "spruce_dfa_copy_row": (_I32, [_P, _I32, _P]),  # dfa, state, out
    "spruce_dfa_ensure_rows": (
        _I32,
        [_P, _P, _I64, _I64, _I64],
    ),  # dfa, states, count, limit, mem_limit
    "spruce_dfa_walk": (
        _I32,
        [_P, _I32, ctypes.c_char_p, _I64, _I64],
    ),  # dfa, state, data, len, mem_limit
    "spruce_dfa_forced": (_I64, [_P, _I32, _P, _I64, _I64]),  # dfa, state, out, max, mem_limit
    # dfa, state, limit, child_start, child_count, byte, num_nodes, token_node, node_token_at, node_tokens,
    # num_tokens, out, mem_limit
    "spruce_dfa_mask": (_I32, [_P, _I32, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64]),
}

_library: ctypes.CDLL | None = None
_tried = False
_load_lock = threading.Lock()


def cache_dir() -> Path:
    root = os.environ.get("SPRUCE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "spruce"
    )
    return Path(root) / "kernels"


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(compiler: str) -> Path:
    """Named by the source, the flags, the compiler and the architecture."""
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(repr((FLAGS, compiler, platform.machine())).encode())
    return cache_dir() / f"spruce_automaton_{key.hexdigest()[:16]}.so"


def build(target: Path, compiler: str) -> None:
    """Compiles the library into `target`: in a temporary folder beside it, then renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the automaton's C library (once per machine) into %s", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(out)], check=True, capture_output=True
        )
        os.replace(out, target)


def _load() -> ctypes.CDLL:
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc / gcc) found")
    path = library_path(compiler)
    if not path.exists():
        build(path, compiler)
    lib = ctypes.CDLL(str(path))
    for name, (result, arguments) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = result, arguments
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library, or None: SPRUCE_AUTOMATON=python, or it could not be built or
    loaded here (logged once)."""
    global _library, _tried
    if os.environ.get("SPRUCE_AUTOMATON") == "python":
        return None
    if not _tried:
        with _load_lock:
            if not _tried:
                try:
                    _library = _load()
                except (OSError, subprocess.CalledProcessError, AttributeError) as e:
                    detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[:200]
                    logger.warning(
                        "the automaton's C library is unavailable (%s %s); using the Python path",
                        e,
                        detail,
                    )
                _tried = True
    return _library


def reset() -> None:
    """Forgets the loaded library, so the next `library()` builds or loads it again (tests)."""
    global _library, _tried
    with _load_lock:
        _library, _tried = None, False
