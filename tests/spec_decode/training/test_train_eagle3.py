"""Training EAGLE-3 drafts (train_eagle3.py).

The trainer's dense passes equal drafting k deep with the draft layer (test_eagle3_format's dense reference, from
the checkpoint's tensors); the captured features are transformers' layer outputs side by side; training lowers the
loss and lifts top-1 agreement above the untrained draft's on its training data; a short CLI run with EAGLE-3's
default capture layers writes a draft that `load_eagle3` loads and the engine runs, greedy output unchanged; the
last layer cannot be captured. The tiny target gets eight layers (random weights), enough for the default
capture layers (1, 3, 4); its tiny two-layer sibling could only capture layer 0."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritonllm.checkpoints.hf_files import write_json
from tritonllm.checkpoints.tiny import build_tiny_model, random_weights
from tritonllm.commands.main import main
from tritonllm.engine.config import ConfigError
from tritonllm.engine.embedded.network.model_config import ModelConfig, ModelLoadError
from tritonllm.engine.embedded.speculation.eagle3 import eagle3_config_for, load_eagle3, random_eagle3
from tritonllm.spec_decode.training.frozen_base import base_outputs, load_base
from tritonllm.spec_decode.training.train_eagle import Target, base_and_data, frequent_choices, train_draft
from tritonllm.spec_decode.training.train_eagle3 import (
    Eagle3TrainSettings,
    dense_passes,
    depth_accuracy,
    draft_ids,
    draft_loss,
    initial_draft,
    trainable_capture_layers,
)

from ..test_eagle import eagle_spec
from ..test_eagle3_format import dense_layer
from .test_train_eagle import assert_plain_greedy_with_drafts, plain_outputs  # noqa: F401 (fixture, on `target`)

LAYERS = 8
CAPTURE = (0, 2)
SMALL = dict(distill_prompts=12, distill_own_requests=6, distill_max_tokens=24, progress=False)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny Llama (tokenizer included) with eight random layers."""
    folder = build_tiny_model(tmp_path_factory.mktemp("deep_target"), seed=5, arch="llama")
    config = {**json.loads((folder / "config.json").read_text()), "num_hidden_layers": LAYERS}
    save_file(random_weights(config, seed=5), str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", config)
    return folder


def test_dense_passes_equal_the_draft_layer_drafting_k_deep(target, tmp_path):
    config = ModelConfig.from_dict(json.loads((target / "config.json").read_text()))
    folder = random_eagle3(target, tmp_path, seed=3, capture_layers=CAPTURE)
    draft = load_eagle3(folder, torch.float32, "cpu", target=config, target_num_layers=LAYERS)
    state = load_file(str(folder / "model.safetensors"))
    torch.manual_seed(0)
    hidden, width = config.hidden_size, 12
    embed = torch.randn(config.vocab_size, hidden)
    ids, features = torch.randint(0, config.vocab_size, (1, width)), torch.randn(1, width, 2 * hidden) * 2
    with torch.no_grad():
        passes = dense_passes(draft, embed, ids, features, 3)
    tokens = ids[0]
    committed_h = torch.nn.functional.linear(features[0], state["fc.weight"])
    for j in (0, 4, 8):  # drafting from root j + 1: rows 0..j committed, then the draft's own nodes
        for depth in range(3):
            own = [passes[d][0, j] for d in range(depth)]
            embeds = embed[torch.cat((tokens[1 : j + 2], tokens[j + 2 : j + 2 + depth]))]
            h = torch.cat([committed_h[: j + 1]] + [o[None] for o in own])
            expected = dense_layer(state, embeds, h, torch.arange(j + 1 + depth))[-1]
            torch.testing.assert_close(passes[depth][0, j], expected, atol=1e-5, rtol=1e-5)


def test_features_are_the_captured_layer_outputs_side_by_side(target):
    _, base = load_base(target)
    ids = torch.arange(30, 50)
    features, choices = base_outputs(base, [ids], False, capture_layers=CAPTURE)
    with torch.no_grad():
        out = base(ids[None], output_hidden_states=True)
    assert torch.equal(features[0], torch.cat([out.hidden_states[1][0], out.hidden_states[3][0]], -1))
    assert torch.equal(choices[0], out.logits[0].argmax(-1))


def test_training_lowers_the_loss_and_beats_the_untrained_draft_on_its_data(target):
    settings = Eagle3TrainSettings(
        steps=40, batch_sequences=8, learning_rate=3e-3, eval_every=40, draft_vocab=200, capture_layers=CAPTURE, **SMALL
    )
    base, (train, validation, _) = base_and_data(target, settings, None, CAPTURE)
    embed, lm_head = Target.of(base).embed, Target.of(base).lm_head
    vocab = frequent_choices(train, Target.of(base), settings.draft_vocab)
    config = eagle3_config_for(json.loads((target / "config.json").read_text()), len(vocab), CAPTURE)
    draft = initial_draft(config, CAPTURE, vocab, base)
    to_draft = draft_ids(vocab, len(lm_head))
    before = depth_accuracy(draft, embed, train, settings.passes)
    losses, _ = train_draft(
        draft,
        train,
        None,
        settings,
        None,
        lambda batch, scale: draft_loss(draft, embed, to_draft, batch, settings, scale),
        lambda data: depth_accuracy(draft, embed, data, settings.passes),
    )
    after = depth_accuracy(draft, embed, train, settings.passes)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert after[0] > before[0] + 0.1 and sum(after) > sum(before)


def test_cli_trains_a_draft_with_the_default_layers_that_keeps_greedy_output_exact(
    target, plain_outputs, tmp_path, capsys
):
    out = tmp_path / "draft"
    assert (
        main(
            [
                "spec",
                "train-eagle",
                "--eagle3",
                "--model",
                str(target),
                "--out",
                str(out),
                "--steps",
                "6",
                "--batch",
                "4",
                "--distill-prompts",
                "12",
                "--distill-own-requests",
                "6",
                "--distill-max-tokens",
                "24",
                "--eval-every",
                "3",
                "--draft-vocab",
                "40",
                "--save-dtype",
                "bfloat16",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["eagle3"] and report["capture_layers"] == [1, 3, 4] and report["draft_vocab"] == 40
    assert len(report["depth_accuracy"]) == 3 and report["tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["torch_dtype"] == "bfloat16"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    target_config = ModelConfig.from_dict(json.loads((target / "config.json").read_text()))
    draft = load_eagle3(out, torch.float32, "cpu", target=target_config, target_num_layers=LAYERS)
    assert draft.capture_layers == (1, 3, 4) and len(draft.draft_to_target) == 40
    assert draft.draft_to_target.tolist() == sorted(set(draft.draft_to_target.tolist()))
    assert_plain_greedy_with_drafts(target, eagle_spec(out, tree=True, version="Eagle3"), plain_outputs)


def test_capture_layers_are_checked_before_any_work(target, tmp_path, capsys):
    config = json.loads((target / "config.json").read_text())
    assert trainable_capture_layers([4, 0], config) == (0, 4)
    with pytest.raises(ConfigError, match="layer 7 is the target's last"):
        trainable_capture_layers([0, 7], config)
    with pytest.raises(ModelLoadError, match="default capture layers for a target of 2 layers"):
        trainable_capture_layers(None, {**config, "num_hidden_layers": 2})
    common = ["spec", "train-eagle", "--model", str(target), "--out", str(tmp_path)]
    assert main(common + ["--eagle3", "--capture-layers", "0", "7"]) == 2
    assert main(common + ["--capture-layers", "0", "2"]) == 2
    errors = capsys.readouterr().err
    assert "layer 7 is the target's last" in errors and "add --eagle3" in errors
