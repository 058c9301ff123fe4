"""`spruce bench kernels` on a tiny quantized model: every kernel that runs the model's formats
times a pass, and the table marks the one `linear` takes for each row count."""

from __future__ import annotations

import pytest

from spruce.runtime.bench import kernels
from spruce.runtime.cli import build_parser, engine_options
from spruce.runtime.executor.kernels import cpu_quant_ops as ops
from spruce.runtime.models.loading.loader import load_model

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler")


def test_each_kernel_that_runs_the_format_times_a_pass(tiny_llama_dir):
    layers = kernels.quantized_linears(load_model(str(tiny_llama_dir), quantization="q4_1").model)
    assert layers and all(m.qtype == "q4_1" for m in layers)
    times = kernels.time_passes(layers, rows=20, repeats=1)
    expected = {"integer", "gemm"} | ({"igemm"} if ops.igemm_runs("q4_1") else set())
    assert set(times) == expected and all(t > 0 for t in times.values())


def test_the_table_marks_the_kernel_linear_takes(tiny_llama_dir, capsys):
    args = build_parser().parse_args(
        ["bench", "kernels", "--model", str(tiny_llama_dir), "--quantization", "q8_0"]
        + ["--rows", "1,40", "--repeats", "1", "--num-threads", "1"]
    )
    assert kernels.run(args, engine_options(args)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    rows = {line.split("|")[1].strip(): line for line in lines}
    for count in (1, 40):
        cells = rows[str(count)].split("|")[2:5]
        chosen = kernels.KERNELS.index(ops.kernel("q8_0", count))
        assert [c.strip().startswith("**") for c in cells] == [i == chosen for i in range(3)]
