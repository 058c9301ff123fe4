"""llama.cpp's own benchmarks on the same GGUF file, for same-run ratios: `llama-bench`
(tg128 batch-1 decode at each thread count asked for and after a long prompt, pp512
prefill) and
`llama-batched-bench` (sequences of 128 prompt + 128 generated tokens), and `llama-server`
for request-level comparisons (speculative decoding). `extra` holds arguments for the tools,
e.g. `-nr` (no weight repacking: llama.cpp's AMX repack crashes in some VMs), which each
tool gets in its own spelling (`tool_args`); a tool that fails shows its error output."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.request

from spruce.runtime.executor.distributed import free_port

PARALLEL = (16, 64)  # sequences of 128 prompt + 128 generated tokens


def llama_cpp_tools(bin_dir: str | None) -> tuple[str, str] | None:
    path = bin_dir if bin_dir else os.environ.get("PATH")
    found = [shutil.which(name, path=path) for name in ("llama-bench", "llama-batched-bench")]
    return None if None in found else (found[0], found[1])


def run_llama_cpp(
    tools: tuple[str, str], model: str, threads: list[int], extra: str = "", counts=PARALLEL
) -> dict[str, float]:
    """tokens/s per parallel count, at the largest thread count: the decode phase and end to
    end (generated tokens over the whole run). The batch-1 and prefill rows come from
    `llama_singles`, in rounds beside Spruce's (bench/offline.py)."""
    return llama_batched(tools[1], model, max(threads), counts, extra) if counts else {}


def llama_singles(
    tool: str, model: str, threads: list[int], extra: str = "", repetitions: int = 5
) -> dict[str, float]:
    """tokens/s (llama-bench's means of `repetitions` runs) of batch-1 decode (tg128) at each
    thread count, `tg128_t<N>`, and `tg128` at the largest, and of prefill (pp512) at the
    largest."""
    most, runs = max(threads), ["-r", str(repetitions)]
    rows = llama_bench(tool, model, threads, ["-p", "0", "-n", "128", *runs], extra)
    out = {f"tg128_t{row['n_threads']}": row["avg_ts"] for row in rows if row["n_gen"]}
    out["tg128"] = out[f"tg128_t{most}"]
    rows = llama_bench(tool, model, [most], ["-p", "512", "-n", "0", *runs], extra)
    prefill = (row["avg_ts"] for row in rows if row["n_prompt"] and row["n_threads"] == most)
    return out | {"pp512": next(prefill)}


def llama_depth(tool: str, model: str, threads: int, depth: int, extra: str = "") -> float:
    """tokens/s of batch-1 decode (tg128) after `depth` tokens in the context (llama-bench's
    -d), the mean of 2 repetitions (each fills the context again)."""
    rows = llama_bench(
        tool, model, [threads], ["-p", "0", "-n", "128", "-d", str(depth), "-r", "2"], extra
    )
    return next(row["avg_ts"] for row in rows if row["n_gen"])


def llama_bench(tool: str, model: str, threads: list[int], test: list[str], extra: str) -> list:
    """llama-bench's JSON rows for `test` (its -p / -n) at each thread count."""
    counts = ",".join(map(str, sorted(set(threads))))
    done = _run(
        [tool, "-m", model, "-t", counts, *test, "-o", "json", *tool_args(extra, bench=True)]
    )
    return json.loads(done.stdout)


NO_REPACK = ("-nr", "--no-repack")


def tool_args(extra: str, bench: bool = False) -> list[str]:
    """`extra` split for one tool, a no-repack request (`-nr`, `--no-repack`, `-nr 1` or
    `--repack 0`) spelled as the tool takes it: llama-bench `--repack 0`, the others `-nr`."""
    words, out, i = shlex.split(extra), [], 0
    while i < len(words):
        word, following = words[i], words[i + 1] if i + 1 < len(words) else None
        off = word in NO_REPACK or (word == "--repack" and following == "0")
        if off:
            i += 2 if following in ("0", "1") else 1
            out += ["--repack", "0"] if bench else ["-nr"]
        else:
            out.append(word)
            i += 1
    return out


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """The tool's run; its error output in the exception when it fails."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{os.path.basename(command[0])} failed ({done.returncode}): {tail}")
    return done


def llama_batched(
    tool: str, model: str, threads: int, counts: tuple[int, ...], extra: str = ""
) -> dict[str, float]:
    """llama-batched-bench, `counts` sequences of 128 prompt + 128 generated tokens:
    tokens/s of the decode phase and end to end (generated tokens over the whole run)."""
    batched = _run(
        [tool, "-m", model, "-t", str(threads), "-c", str(256 * max(counts)), "-b", "2048", "-ub", "512",
         "-npp", "128", "-ntg", "128", "-npl", ",".join(map(str, counts)), "--output-format", "jsonl",
         *tool_args(extra)],
    )  # fmt: skip
    out = {}
    for line in batched.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[f"decode_{row['pl']}"] = row["speed_tg"]
            out[f"end_to_end_{row['pl']}"] = row["pl"] * row["tg"] / row["t"]
    return out


def table_rows(threads: int, counts=PARALLEL) -> list[tuple[str, str]]:
    """(result key, label) of the comparison table's rows."""
    return [
        ("tg128_t1", "batch-1 decode (tg128), 1 thread"),
        ("tg128", f"batch-1 decode (tg128), {threads} threads"),
        ("pp512", "prefill, 512-token prompt (pp512)"),
        (
            "tg128_d4096",
            f"batch-1 decode after a 4096-token prompt (tg128 @ d4096), {threads} threads",
        ),
        *((f"decode_{n}", f"{n} sequences x (128 + 128), decode phase") for n in counts),
        *(
            (f"end_to_end_{n}", f"{n} sequences x (128 + 128), end to end, generated")
            for n in counts
        ),
    ]


@contextlib.contextmanager
def llama_server(bin_dir: str | None, model: str, threads: int, args: list[str], extra: str = ""):
    """A llama-server on a free local port for one sequence at a time, stopped on exit;
    yields its base URL. `args` and `extra` are added to its command line."""
    exe = shutil.which("llama-server", path=bin_dir if bin_dir else os.environ.get("PATH"))
    if exe is None:
        raise FileNotFoundError("llama-server not found (see --llama-cpp-bin)")
    port = free_port()
    command = [exe, "-m", model, "-t", str(threads), "--host", "127.0.0.1", "--port", str(port),
               "-np", "1", "-c", "8192", *args, *tool_args(extra)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server was not ready within {timeout:.0f} s")


def server_complete(url: str, body: dict) -> dict:
    """POST /completion (llama.cpp's native route: token-id prompts, json_schema)."""
    request = urllib.request.Request(
        url + "/completion", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.load(answer)
