"""Medusa heads: the checkpoint format round-trips (safetensors and .pt, prefixed keys), bad folders fail with the
file named, the proposer fills the choices tree from each head's top-k, and a short train-medusa run on a tiny
model produces loadable heads that agree with the model more than fresh ones. Heads sharing the base LM head (our
`medusa_shared_lm_head` extension) give the logits of full heads holding copies of it, keep greedy output exact in
the engine, and the SmolLM2 heads shipped in the package (`builtin:smollm2`) load and draft accepted tokens.

TRITONLLM_TEST_DEVICE=cuda runs the engines on the GPU (the CPU is the default)."""

import json
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.types import InvalidRequestError, SamplingParams
from tritonllm.spec_decode.checkpoint_files import CheckpointError
from tritonllm.spec_decode.medusa import MedusaHeads, MedusaProposer, load_medusa, resolve_heads_dir, save_medusa
from tritonllm.spec_decode.proposer import ProposalInput
from tritonllm.spec_decode.training.train_medusa import IGNORE, TrainSettings, logit_columns, train_medusa

DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")

HIDDEN, VOCAB = 16, 50


def _random_heads(num_heads=3, num_layers=1, seed=0, shared=False) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(HIDDEN, VOCAB, num_heads, num_layers, shared_lm_head=shared)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_()
    return heads


def test_format_keys_are_the_medusa_ones():
    keys = set(_random_heads(num_heads=2, num_layers=2).checkpoint_state())
    assert keys == {f"{h}.{j}.linear.{kind}" for h in range(2) for j in range(2) for kind in ("weight", "bias")} | {
        "0.2.weight",
        "1.2.weight",
    }


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
    with pytest.raises(CheckpointError, match="no config.json"):
        load_medusa(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no medusa_lm_head.safetensors or medusa_lm_head.pt"):
        load_medusa(tmp_path)
    state = _random_heads().checkpoint_state()
    del state["1.0.linear.bias"]
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match="lack 1.0.linear.bias"):
        load_medusa(tmp_path)
    state = _random_heads().checkpoint_state()
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor extra.weight"):
        load_medusa(tmp_path)


def test_proposer_fills_the_choices_tree_from_each_heads_top_k():
    heads = _random_heads(num_heads=2)
    proposer = MedusaProposer(heads, choices=[(0,), (1,), (0, 0), (0, 1), (1, 0)])
    hidden = torch.randn(2, HIDDEN)
    trees = proposer.propose(
        [ProposalInput(0, [1, 2], hidden[0]), ProposalInput(1, [3], hidden[1], max_draft_tokens=2)]
    )
    top = heads(hidden).topk(2, dim=-1).indices  # [batch, heads, 2]
    first, second = top[0].tolist()
    assert trees[0].tokens == [first[0], first[1], second[0], second[1], second[0]]
    assert trees[0].parents == [-1, -1, 0, 0, 1]
    assert trees[1].tokens == top[1, 0].tolist() and trees[1].parents == [-1, -1]


def test_proposer_refuses_a_tree_deeper_than_the_heads_and_inputs_without_hidden_state():
    with pytest.raises(CheckpointError, match="3 deep but the checkpoint has 2 heads"):
        MedusaProposer(_random_heads(num_heads=2), choices=[(0,), (0, 0), (0, 0, 0)])
    proposer = MedusaProposer(_random_heads(num_heads=2))  # default tree
    assert proposer.template.depth <= 2
    with pytest.raises(ValueError, match="hidden state"):
        proposer.propose([ProposalInput(7, [1, 2])])


def test_short_training_run_on_a_tiny_model_gives_loadable_heads_that_learned(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=4)
    # A repeated sentence: what comes two tokens later is learnable from the current position in a few steps.
    text = "Every morning the baker opens the shop, lights the oven and sells warm bread to the village. " * 30
    settings = TrainSettings(num_heads=2, steps=100, batch_positions=128, window=64, learning_rate=3e-2, progress=False)
    report = train_medusa(model_dir, tmp_path / "heads", settings, text)
    heads = load_medusa(tmp_path / "heads")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert heads.shared_lm_head and (heads.num_heads, heads.num_layers, heads.vocab_size) == (2, 1, vocab_size)
    assert report.last_loss < 0.6 * report.first_loss and report.held_out_tokens > 0
    # A fresh head is the base LM head: it guesses the next token, not the one after; training must beat that.
    fresh = train_medusa(
        model_dir, tmp_path / "fresh", TrainSettings(num_heads=2, steps=0, window=64, progress=False), text
    )
    for h in range(2):
        assert report.train_accuracy[h] > fresh.train_accuracy[h] + 0.1
        assert report.head_accuracy[h] > fresh.head_accuracy[h]  # held out: this tiny random model is hard


def test_logit_columns_place_targets_in_the_draft_vocabulary():
    targets = torch.tensor([[3, 9], [IGNORE, 4], [7, IGNORE]])
    assert torch.equal(logit_columns(targets, None, 10), targets)
    assert logit_columns(targets, torch.tensor([3, 4, 9]), 10).tolist() == [[0, 2], [IGNORE, 1], [IGNORE, IGNORE]]


def test_heads_trained_over_a_draft_vocabulary_guess_only_its_tokens_and_learn(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=4)
    text = "Every morning the baker opens the shop, lights the oven and sells warm bread to the village. " * 30
    settings = TrainSettings(
        num_heads=2, steps=100, batch_positions=128, window=64, learning_rate=3e-2, progress=False, draft_vocab=64
    )
    report = train_medusa(model_dir, tmp_path / "heads", settings, text)
    heads = load_medusa(tmp_path / "heads")
    assert (
        len(heads.draft_vocab) == 64
        and heads.vocab_size == json.loads((model_dir / "config.json").read_text())["vocab_size"]
    )
    assert report.last_loss < 0.6 * report.first_loss
    # Accuracy is in token ids, through the vocabulary; fresh heads guess the next token instead.
    fresh = train_medusa(model_dir, tmp_path / "fresh", replace(settings, steps=0), text)
    for h in range(2):
        assert report.train_accuracy[h] > fresh.train_accuracy[h] + 0.1
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    weight = base.get_output_embeddings().weight.detach()
    heads.share_lm_head(lambda hidden: F.linear(hidden, weight[heads.draft_vocab]), weight.shape[0])
    guesses, _ = heads.top_k_with_probabilities(torch.randn(5, weight.shape[1]), 3)
    assert set(guesses.flatten().tolist()) <= set(heads.draft_vocab.tolist())


def _tiny_model_and_text(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=5)
    text_file = tmp_path / "text.txt"
    text_file.write_text("A small text about boats and harbours, and the sea between them. " * 10)
    return model_dir, text_file


def test_cli_train_medusa_writes_heads_and_reports_json(tmp_path, capsys):
    from tritonllm.commands.main import main

    model_dir, text_file = _tiny_model_and_text(tmp_path)
    out = tmp_path / "heads"
    assert (
        main(
            [
                "spec",
                "train-medusa",
                "--model",
                str(model_dir),
                "--out",
                str(out),
                "--heads",
                "2",
                "--steps",
                "3",
                "--batch",
                "32",
                "--text",
                str(text_file),
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["out"] == str(out) and len(report["head_accuracy"]) == 2
    assert load_medusa(out).num_heads == 2 and load_medusa(out).shared_lm_head and report["held_out_tokens"] > 0
    full = tmp_path / "full"
    assert (
        main(
            [
                "spec",
                "train-medusa",
                "--model",
                str(model_dir),
                "--out",
                str(full),
                "--heads",
                "2",
                "--steps",
                "2",
                "--batch",
                "32",
                "--text",
                str(text_file),
                "--no-share-lm-head",
                "--distill-tokens",
                "128",
                "--json",
            ]
        )
        == 0
    )
    distilled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert distilled["tokens"] > report["tokens"] + 64  # two batched greedy continuations were added
    heads = load_medusa(full)
    assert (
        not heads.shared_lm_head
        and heads.vocab_size == json.loads((model_dir / "config.json").read_text())["vocab_size"]
    )
    assert "medusa_shared_lm_head" not in json.loads((full / "config.json").read_text())


def test_cli_train_medusa_stops_at_its_time_limit_and_still_saves_heads(tmp_path, capsys):
    from tritonllm.commands.main import main

    model_dir, text_file = _tiny_model_and_text(tmp_path)
    out = tmp_path / "heads"
    assert (
        main(
            [
                "spec",
                "train-medusa",
                "--model",
                str(model_dir),
                "--out",
                str(out),
                "--heads",
                "2",
                "--steps",
                "1000000",
                "--batch",
                "32",
                "--text",
                str(text_file),
                "--time-limit",
                "3",
                "--json",
            ]
        )
        == 0
    )  # a million steps would take hours
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["seconds"] < 60 and load_medusa(out).num_heads == 2
    assert main(["spec", "train-medusa", "--model", str(model_dir), "--out", str(out), "--steps", "0"]) == 2


# ---- heads sharing the base model's LM head ------------------------------------------------------------------


def test_shared_head_checkpoint_round_trips_and_equals_full_heads_holding_copies_of_the_base_head(tmp_path):
    base_head = torch.randn(VOCAB, HIDDEN)
    shared = _random_heads(num_layers=2, shared=True)
    shared.share_lm_head(base_head)
    full = MedusaHeads(HIDDEN, VOCAB, 3, 2)
    full.load_state_dict(shared.state_dict(), strict=False)  # the same ResBlocks...
    full.copy_lm_head(base_head)  # ...in front of copies of the base head
    save_medusa(shared, tmp_path / "shared")
    save_medusa(full, tmp_path / "full")
    config = json.loads((tmp_path / "shared" / "config.json").read_text())
    assert config["medusa_shared_lm_head"] is True and config["vocab_size"] == VOCAB
    assert set(shared.checkpoint_state()) == {
        f"{h}.{j}.linear.{kind}" for h in range(3) for j in range(2) for kind in ("weight", "bias")
    }
    loaded = load_medusa(tmp_path / "shared")
    assert loaded.shared_lm_head and (loaded.num_heads, loaded.num_layers, loaded.hidden_size) == (3, 2, HIDDEN)
    hidden = torch.randn(5, HIDDEN)
    with pytest.raises(RuntimeError, match="share_lm_head"):
        loaded(hidden)
    loaded.share_lm_head(base_head)
    assert torch.equal(loaded(hidden), shared(hidden))
    torch.testing.assert_close(loaded(hidden), load_medusa(tmp_path / "full")(hidden), rtol=1e-5, atol=1e-5)
    # The target model's compute_logits works as the head too (what the engine passes).
    loaded.share_lm_head(lambda states: states @ base_head.t(), VOCAB)
    torch.testing.assert_close(loaded(hidden), shared(hidden), rtol=1e-5, atol=1e-5)
    assert MedusaProposer(loaded, choices=[(0,), (0, 0)]).propose([ProposalInput(0, [1], hidden[0])])[0].tokens == [
        int(shared(hidden[:1])[0, 0].argmax()),
        int(shared(hidden[:1])[0, 1].argmax()),
    ]


def test_shared_head_checkpoints_that_do_not_fit_fail_clearly(tmp_path):
    heads = _random_heads(shared=True)
    save_medusa(heads, tmp_path)
    with pytest.raises(ValueError, match=r"\[vocab, 16\]"):
        load_medusa(tmp_path).share_lm_head(torch.zeros(VOCAB, HIDDEN + 1))
    state = {**heads.checkpoint_state(), "0.1.weight": torch.zeros(VOCAB, HIDDEN)}
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match="medusa_shared_lm_head but the weights hold vocabulary projections"):
        load_medusa(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_shared_lm_head": "yes"}))
    with pytest.raises(CheckpointError, match="must be true or false"):
        load_medusa(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # projections missing and the config does not say shared
    save_file(_random_heads(shared=True).checkpoint_state(), str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match="medusa_shared_lm_head"):
        load_medusa(tmp_path)
    with pytest.raises(CheckpointError, match="builtin:smollm2"):
        load_medusa("builtin:nope")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("target"), seed=5, arch="qwen2")


def _generate(model_dir, prompts, max_tokens, spec=None, end_id=2):
    args = {
        "model": str(model_dir),
        "dtype": "float32",
        "device": DEVICE,
        "max_batch_size": 4,
        "kv_cache_config": {"tokens_per_block": 16, "max_tokens": 4096},
    }
    if spec is not None:
        args["speculative_config"] = spec
    engine = EmbeddedEngine(EngineConfig.from_dict(args))
    try:
        handles = [
            engine.generate_async(p, SamplingParams(max_tokens=n, end_id=end_id)) for p, n in zip(prompts, max_tokens)
        ]
        return [h.result().outputs[0] for h in handles]
    finally:
        engine.shutdown()


def test_engine_greedy_output_with_shared_heads_is_plain_greedy(tiny_model, tmp_path):
    hidden_size = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    torch.manual_seed(0)
    heads = MedusaHeads(hidden_size, 0, num_heads=3, shared_lm_head=True)  # random ResBlocks, no own projection
    with torch.no_grad():
        for head in heads.heads:
            head[0].linear.weight.normal_(std=0.05)
    save_medusa(heads, tmp_path / "heads")
    prompts, max_tokens = [[5, 6, 7, 8, 9, 10] * 4, [20, 21, 22], list(range(100, 140))], [40, 24, 32]
    spec = {
        "decoding_type": "Medusa",
        "speculative_model_dir": str(tmp_path / "heads"),
        "medusa_choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]],
    }
    plain, medusa = _generate(tiny_model, prompts, max_tokens), _generate(tiny_model, prompts, max_tokens, spec)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]
    metrics = [o.request_perf_metrics for o in medusa]
    assert sum(m.total_draft_tokens for m in metrics) > 0 and sum(m.total_accepted_draft_tokens for m in metrics) > 0


def test_engine_refuses_shared_heads_of_another_hidden_size(tiny_model, tmp_path):
    save_medusa(_random_heads(shared=True), tmp_path)  # hidden 16; the tiny model's is 64
    with pytest.raises(
        InvalidRequestError, match="sharing the base LM head are for hidden size 16 / vocab 50, the model has 64"
    ):
        _generate(tiny_model, [[1, 2]], [2], {"decoding_type": "Medusa", "speculative_model_dir": str(tmp_path)})


def test_shipped_smollm2_heads_load_with_smollm2_sizes():
    assert resolve_heads_dir("builtin:smollm2").is_dir()
    heads = load_medusa("builtin:smollm2")
    assert heads.shared_lm_head and (heads.num_heads, heads.num_layers) == (4, 2) and len(heads.draft_vocab) == 8192
    assert (heads.hidden_size, heads.vocab_size) == (576, 49152)  # SmolLM2-135M; checked on the model below


@pytest.mark.slow
def test_shipped_smollm2_heads_keep_greedy_output_and_get_drafts_accepted(smollm2_dir):
    from transformers import AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"]) == (576, 49152)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = (
        "What is the capital of France? Answer in one sentence.",
        "Write three short tips for staying focused while studying.",
    )
    chats = [[{"role": "user", "content": text}] for text in questions]
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        for chat in chats
    ]
    spec = {"decoding_type": "Medusa", "speculative_model_dir": "builtin:smollm2"}
    plain = _generate(smollm2_dir, prompts, [32, 48], end_id=tokenizer.eos_token_id)
    medusa = _generate(smollm2_dir, prompts, [32, 48], spec, end_id=tokenizer.eos_token_id)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]
    accepted = [o.request_perf_metrics.total_accepted_draft_tokens for o in medusa]
    assert sum(accepted) / len(accepted) > 0, accepted  # mean accepted draft tokens per request


def test_pruning_unlikely_tree_nodes_drafts_fewer_tokens_and_keeps_greedy_output(tiny_model, tmp_path):
    hidden_size = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    torch.manual_seed(0)
    heads = MedusaHeads(hidden_size, 0, num_heads=3, shared_lm_head=True)
    save_medusa(heads, tmp_path / "heads")
    prompts, max_tokens = [[5, 6, 7, 8, 9, 10] * 4, [20, 21, 22], list(range(100, 140))], [40, 24, 32]
    spec = {
        "decoding_type": "Medusa",
        "speculative_model_dir": str(tmp_path / "heads"),
        "medusa_choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]],
    }
    plain = [o.token_ids for o in _generate(tiny_model, prompts, max_tokens)]
    drafted = {}
    for threshold in (0.0, 0.002):
        outputs = _generate(tiny_model, prompts, max_tokens, {**spec, "min_path_probability": threshold})
        assert [o.token_ids for o in outputs] == plain
        drafted[threshold] = sum(o.request_perf_metrics.total_draft_tokens for o in outputs)
    assert 0 < drafted[0.002] < drafted[0.0]
