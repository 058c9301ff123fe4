"""The llama.cpp side of `spruce bench offline --compare llama.cpp`, against stand-in tools
that print what llama-bench / llama-batched-bench print: each thread count's tg128 row is
read, pp512 at the largest, and --llama-cpp-args reach both tools."""

from __future__ import annotations

import json
import stat
import sys

from spruce.runtime.bench.llama_cpp import llama_cpp_tools, run_llama_cpp, table_rows

BENCH = [
    {"n_prompt": 512, "n_gen": 0, "n_threads": 1, "avg_ts": 100.0},
    {"n_prompt": 0, "n_gen": 128, "n_threads": 1, "avg_ts": 40.0},
    {"n_prompt": 512, "n_gen": 0, "n_threads": 2, "avg_ts": 190.0},
    {"n_prompt": 0, "n_gen": 128, "n_threads": 2, "avg_ts": 70.0},
]
BATCHED = [
    {"pl": 16, "tg": 128, "t": 20.0, "speed_tg": 150.0},
    {"pl": 64, "tg": 128, "t": 60.0, "speed_tg": 300.0},
]


def tool(folder, name: str, output: str) -> None:
    """A script that records its arguments and prints `output`."""
    path = folder / name
    log = folder / f"{name}.args"
    path.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(log)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        f"print({output!r})\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_thread_rows_and_extra_arguments(tmp_path):
    tool(tmp_path, "llama-bench", json.dumps(BENCH))
    tool(tmp_path, "llama-batched-bench", "\n".join(json.dumps(r) for r in BATCHED))
    tools = llama_cpp_tools(str(tmp_path))
    out = run_llama_cpp(tools, "m.gguf", [1, 2], "-nr 1")
    assert out["tg128_t1"] == 40.0 and out["tg128_t2"] == out["tg128"] == 70.0
    assert out["pp512"] == 190.0 and out["decode_64"] == 300.0
    assert out["end_to_end_16"] == 16 * 128 / 20.0
    bench_args = (tmp_path / "llama-bench.args").read_text().split()
    assert bench_args[bench_args.index("-t") + 1] == "1,2" and bench_args[-2:] == ["-nr", "1"]
    assert (tmp_path / "llama-batched-bench.args").read_text().endswith("-nr 1")
    assert {key for key, _ in table_rows(2)} <= set(out)
    assert llama_cpp_tools(str(tmp_path / "none")) is None
