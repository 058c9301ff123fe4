"""The integer GEMV's tile kernels (four weight rows at a time, every format) against its
one-row kernels: the weight rows of a call go four at a time through a tile and the last
n % 4 one at a time, and a row's result is bit-identical either way, wherever in the tile it
sits, for any number of activation rows, on every instruction set this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_quant_ops import QTYPES, isa, random_blocks, reference_linear  # noqa: F401 (a fixture)

from spruce.runtime.executor.kernels import cpu_quant_ops as ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler")

# k: the 32-value formats in one step of 8 blocks and a partial one (10 blocks), the K
# formats in three super-blocks
K = {qtype: 768 if ops.QUANT_TYPES[qtype].block_size == 256 else 320 for qtype in QTYPES}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_a_weight_row_is_the_same_in_a_tile_or_alone(isa, qtype, rows):
    """Eight weight rows are two tiles; without the first, rows 1-4 are a tile (row 4 now
    its first row, not its last) and rows 5-7 go alone."""
    rng = np.random.default_rng(rows)
    k = K[qtype]
    blocks = random_blocks(qtype, 8, k, rng)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    tiles = ops.integer_linear(x, qtype, blocks, isa=isa)
    shifted = ops.integer_linear(x, qtype, blocks[1:], isa=isa)
    assert torch.equal(tiles[:, 1:], shifted)
    expected = reference_linear(x.numpy(), qtype, blocks, k)
    assert np.allclose(tiles.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_tiles_cover_a_whole_model_row():
    """A real-size row (Llama-3.2-1B's 8,192 values: 32 steps, 32 super-blocks) on every
    format, tiles and single rows alike, within the reference's tolerance."""
    rng = np.random.default_rng(7)
    k = 8192
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32))
    for qtype in QTYPES:
        blocks = random_blocks(qtype, 6, k, rng)
        expected = reference_linear(x.numpy(), qtype, blocks, k)
        for chosen in ops.available_isas():
            y = ops.integer_linear(x, qtype, blocks, isa=chosen).numpy()
            assert np.allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()), (
                qtype,
                chosen,
            )
