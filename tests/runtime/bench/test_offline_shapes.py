"""`spruce bench offline --compare llama.cpp --model-shape ...` end to end on the tiny shape,
against stand-in llama.cpp tools (test_llama_cpp.py's): the file is written into the cache
and both engines run on it, the 4096-token-context row and the bandwidth share are printed;
and the weight bytes a decode step reads, tied and untied."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from support import bundled_gguf_path
from test_llama_cpp import BATCHED, BENCH, DEPTH_ROW, bench_tool, tool

from spruce.runtime.bench import bandwidth, offline
from spruce.runtime.bench.bandwidth import decode_bytes_per_token
from spruce.runtime.bench.shapes import model_file
from spruce.runtime.cli import main


@pytest.mark.slow
@pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled model is not installed")
def test_compare_on_a_model_shape(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPRUCE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bandwidth, "BUFFER_GIB", 1 / 64)
    # the rows test_llama_cpp.py covers, fixed here; the 4096-token row runs, 8 steps long
    ours = {"tg128_t1": 20.0, "tg128": 35.0, "pp512": 95.0, "tg128_one_step": 30.0}
    monkeypatch.setattr(offline, "spruce_singles", lambda engine, tokenizer, threads, reps: ours)
    parallel = {"decode_16": 75.0, "end_to_end_16": 60.0, "decode_64": 150.0, "end_to_end_64": 9.0}
    monkeypatch.setattr(offline, "spruce_parallel", lambda engine, tokenizer, counts: parallel)
    monkeypatch.setattr(offline, "DECODE_STEPS", 8)
    bins = tmp_path / "bin"
    bins.mkdir()
    bench_tool(bins)
    tool(bins, "llama-batched-bench", "\n".join(json.dumps(r) for r in BATCHED))
    report = tmp_path / "report.json"
    flags = ["--model-shape", "tiny", "--quant", "Q4_K", "--compare", "llama.cpp",
             "--llama-cpp-bin", str(bins), "--num-prompts", "2", "--input-len-min", "8",
             "--input-len-max", "8", "--output-len", "4", "--compare-rounds", "1",
             "--skip-single", "--num-threads", "2", "--output-json", str(report)]  # fmt: skip
    assert main(["bench", "offline", *flags]) == 0
    path = model_file("tiny", "Q4_K")
    calls = (bins / "llama-bench.args").read_text().splitlines()
    assert len(calls) == 3 and all(f"-m {path} " in call for call in calls)
    assert "-d 4096" in calls[-1]

    compared = json.loads(report.read_text())["llama_cpp"]
    assert compared["llama.cpp"]["tg128_d4096"] == DEPTH_ROW["avg_ts"]
    assert compared["spruce"]["tg128_d4096"] > 0
    shares, per_token = compared["bandwidth"]["share"], decode_bytes_per_token(path)
    assert compared["bandwidth"]["weight_bytes_per_token"] == per_token
    tg128 = next(r["avg_ts"] for r in BENCH if r["n_gen"] and r["n_threads"] == 2)
    speed = compared["bandwidth"]["bytes_per_s"]
    assert shares["llama.cpp"] == pytest.approx(per_token * tg128 / speed)
    assert shares["Spruce"] == pytest.approx(per_token * ours["tg128"] / speed)
    printed = capsys.readouterr().out
    assert "| batch-1 decode (tg128), 2 threads | 70.0 | 35.0 | 0.50x |" in printed
    assert (
        "| batch-1 decode after a 4096-token prompt (tg128 @ d4096), 2 threads | 33.0 |" in printed
    )
    assert "of the bandwidth" in printed

    assert main(["bench", "offline", "--model", path, *flags]) == 2  # one model, not two

    # an 8B run in minutes: no batched rows, no 4096-token row
    for name in ("llama-batched-bench", "llama-bench"):
        (bins / f"{name}.args").unlink()
    quick = ["--compare-parallel", "", "--no-compare-depth"]
    assert main(["bench", "offline", *flags, *quick]) == 0
    assert not (bins / "llama-batched-bench.args").exists()
    assert "-d 4096" not in (bins / "llama-bench.args").read_text()
    compared = json.loads(report.read_text())["llama_cpp"]
    assert "tg128_d4096" not in compared["spruce"] and "decode_16" not in compared["llama.cpp"]


def test_decode_reads_every_weight_but_an_untied_embedding_table(monkeypatch):
    def fake_file(names: dict[str, int]):
        tensors = {name: SimpleNamespace(nbytes=size) for name, size in names.items()}
        return lambda path: SimpleNamespace(tensors=tensors)

    from spruce.runtime.models.loading import gguf

    tied = {"token_embd.weight": 1000, "blk.0.attn_q.weight": 30, "output_norm.weight": 4}
    monkeypatch.setattr(gguf, "read_gguf", fake_file(tied))
    assert decode_bytes_per_token("m.gguf") == 1034  # the table is the output head
    monkeypatch.setattr(gguf, "read_gguf", fake_file(tied | {"output.weight": 900}))
    assert decode_bytes_per_token("m.gguf") == 934
