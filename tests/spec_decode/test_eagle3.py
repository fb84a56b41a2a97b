"""EAGLE-3 drafts in the engine (`decoding_type: Eagle3`): the target returns the outputs of the layers the draft
reads, equal to transformers' hidden states; the proposer's drafts, and those the engine proposes from the target's
captured layers, are a dense reference's; a draft over the whole vocabulary keeps greedy output too (the greedy
tests of chains and trees under every scheduler setting and in CUDA graphs are test_eagle.py's, for both versions);
configurations that cannot work fail naming the key.
TRITONLLM_TEST_DEVICE=cuda runs the engines on the GPU (the CPU is the default)."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tritonllm.engine.embedded.attention import step_metadata
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.speculation.eagle import random_eagle
from tritonllm.engine.embedded.speculation.eagle3 import load_eagle3, random_eagle3
from tritonllm.engine.embedded.speculation.eagle_proposer import EagleProposer
from tritonllm.engine.types import InvalidRequestError
from tritonllm.spec_decode.proposer import ProposalInput

from .test_eagle import DEVICE, TREE, eagle3s, eagle_spec, make_engine, references, run_batch, targets  # noqa: F401 (fixtures)
from .test_eagle3_format import dense_layer, rms_norm

CAPTURE = [0, 1]  # the layers test_eagle's EAGLE-3 drafts read: EAGLE-3's default (1, L//2 - 1, L - 4) needs more


def test_captured_layers_are_the_layer_outputs_transformers_returns(targets):
    from transformers import AutoModelForCausalLM

    ids = list(range(40, 60))
    reference = AutoModelForCausalLM.from_pretrained(targets["llama"], dtype=torch.float32)
    with torch.inference_mode():
        states = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states  # layer inputs, then norm
    model, config = load_model(targets["llama"], torch.float32, torch.device("cpu"))
    model.capture_layers = (0, 1)
    block = 4
    shape = (8, block, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    attn = step_metadata(
        list(range(len(ids))), [list(range(8))], [0], [len(ids)], [len(ids)], block, [None], "cpu", torch.float32
    )
    with torch.inference_mode():
        out = model(torch.tensor(ids), torch.arange(len(ids)), attn, caches)
    hidden = config.hidden_size
    assert out.shape == (len(ids), 3 * hidden)
    torch.testing.assert_close(out[:, :hidden], states[-1][0], atol=1e-5, rtol=1e-5)  # the final norm's output
    torch.testing.assert_close(out[:, hidden : 2 * hidden], states[1][0], atol=1e-5, rtol=1e-5)  # layer 0's output
    torch.testing.assert_close(model.norm(out[:, 2 * hidden :]), states[2][0], atol=1e-5, rtol=1e-5)  # layer 1's


def reference_tokens(state, target, tokens, features, first, paths):
    """Each tree node's token, from a dense run of the draft: committed positions `first ..` are fed with fc of the
    target's features, drafted nodes with their parent's output; a node is its parent's rank-r draft token."""
    embed = target.embed_tokens.weight.cpu()
    committed = list(range(first, len(tokens) - 1))
    base_h = F.linear(features[first : len(tokens) - 1].cpu(), state["fc.weight"])

    def output(drafted):
        embeds = embed[torch.tensor([tokens[j + 1] for j in committed] + list(drafted))]
        h = torch.cat([base_h] + [output(drafted[:i])[None] for i in range(len(drafted))])
        positions = torch.tensor(committed + [len(tokens) - 2 + depth for depth in range(1, len(drafted) + 1)])
        return dense_layer(state, embeds, h, positions)[-1]

    def ranked(drafted, rank):
        logits = F.linear(rms_norm(output(drafted), state["norm.weight"]), state["lm_head.weight"])
        draft_id = int(logits.topk(rank + 1).indices[rank])
        return draft_id + int(state["d2t"][draft_id])

    result = {}
    for path in paths:
        result[path] = ranked(tuple(result[path[:i]] for i in range(1, len(path))), path[-1])
    return [result[path] for path in paths]


@pytest.mark.parametrize("choices", [None, TREE], ids=["chain", "tree"])
def test_drafts_are_the_draft_layers_own_top_k(targets, eagle3s, choices):
    torch.manual_seed(0)
    target, target_config = load_model(targets["llama"], torch.float32, DEVICE)
    draft = load_eagle3(eagle3s["llama"], torch.float32, DEVICE, target_config, target_config.num_layers)
    state = load_file(str(eagle3s["llama"] / "model.safetensors"))
    proposer = EagleProposer(
        draft, target, 3, choices, num_blocks=64, block_size=4, dtype=torch.float32, device=torch.device(DEVICE)
    )
    tokens = [int(t) for t in torch.randint(3, 900, (30,))]
    features = torch.randn(len(tokens), len(CAPTURE) * target_config.hidden_size).to(DEVICE) * 2
    paths = sorted(tuple(p) for p in choices or [[0], [0, 0], [0, 0, 0]])
    paths.sort(key=lambda p: (len(p), p))  # the tree's node order
    proposer.observe(7, 3, features[3:10])  # a shadow from position 3 (a reused prefix), fed in uneven pieces
    for end in (12, 19, 30):
        proposer.observe(7, proposer.shadows[7].next_position, features[proposer.shadows[7].next_position : end - 1])
        (tree,) = proposer.propose([ProposalInput(7, tokens[:end])])
        assert tree.tokens == reference_tokens(state, target, tokens[:end], features, 3, paths)
    proposer.release(7)
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_the_engine_feeds_the_draft_the_targets_captured_layers(targets, eagle3s):
    """Every draft the engine proposed equals the dense reference fed with the target's captured layers computed
    over the whole sequence at once (the engine computed them step by step, chunk by chunk)."""
    proposed = []
    engine = make_engine(
        targets["llama"], eagle_spec(eagle3s["llama"], version="Eagle3"), max_num_tokens=16, enable_chunked_prefill=True
    )
    try:
        proposer = engine.core.speculator.method.proposer
        propose = proposer.propose

        def recording(batch):
            trees = propose(batch)
            proposed.extend((list(item.token_ids), tree.tokens) for item, tree in zip(batch, trees) if len(tree))
            return trees

        proposer.propose = recording
        output = run_batch(engine, prompts=[list(range(40, 75))])[0]
    finally:
        engine.shutdown()
    assert len(proposed) > 5 and len(output.token_ids) > 5
    target, config = load_model(targets["llama"], torch.float32, torch.device("cpu"))
    target.capture_layers = tuple(CAPTURE)
    state = load_file(str(eagle3s["llama"] / "model.safetensors"))
    paths = [(0,), (0, 0), (0, 0, 0)]
    for tokens, drafted in proposed:
        features = captured_layers(target, config, tokens[:-1])
        assert drafted == reference_tokens(state, target, tokens, features, 0, paths)[: len(drafted)]


def captured_layers(target, config, ids):
    """The target's captured layer outputs of `ids`, one causal pass."""
    block = 4
    blocks = (len(ids) + block - 1) // block
    shape = (blocks, block, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    attn = step_metadata(
        list(range(len(ids))), [list(range(blocks))], [0], [len(ids)], [len(ids)], block, [None], "cpu", torch.float32
    )
    with torch.inference_mode():
        return target(torch.tensor(ids), torch.arange(len(ids)), attn, caches)[:, config.hidden_size :]


def test_a_draft_over_the_whole_vocabulary_is_plain_greedy_too(targets, references, tmp_path):
    draft = random_eagle3(targets["llama"], tmp_path / "full_vocab", seed=3, capture_layers=CAPTURE)
    engine = make_engine(targets["llama"], eagle_spec(draft, version="Eagle3"))
    try:
        outputs = run_batch(engine)
        assert [o.token_ids for o in outputs] == references["llama"]
        assert sum(o.request_perf_metrics.total_draft_tokens for o in outputs) > 0
    finally:
        engine.shutdown()


def test_configuration_errors_name_the_key(targets, eagle3s, tmp_path):
    eagle1 = random_eagle(targets["llama"], tmp_path / "eagle1", seed=1)
    with pytest.raises(InvalidRequestError, match="speculative_model_dir.*decoding_type.*Eagle"):
        make_engine(targets["llama"], eagle_spec(eagle1, version="Eagle3"))
    with pytest.raises(InvalidRequestError, match="speculative_model_dir.*Eagle3"):
        make_engine(
            targets["llama"],
            {"decoding_type": "Eagle", "speculative_model_dir": str(eagle3s["llama"]), "max_draft_len": 3},
        )
    with pytest.raises(InvalidRequestError, match="layer"):
        make_engine(targets["llama"], eagle_spec(eagle3s["llama"], version="Eagle3", eagle3_layers_to_capture=[0, 5]))


def test_bench_spec_runs_with_eagle3(targets, eagle3s, capsys):
    from tritonllm.commands.main import main as cli_main

    assert (
        cli_main(
            [
                "bench",
                "spec",
                "--model",
                str(targets["llama"]),
                "--method",
                "eagle3",
                "--spec-model-dir",
                str(eagle3s["llama"]),
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
    assert result["method"] == "Eagle3" and result["identical_outputs"]
    assert result["speculative_config"]["max_draft_len"] == 2
