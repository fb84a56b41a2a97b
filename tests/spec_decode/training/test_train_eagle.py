"""Training EAGLE drafts, and draft vocabularies (EAGLE and Medusa).

The trainer's dense passes equal the engine's paged draft layer, pass by pass (pass k at row j is what drafting k
deep computes: the committed rows' keys, then the draft's own nodes); a short CLI run on a tiny model writes a
draft the engine loads, and greedy output with it is plain greedy output. A draft vocabulary restricts what is
drafted to its tokens (the top-k come from its rows alone), leaves greedy output exact, and bad ones are refused
naming the tensor. The shipped SmolLM2 draft loads (and, slow, keeps greedy output with drafts accepted), and
`bench spec --method medusa` prunes the heads' default tree."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.commands.main import main
from tritonllm.engine.embedded.attention import step_metadata
from tritonllm.engine.embedded.network.model_config import ModelLoadError
from tritonllm.engine.embedded.speculation.eagle import load_eagle, random_eagle
from tritonllm.engine.types import InvalidRequestError, SamplingParams
from tritonllm.spec_decode.checkpoint_files import CheckpointError, frequent_tokens
from tritonllm.spec_decode.medusa import MedusaHeads, load_medusa, save_medusa
from tritonllm.spec_decode.training.train_eagle import dense_passes

from ..test_eagle import eagle_spec, make_engine, run_batch

BLOCK = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("target"), seed=5, arch="llama")


@pytest.fixture(scope="module")
def plain_outputs(target):
    engine = make_engine(target)
    try:
        return [o.token_ids for o in run_batch(engine)]
    finally:
        engine.shutdown()


def paged(draft, embed, tokens, features, positions):
    """The engine's draft layer over one sequence in a fresh paged cache (causal, like a prompt)."""
    config = draft.config
    blocks = len(tokens) // BLOCK + 1
    cache = tuple(torch.zeros(blocks, BLOCK, config.num_kv_heads, config.head_dim) for _ in range(2))
    attn = step_metadata(
        list(range(len(tokens))),
        [list(range(blocks))],
        [0],
        [len(tokens)],
        [len(tokens)],
        BLOCK,
        [None],
        "cpu",
        torch.float32,
    )
    return draft(embed[torch.tensor(tokens)], features, torch.tensor(positions), attn, cache)


def test_dense_passes_equal_the_paged_draft_layer_drafting_k_deep(target, tmp_path):
    draft = load_eagle(random_eagle(target, tmp_path, seed=3))
    torch.manual_seed(0)
    vocab, hidden = draft.config.vocab_size, draft.hidden_size
    embed, width = torch.randn(vocab, hidden), 14
    ids, features = torch.randint(0, vocab, (1, width)), torch.randn(1, width, hidden)
    first, second, third = dense_passes(draft, embed, ids, features, 3)
    tokens = ids[0].tolist()
    committed = paged(draft, embed, tokens[1:], features[0, :-1], list(range(width - 1)))
    torch.testing.assert_close(first[0, :-1], committed, atol=1e-5, rtol=1e-5)
    for j in (0, 4, 9):  # drafting from root j + 1: rows 0..j committed, then the draft's own nodes
        context = tokens[1 : j + 2]
        two = paged(
            draft,
            embed,
            context + [tokens[j + 2]],
            torch.cat([features[0, : j + 1], first[0, j : j + 1]]),
            list(range(j + 2)),
        )
        torch.testing.assert_close(two[-1], second[0, j], atol=1e-5, rtol=1e-5)
        three = paged(
            draft,
            embed,
            context + tokens[j + 2 : j + 4],
            torch.cat([features[0, : j + 1], first[0, j : j + 1], second[0, j : j + 1]]),
            list(range(j + 3)),
        )
        torch.testing.assert_close(three[-1], third[0, j], atol=1e-5, rtol=1e-5)


def test_cli_trains_a_draft_that_keeps_greedy_output_exact(target, plain_outputs, tmp_path, capsys):
    out = tmp_path / "draft"
    assert (
        main(
            [
                "spec",
                "train-eagle",
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
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["draft_vocab"] == 40 and len(report["depth_accuracy"]) == 3 and report["tokens"] > 0
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 40
    draft = load_eagle(out)
    assert draft.draft_vocab.tolist() == sorted(set(draft.draft_vocab.tolist())) and len(draft.draft_vocab) == 40
    assert_plain_greedy_with_drafts(target, eagle_spec(out, tree=True), plain_outputs)


def assert_plain_greedy_with_drafts(target, spec, plain_outputs):
    """With `spec` the engine drafts, and its greedy output is still `plain_outputs`."""
    engine = make_engine(target, spec)
    try:
        outputs = run_batch(engine)
        assert [o.token_ids for o in outputs] == plain_outputs
        assert sum(o.request_perf_metrics.total_draft_tokens for o in outputs) > 0
    finally:
        engine.shutdown()


def test_eagle_drafts_come_from_the_draft_vocabulary_only(target, plain_outputs, tmp_path):
    folder = random_eagle(target, tmp_path / "draft", seed=1)
    state = load_file(str(folder / "model.safetensors"))
    state["draft_vocab"] = torch.arange(3, 300, 7)
    save_file(state, str(folder / "model.safetensors"))
    engine = make_engine(target, eagle_spec(folder, tree="dynamic"))
    proposer = engine.core.speculator.method.proposer
    proposed = []
    original = proposer._tree
    proposer._tree = lambda plan: proposed.append(original(plan)) or proposed[-1]
    try:
        assert [o.token_ids for o in run_batch(engine)] == plain_outputs
    finally:
        engine.shutdown()
    allowed = set(range(3, 300, 7))
    assert proposed and all(set(tree.tokens) <= allowed for tree in proposed)


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.tensor([1.0, 2.0]), "non-empty 1-D tensor of token ids"),
        (torch.tensor([4, 4, 5]), "repeats token ids"),
        (torch.tensor([1, 100000]), r"outside the vocabulary \[0, "),
    ],
)
def test_bad_draft_vocabularies_are_refused_naming_the_tensor(target, tmp_path, bad, message):
    folder = random_eagle(target, tmp_path / "eagle", seed=1)
    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, "draft_vocab": bad}, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"EAGLE tensor draft_vocab .*{message}"):
        load_eagle(folder)
    heads = MedusaHeads(16, 50, 2)
    save_medusa(heads, tmp_path / "medusa", draft_vocab=torch.tensor([1, 2]))
    state = load_file(str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))
    save_file({**state, "draft_vocab": bad}, str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match=f"Medusa tensor draft_vocab .*{message}"):
        load_medusa(tmp_path / "medusa")


def test_medusa_heads_with_own_projections_guess_within_their_vocabulary(tmp_path):
    torch.manual_seed(0)
    heads = MedusaHeads(16, 50, 2)
    for projection in heads.projections():
        torch.nn.init.normal_(projection.weight)
    vocab = torch.tensor([3, 8, 20, 33, 41])
    save_medusa(heads, tmp_path, draft_vocab=vocab)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 5
    loaded = load_medusa(tmp_path)
    hidden = torch.randn(6, 16)
    best = heads(hidden)[..., vocab].topk(2, dim=-1).indices  # the full heads' ranking among the vocabulary
    assert torch.equal(loaded.top_k(hidden, 2), vocab[best])


def test_engine_greedy_output_with_shared_medusa_heads_and_a_vocabulary(target, plain_outputs, tmp_path):
    hidden_size = json.loads((target / "config.json").read_text())["hidden_size"]
    torch.manual_seed(0)
    heads = MedusaHeads(hidden_size, 0, num_heads=3, shared_lm_head=True)
    save_medusa(heads, tmp_path, draft_vocab=torch.arange(0, 256, 2))
    spec = {
        "decoding_type": "Medusa",
        "speculative_model_dir": str(tmp_path),
        "medusa_choices": [[0], [1], [0, 0], [0, 0, 0]],
    }
    engine = make_engine(target, spec)
    try:
        outputs = run_batch(engine)
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outputs] == plain_outputs
    assert sum(o.request_perf_metrics.total_draft_tokens for o in outputs) > 0
    save_medusa(heads, tmp_path, draft_vocab=torch.tensor([1, 10**6]))
    with pytest.raises(InvalidRequestError, match="draft_vocab holds token ids past the model's vocabulary"):
        make_engine(target, spec)


def test_frequent_tokens_are_the_most_counted_ties_to_the_lower_id():
    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    assert frequent_tokens(counts, 3).tolist() == [0, 2, 5]
    assert frequent_tokens(counts, 4).tolist() == [0, 2, 3, 5]


def test_shipped_smollm2_draft_loads_with_smollm2_sizes_and_its_vocabulary():
    draft = load_eagle("builtin:smollm2")
    assert (draft.hidden_size, draft.config.vocab_size, draft.config.num_layers) == (576, 49152, 1)
    assert len(draft.draft_vocab) == 8192
    with pytest.raises(ModelLoadError, match="no built-in EAGLE drafts named 'nope'"):
        load_eagle("builtin:nope")


@pytest.mark.slow
def test_shipped_smollm2_draft_keeps_greedy_output_and_gets_drafts_accepted(smollm2_dir):
    from transformers import AutoTokenizer

    from tritonllm.spec_decode.training.distill import bench_requests, chat_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [chat_ids(tokenizer, request) for request in bench_requests("chat", 2)]
    spec = {"decoding_type": "Eagle", "speculative_model_dir": "builtin:smollm2", "max_draft_len": 3}
    outputs = {}
    for name, config in (("plain", None), ("eagle", spec)):
        engine = make_engine(smollm2_dir, config, kv_cache_config={"tokens_per_block": 16, "max_tokens": 4096})
        try:
            handles = [
                engine.generate_async(p, SamplingParams(max_tokens=48, end_id=tokenizer.eos_token_id)) for p in prompts
            ]
            outputs[name] = [h.result().outputs[0] for h in handles]
        finally:
            engine.shutdown()
    assert [o.token_ids for o in outputs["eagle"]] == [o.token_ids for o in outputs["plain"]]
    metrics = [o.request_perf_metrics for o in outputs["eagle"]]
    accepted = sum(m.total_accepted_draft_tokens for m in metrics)
    drafted = sum(m.total_draft_tokens for m in metrics)
    assert accepted > 0.2 * drafted  # a trained draft: well above chance on questions it never saw


def test_bench_spec_medusa_prunes_the_heads_default_tree_on_the_chat_task(target, tmp_path, capsys):
    hidden_size = json.loads((target / "config.json").read_text())["hidden_size"]
    save_medusa(MedusaHeads(hidden_size, 0, num_heads=2, shared_lm_head=True), tmp_path)
    assert (
        main(
            [
                "bench",
                "spec",
                "--model",
                str(target),
                "--method",
                "medusa",
                "--spec-model-dir",
                str(tmp_path),
                "--task",
                "chat",
                "--prompts",
                "1",
                "--max-tokens",
                "8",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])
    assert result["task"] == "chat" and result["identical_outputs"]
    assert result["speculative_config"]["min_path_probability"] == 0.15
    assert len(result["per_prompt"]) == 1 and result["per_prompt"][0]["output_tokens"] > 0
