"""Every example in examples/ runs on the bundled model (one shared runtime; quickstart also
starts its own, as a user's one command does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import bundled_gguf_path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXPECTED = {
    "quickstart.py": ["answer:", "in Europe:"],
    "json_extraction.py": ["raw:"],
    "few_shot_qa.py": ["8 programs in"],
    "tree_of_thought.py": ["idea 3:", "best:"],
    "react_agent.py": ["Action:", "final answer:"],
    "multi_turn_chat.py": ["assistant:"],
    "streaming.py": ["---"],
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bundled_gguf_path() is None, reason="the bundled SmolLM2 model is not installed"
    ),
]


@pytest.fixture(scope="module")
def address():
    import spruce.lang as sl

    runtime = sl.Runtime(num_threads=1)
    yield runtime.address
    runtime.shutdown()


def run_example(name: str, env_address: str | None, timeout: float = 60) -> str:
    env = {k: v for k, v in os.environ.items() if k != "SPRUCE_ADDRESS"}
    if env_address:
        env["SPRUCE_ADDRESS"] = env_address
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")) == sorted(
        EXPECTED
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name, address):
    out = run_example(name, address)
    for text in EXPECTED[name]:
        assert text in out, out


def test_quickstart_starts_its_own_runtime():
    assert "in Europe:" in run_example("quickstart.py", None, timeout=120)
