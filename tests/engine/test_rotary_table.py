"""RotaryEmbedding's positions table (network/layers.py): once the engine sets the context, a step's cos and sin
are rows of a table built with the very arithmetic the per-step path uses, so they are the same bits."""

import pytest
import torch

from tritonllm.engine.embedded.network import layers
from tritonllm.engine.embedded.network.model_config import RopeConfig

HEAD_DIM = 64
ROPES = {
    "default": RopeConfig(),
    "llama3": RopeConfig(
        "llama3",
        500000.0,
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
    "yarn (scaled cos and sin)": RopeConfig("yarn", 10000.0, dict(factor=4.0, original_max_position_embeddings=2048)),
}


def rotary(rope: RopeConfig, context_len: int | None) -> layers.RotaryEmbedding:
    module = layers.RotaryEmbedding(rope, HEAD_DIM)
    if context_len is not None:
        module.set_context_length(context_len)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ROPES)
def test_table_rows_are_the_computed_rotations_bit_for_bit(name, dtype):
    module = rotary(ROPES[name], 3000)
    positions = torch.tensor([0, 1, 17, 1024, 2999, 3000])
    cos, sin = module(positions, dtype)
    assert dtype in module.tables and module.tables[dtype].shape == (3001, 2 * HEAD_DIM)
    both = module._rotations(positions, dtype)
    assert torch.equal(cos, both[:, :HEAD_DIM]) and torch.equal(sin, both[:, HEAD_DIM:])
    assert cos.dtype == sin.dtype == dtype and cos.shape == sin.shape == (6, HEAD_DIM)
    if name.startswith("yarn"):
        assert module.attention_factor != 1.0  # the scaled path is the one checked


def test_without_a_context_each_step_computes_its_rotations():
    module = rotary(ROPES["default"], None)
    cos, sin = module(torch.tensor([5, 9]), torch.float32)
    assert not module.tables
    angles = torch.tensor([5.0, 9.0])[:, None] * module.inv_freq[None, :]
    assert torch.equal(cos[:, : HEAD_DIM // 2], angles.cos()) and torch.equal(sin[:, HEAD_DIM // 2 :], angles.sin())


def test_positions_past_the_table_take_its_last_row():
    """A lookahead window's columns may sit past max_seq_len: they never commit, and must not index past the table."""
    module = rotary(ROPES["default"], 100)
    cos, sin = module(torch.tensor([100, 130]), torch.float32)
    assert torch.equal(cos[0], cos[1]) and torch.equal(sin[0], sin[1])


def test_too_long_a_context_keeps_no_table(monkeypatch):
    monkeypatch.setattr(layers, "MAX_TABLE_POSITIONS", 64)
    module = rotary(ROPES["default"], 64)
    module(torch.tensor([3]), torch.float32)
    assert not module.tables


def test_new_frequencies_drop_the_table():
    module = rotary(ROPES["default"], 50)
    module(torch.tensor([3]), torch.float32)
    assert module.tables
    module.reset_frequencies(torch.device("cpu"))
    assert not module.tables
