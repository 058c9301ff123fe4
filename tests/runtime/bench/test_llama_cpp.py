"""The llama.cpp side of `spruce bench offline --compare llama.cpp` and `spruce bench spec`,
against stand-in tools that print what llama-bench / llama-batched-bench print (each thread
count's tg128 row is read, pp512 at the largest, and --llama-cpp-args reach both tools) and
a stand-in llama-server that answers /completion with its timings."""

from __future__ import annotations

import argparse
import json
import socket
import stat
import sys
from types import SimpleNamespace

import pytest
import torch

from spruce.runtime.bench import alternating_rounds, llama_cpp, offline
from spruce.runtime.bench.llama_cpp import (
    llama_cpp_tools,
    llama_depth,
    llama_singles,
    run_llama_cpp,
    table_rows,
    tool_args,
)
from spruce.runtime.bench.offline import medians
from spruce.runtime.bench.spec import compare_llama_cpp, llama_cpp_servers

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


DEPTH_ROW = {"n_prompt": 0, "n_gen": 128, "n_depth": 4096, "n_threads": 2, "avg_ts": 33.0}


def bench_tool(folder) -> None:
    """A llama-bench that prints the rows of the test it is asked for (-p 512, -n 128 or -d
    4096); each call's arguments are appended to llama-bench.args, one line a call."""
    prefill = json.dumps([r for r in BENCH if r["n_prompt"]])
    decode = json.dumps([r for r in BENCH if r["n_gen"]])
    path = folder / "llama-bench"
    log = folder / "llama-bench.args"
    path.write_text(
        f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\n"
        f"open({str(log)!r}, 'a').write(' '.join(args) + '\\n')\n"
        f"if '-d' in args:\n    print({json.dumps([DEPTH_ROW])!r})\n"
        f"else:\n    print({prefill!r} if args[args.index('-p') + 1] == '512' else {decode!r})\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_thread_rows_and_extra_arguments(tmp_path):
    bench_tool(tmp_path)
    tool(tmp_path, "llama-batched-bench", "\n".join(json.dumps(r) for r in BATCHED))
    tools = llama_cpp_tools(str(tmp_path))
    out = run_llama_cpp(tools, "m.gguf", [1, 2], "-nr 1")
    assert out["decode_64"] == 300.0 and out["end_to_end_16"] == 16 * 128 / 20.0
    batched_args = (tmp_path / "llama-batched-bench.args").read_text().split()
    assert batched_args[-1] == "-nr" and "--repack" not in batched_args
    calls = []
    real = llama_cpp.llama_bench
    llama_cpp.llama_bench = lambda *a: calls.append((a[2], a[3])) or real(*a)
    try:
        singles = llama_singles(tools[0], "m.gguf", [1, 2], "-nr")
    finally:
        llama_cpp.llama_bench = real
    assert singles == {"tg128_t1": 40.0, "tg128_t2": 70.0, "tg128": 70.0, "pp512": 190.0}
    assert calls == [
        ([1, 2], ["-p", "0", "-n", "128", "-r", "5"]),
        ([2], ["-p", "512", "-n", "0", "-r", "5"]),
    ]
    bench_args = (tmp_path / "llama-bench.args").read_text().splitlines()[-1].split()
    assert bench_args[bench_args.index("-t") + 1] == "2"  # prefill at the largest count
    assert bench_args[-2:] == ["--repack", "0"]  # llama-bench's spelling of no repacking
    assert llama_depth(tools[0], "m.gguf", 2, 4096, "-nr") == 33.0
    depth_args = (tmp_path / "llama-bench.args").read_text().splitlines()[-1].split()
    assert depth_args[depth_args.index("-d") + 1] == "4096" and depth_args[-2:] == ["--repack", "0"]
    depth = {"tg128_d4096": 33.0}
    assert {key for key, _ in table_rows(2)} <= set(out) | set(singles) | set(depth)
    assert llama_cpp_tools(str(tmp_path / "none")) is None


def test_batch1_rounds_alternate_who_goes_first_and_take_medians():
    order, ours_rates, theirs_rates = [], iter([100.0, 300.0, 200.0]), iter([50.0, 10.0, 60.0])
    ours = lambda: order.append("ours") or {"tg128": next(ours_rates)}  # noqa: E731
    theirs = lambda: order.append("theirs") or {"tg128": next(theirs_rates)}  # noqa: E731
    mine, peer = alternating_rounds(ours, theirs, 3)
    assert order == ["ours", "theirs", "theirs", "ours", "ours", "theirs"]
    assert [run["tg128"] for run in mine] == [100.0, 300.0, 200.0]
    assert medians(mine) == {"tg128": 200.0} and medians(peer) == {"tg128": 50.0}


class ClockedEngine:
    """An engine whose generate() moves a fake clock: a fixed setup, then per prompt token
    and per generated token; flush_cache() is recorded."""

    def __init__(self, clock: list[float], setup: float, per_prompt: float, per_step: float):
        self.clock, self.setup, self.per_prompt, self.per_step = clock, setup, per_prompt, per_step
        self.flushes = 0

    def flush_cache(self) -> None:
        self.flushes += 1

    def generate(self, input_ids, sampling_params) -> dict:
        steps = sampling_params["max_new_tokens"]
        self.clock[0] += self.setup + self.per_prompt * len(input_ids) + self.per_step * steps
        return {"output_ids": [0] * steps}


def test_batch1_probe_times_decode_steps_alone_as_tg128_does(monkeypatch):
    """The prompt's prefill and the request's setup are the same in both generations, so
    the difference is 128 decode steps: the rate is the engine's per-step rate exactly."""
    clock = [0.0]
    monkeypatch.setattr(offline.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(offline, "synthetic_prompts", lambda tok, n, lo, hi, seed: [[1] * lo])
    engine = ClockedEngine(clock, setup=0.030, per_prompt=0.002, per_step=0.008)
    rates = offline.single_probes(engine, None, repetitions=2)
    assert rates["batch1_decode_tokens_per_s"] == pytest.approx(1 / 0.008)
    # prefill: one whole 512-token prompt and one token, setup included
    assert rates["prefill_512_tokens_per_s"] == pytest.approx(512 / (0.030 + 512 * 0.002 + 0.008))
    assert engine.flushes == 3 + 2 * 3  # every generation from an empty cache


def test_each_tool_gets_no_repack_in_its_own_spelling_and_failures_show_their_error(tmp_path):
    for extra in ("-nr", "-nr 1", "--no-repack", "--repack 0"):
        assert tool_args(extra + " -fa on", bench=True) == ["--repack", "0", "-fa", "on"]
        assert tool_args(extra + " -fa on") == ["-nr", "-fa", "on"]
    assert tool_args("--repack 1") == ["--repack", "1"]
    path = tmp_path / "llama-bench"
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('error: invalid argument: -nr')\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    tool(tmp_path, "llama-batched-bench", "")
    with pytest.raises(RuntimeError, match="llama-bench failed .*invalid argument: -nr"):
        llama_singles(llama_cpp_tools(str(tmp_path))[0], "m.gguf", [2])


# -- llama-server (bench spec's llama.cpp rows) -------------------------------------------------

SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
spec = "--spec-type" in args
open(LOG + ("-on" if spec else "-off"), "w").write(" ".join(args))

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(LOG + "-bodies", "a") as f:
            f.write(json.dumps(body) + "\\n")
        timings = {"predicted_n": 10, "predicted_ms": 50.0 if spec else 100.0}
        if spec:
            timings.update(draft_n=8, draft_n_accepted=6)
        self.answer({"content": "same" if body["prompt"][0] == 1 else ("on" if spec else "off"),
                     "timings": timings})

HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


def test_spec_rows_on_two_llama_servers(tmp_path):
    log = tmp_path / "server"
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{SERVER}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)

    engine = SimpleNamespace(  # what llama_cpp_servers reads of an engine
        core=SimpleNamespace(loaded=SimpleNamespace(path="m.gguf")),
        config=SimpleNamespace(num_threads=2),
    )
    args = argparse.Namespace(
        llama_cpp_bin=str(tmp_path), llama_cpp_args="-nr", draft_tokens=4, llama_cpp_ngram=3
    )
    schema = json.dumps({"type": "object"})
    params = [{"max_new_tokens": 10, "json_schema": schema}, {"max_new_tokens": 10}]
    with llama_cpp_servers(args, engine) as servers:
        row = compare_llama_cpp(servers, [[1, 2], [3, 4]], params)
    assert row["ratio"] == 2.0 and row["acceptance"] == 0.75 and row["identical"] == "1/2"
    assert row["off_tok_s"] == 100.0 and row["on_tok_s"] == 200.0
    on = (tmp_path / "server-on").read_text().split()
    off = (tmp_path / "server-off").read_text().split()
    assert on[on.index("--spec-type") + 1] == "ngram-simple" and off[-1] == on[-1] == "-nr"
    assert on[on.index("--spec-ngram-simple-size-n") + 1] == "3"
    assert on[on.index("--spec-draft-n-max") + 1] == "4" and on[on.index("-t") + 1] == "2"
    bodies = [json.loads(line) for line in (tmp_path / "server-bodies").read_text().splitlines()]
    assert bodies[0]["json_schema"] == {"type": "object"} and bodies[0]["prompt"] == [1, 2]
    assert all(b["temperature"] == 0 and b["n_predict"] == 10 for b in bodies)
    assert "json_schema" not in bodies[-1]
    with socket.socket() as s:  # both servers are gone: their ports are free again
        for url in servers:
            assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0


def test_fixed_thread_probes_run_at_their_thread_count_and_restore_it(monkeypatch):
    """tg128 at 1 and N threads and pp512 at N run at exactly that count; afterwards the
    count is as it was. The 1-thread round skips the prefill probe; a third probe decodes
    one step a call (the same engine without multi-step calls), then decode_steps is back."""
    seen = []
    scheduler = SimpleNamespace(decode_steps=8)
    engine = SimpleNamespace(core=SimpleNamespace(scheduler=scheduler))

    def probe(engine_, tokenizer, repetitions, with_prefill):
        core = engine_.core
        assert repetitions == 3
        seen.append((torch.get_num_threads(), with_prefill, core.scheduler.decode_steps))
        rates = {
            "batch1_decode_tokens_per_s": 10.0 * torch.get_num_threads()
            + core.scheduler.decode_steps
        }
        return rates | ({"prefill_512_tokens_per_s": 9.0} if with_prefill else {})

    monkeypatch.setattr(offline, "single_probes", probe)
    before = torch.get_num_threads()
    assert offline.spruce_singles(engine, None, 2, 3) == {
        "tg128_t1": 18.0,
        "tg128": 28.0,
        "pp512": 9.0,
        "tg128_one_step": 21.0,
    }
    assert seen == [(1, False, 8), (2, True, 8), (2, False, 1)]
    assert torch.get_num_threads() == before
    assert scheduler.decode_steps == 8
