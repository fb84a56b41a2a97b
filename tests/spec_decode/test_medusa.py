"""Medusa heads: the checkpoint format round-trips (safetensors and .pt, prefixed keys), bad folders fail with the
file named, the proposer fills the choices tree from each head's top-k, and a short train-medusa run on a tiny
model produces loadable heads that agree with the model more than fresh ones."""
import json

import pytest
import torch
from safetensors.torch import save_file

from tritonllm.engine.embedded.models.model_config import ModelLoadError
from tritonllm.model_files.tiny import build_tiny_model
from tritonllm.spec_decode.medusa import MedusaHeads, MedusaProposer, load_medusa, save_medusa
from tritonllm.spec_decode.proposer import ProposalInput
from tritonllm.spec_decode.train_medusa import TrainSettings, train_medusa

HIDDEN, VOCAB = 16, 50


def _random_heads(num_heads=3, num_layers=1, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(HIDDEN, VOCAB, num_heads, num_layers)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_()
    return heads


def test_format_keys_are_the_medusa_ones():
    keys = set(_random_heads(num_heads=2, num_layers=2).checkpoint_state())
    assert keys == {f"{h}.{l}.linear.{kind}" for h in range(2) for l in range(2) for kind in ("weight", "bias")} | \
        {"0.2.weight", "1.2.weight"}


@pytest.mark.parametrize("num_layers", [1, 2])
def test_safetensors_round_trip_gives_the_same_outputs(tmp_path, num_layers):
    heads = _random_heads(num_layers=num_layers)
    save_medusa(heads, tmp_path, base_model="base")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == num_layers
    loaded = load_medusa(tmp_path)
    hidden = torch.randn(4, HIDDEN)
    assert torch.equal(loaded(hidden), heads(hidden))
    assert (loaded.num_heads, loaded.num_layers, loaded.vocab_size) == (3, num_layers, VOCAB)


def test_pt_file_with_prefixed_keys_and_a_wrong_head_count_in_config(tmp_path):
    heads = _random_heads(num_heads=2)
    state = {f"medusa_head.{k}": v for k, v in heads.checkpoint_state().items()}
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1}))
    loaded = load_medusa(tmp_path)  # the heads are counted from the tensors, as published configs lie
    assert loaded.num_heads == 2
    hidden = torch.randn(3, HIDDEN)
    assert torch.equal(loaded(hidden), heads(hidden))


def test_bad_folders_name_what_is_wrong(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_medusa(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no medusa_lm_head.safetensors or medusa_lm_head.pt"):
        load_medusa(tmp_path)
    state = _random_heads().checkpoint_state()
    del state["1.0.linear.bias"]
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ModelLoadError, match="lack 1.0.linear.bias"):
        load_medusa(tmp_path)
    state = _random_heads().checkpoint_state()
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ModelLoadError, match="unexpected tensor extra.weight"):
        load_medusa(tmp_path)


def test_proposer_fills_the_choices_tree_from_each_heads_top_k():
    heads = _random_heads(num_heads=2)
    proposer = MedusaProposer(heads, choices=[(0,), (1,), (0, 0), (0, 1), (1, 0)])
    hidden = torch.randn(2, HIDDEN)
    trees = proposer.propose([ProposalInput(0, [1, 2], hidden[0]), ProposalInput(1, [3], hidden[1],
                                                                                  max_draft_tokens=2)])
    top = heads(hidden).topk(2, dim=-1).indices  # [batch, heads, 2]
    first, second = top[0].tolist()
    assert trees[0].tokens == [first[0], first[1], second[0], second[1], second[0]]
    assert trees[0].parents == [-1, -1, 0, 0, 1]
    assert trees[1].tokens == top[1, 0].tolist() and trees[1].parents == [-1, -1]


def test_proposer_refuses_a_tree_deeper_than_the_heads_and_inputs_without_hidden_state():
    with pytest.raises(ModelLoadError, match="3 deep but the checkpoint has 2 heads"):
        MedusaProposer(_random_heads(num_heads=2), choices=[(0,), (0, 0), (0, 0, 0)])
    proposer = MedusaProposer(_random_heads(num_heads=2))  # default tree
    assert proposer.template.depth <= 2
    with pytest.raises(ValueError, match="hidden state"):
        proposer.propose([ProposalInput(7, [1, 2])])


def test_short_training_run_on_a_tiny_model_gives_loadable_heads_that_learned(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=4)
    # A repeated sentence: what comes two tokens later is learnable from the current position in a few steps.
    text = "Every morning the baker opens the shop, lights the oven and sells warm bread to the village. " * 30
    settings = TrainSettings(num_heads=2, steps=100, batch_positions=128, window=64, learning_rate=3e-2,
                             progress=False)
    report = train_medusa(model_dir, tmp_path / "heads", settings, text)
    heads = load_medusa(tmp_path / "heads")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert (heads.num_heads, heads.num_layers, heads.vocab_size) == (2, 1, vocab_size)
    assert report.last_loss < 0.6 * report.first_loss
    # A fresh head is the base LM head: it guesses the next token, not the one after; training must beat that.
    fresh = train_medusa(model_dir, tmp_path / "fresh", TrainSettings(num_heads=2, steps=0, window=64,
                                                                      progress=False), text)
    assert report.head_accuracy[0] > fresh.head_accuracy[0] + 0.1
    assert report.head_accuracy[1] > fresh.head_accuracy[1] + 0.1


def test_cli_train_medusa_writes_heads_and_reports_json(tmp_path, capsys):
    from tritonllm.cli import main

    model_dir = build_tiny_model(tmp_path / "tiny", seed=5)
    text_file = tmp_path / "text.txt"
    text_file.write_text("A small text about boats and harbours, and the sea between them. " * 10)
    out = tmp_path / "heads"
    assert main(["spec", "train-medusa", "--model", str(model_dir), "--out", str(out), "--heads", "2",
                 "--steps", "3", "--batch", "32", "--text", str(text_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["out"] == str(out) and len(report["head_accuracy"]) == 2
    assert load_medusa(out).num_heads == 2
    assert main(["spec", "train-medusa", "--model", str(model_dir), "--out", str(out), "--steps", "0"]) == 2
