"""EAGLE-1/2 drafts: the checkpoint format round-trips (safetensors and .bin), bad folders fail naming the tensor or
setting, the proposer's drafts are the draft layer's own argmax / top-k (against a dense reference of the layer;
EAGLE-2's dynamic tree too), and through the engine greedy output with Eagle, and with EAGLE-3 drafts (the rest of
their tests: test_eagle3.py), equals plain greedy output (chains, static and dynamic trees, tiny Llama and Qwen2,
chunked prefill with prefix reuse, preemption, requests joining mid-flight, CUDA graphs, aborts), with drafts
counted per request and every KV block (the target's and the draft layer's) free afterwards. A target whose next
token depends only on the current one, with a draft layer that computes the same function, gets every top-1 draft
accepted. TRITONLLM_TEST_DEVICE=cuda runs the engine and the proposer on the GPU (the CPU is the default)."""

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.network.model_config import ModelLoadError
from tritonllm.engine.embedded.speculation.eagle import load_eagle, random_eagle, save_eagle
from tritonllm.engine.embedded.speculation.eagle3 import random_eagle3
from tritonllm.engine.embedded.speculation.eagle_proposer import EagleProposer
from tritonllm.engine.types import InvalidRequestError, SamplingParams
from tritonllm.spec_decode.proposer import ProposalInput

from .test_engine_spec import SETTINGS  # plain, chunked prefill with prefix reuse, preempting
from .test_engine_spec import assert_all_blocks_free as assert_target_blocks_free
from .test_engine_spec import make_engine as spec_engine

BLOCK = 4
PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [20, 21, 22], list(range(100, 160)), [300, 301, 302, 303, 304, 305, 306]]
MAX_TOKENS = [40, 30, 36, 25]
TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return {
        arch: build_tiny_model(tmp_path_factory.mktemp(f"target_{arch}"), seed=5, arch=arch)
        for arch in ("llama", "qwen2")
    }


@pytest.fixture(scope="module")
def eagles(tmp_path_factory, targets):
    return {
        arch: random_eagle(target, tmp_path_factory.mktemp(f"eagle_{arch}"), seed=1) for arch, target in targets.items()
    }


@pytest.fixture(scope="module")
def eagle3s(tmp_path_factory, targets):
    """EAGLE-3 drafts reading both of the tiny targets' layers (EAGLE-3's default layers need more)."""
    return {
        arch: random_eagle3(
            target, tmp_path_factory.mktemp(f"eagle3_{arch}"), seed=1, draft_vocab_size=400, capture_layers=[0, 1]
        )
        for arch, target in targets.items()
    }


def make_engine(model_dir, spec=None, **overrides):
    """test_engine_spec's engine on the test device (TRITONLLM_TEST_DEVICE)."""
    return spec_engine(model_dir, spec, **{"device": DEVICE, **overrides})


def eagle_spec(eagle_dir, tree=False, version="Eagle", **extra):
    """A chain (tree False), the static TREE (True) or EAGLE-2's dynamic tree ("dynamic"); `version` Eagle3 for an
    EAGLE-3 draft."""
    spec = {"decoding_type": version, "speculative_model_dir": str(eagle_dir), "max_draft_len": 3, **extra}
    if tree == "dynamic":
        spec.update(use_dynamic_tree=True, dynamic_tree_max_topK=2, max_total_draft_tokens=5)
    elif tree:
        spec["eagle_choices"] = TREE
    return spec


def run_batch(engine, prompts=PROMPTS, join_late=False):
    """All prompts at once, or (join_late) the last ones sent once the first request streams tokens."""
    params = [SamplingParams(max_tokens=n, end_id=2) for n in MAX_TOKENS[: len(prompts)]]
    if not join_late:
        handles = [engine.generate_async(p, sp) for p, sp in zip(prompts, params)]
    else:
        first = engine.generate_async(prompts[0], params[0], streaming=True)
        next(iter(first))  # its first token is out: the others join a running batch
        handles = [first] + [engine.generate_async(p, sp) for p, sp in zip(prompts[1:], params[1:])]
    return [h.result().outputs[0] for h in handles]


def assert_all_blocks_free(engine):
    assert_target_blocks_free(engine)  # the target's cache and the draft layer's own
    assert not engine.core.speculator.method.proposer.shadows


@pytest.fixture(scope="module")
def references(targets):
    result = {}
    for arch, target in targets.items():
        engine = make_engine(target)
        try:
            result[arch] = [o.token_ids for o in run_batch(engine)]
        finally:
            engine.shutdown()
    return result


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("tree", [False, True, "dynamic"], ids=["chain", "tree", "dynamic"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("version", ["Eagle", "Eagle3"])
def test_greedy_output_is_plain_greedy(targets, eagles, eagle3s, references, version, arch, tree, setting):
    drafts = eagles if version == "Eagle" else eagle3s
    engine = make_engine(targets[arch], eagle_spec(drafts[arch], tree, version), **SETTINGS[setting])
    try:
        outputs = run_batch(engine, join_late=setting == "plain")
        assert [o.token_ids for o in outputs] == references[arch]
        metrics = [o.request_perf_metrics for o in outputs]
        assert sum(m.total_draft_tokens > 0 for m in metrics) >= (2 if setting == "chunked_reuse" else 4)
        if setting == "preempting":
            assert sum(m.num_preemptions for m in metrics) > 0
        if setting == "chunked_reuse":
            again = run_batch(engine)  # prompts now come from the prefix cache: the draft sees a shorter context
            assert [o.token_ids for o in again] == references[arch]
            assert sum(o.request_perf_metrics.kv_cache_reused_blocks for o in again) > 0
            # (16-token steps: drafts of the sequences scheduled last do not fit and are cut or dropped)
            assert sum(o.request_perf_metrics.total_draft_tokens > 0 for o in again) >= 2
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("version", ["Eagle", "Eagle3"])
def test_target_steps_in_cuda_graphs_stay_plain_greedy(
    targets, eagles, eagle3s, references, version, tree, graphs_on_this_device
):
    drafts = eagles if version == "Eagle" else eagle3s
    engine = make_engine(
        targets["llama"],
        eagle_spec(drafts["llama"], tree, version),
        cuda_graph_config={"batch_sizes": [1, 2, 4], "enable_padding": True},
    )
    try:
        assert [o.token_ids for o in run_batch(engine)] == references["llama"]
        assert any(rows > 1 for _, rows, _ in engine.core.runner.graphs.graphs)  # verification in graphs
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_aborted_and_sampled_requests_release_the_draft_state(targets, eagles):
    engine = make_engine(targets["qwen2"], eagle_spec(eagles["qwen2"], tree=True))
    try:
        handle = engine.generate_async(
            PROMPTS[2], SamplingParams(max_tokens=200, end_id=2, ignore_eos=True), streaming=True
        )
        stream = iter(handle)
        next(stream), next(stream)
        handle.abort()
        sampled = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.9, seed=3))
        assert len(sampled.outputs[0].token_ids) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


# ---- a target the draft layer can mimic exactly ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bigram(tmp_path_factory, targets):
    """A Llama whose layers add nothing (o_proj and down_proj zero) and whose final norm has unit scales, so its
    next token is argmax(lm_head(embed(t))); and a draft layer computing exactly that for the token it is fed
    (fc passes the embedding through, its attention and MLP add nothing)."""
    target = tmp_path_factory.mktemp("bigram")
    for path in targets["llama"].iterdir():
        shutil.copy(path, target / path.name)
    weights = load_file(str(target / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    eagle_dir = random_eagle(target, tmp_path_factory.mktemp("bigram_eagle"), seed=2)
    draft = load_eagle(eagle_dir)
    hidden = draft.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, :hidden] = torch.eye(hidden)
        draft.fc.bias.zero_()
        draft.layer.self_attn.o_proj.weight.zero_()
        draft.layer.mlp.down_proj.weight.zero_()
    config = json.loads((eagle_dir / "config.json").read_text())
    return target, save_eagle(draft, eagle_dir, config)


@pytest.mark.parametrize("tree", [False, True, "dynamic"], ids=["chain", "tree", "dynamic"])
def test_a_draft_that_mimics_the_target_gets_every_top1_draft_accepted(bigram, tree):
    target, eagle_dir = bigram
    plain, spec = make_engine(target), make_engine(target, eagle_spec(eagle_dir, tree))
    try:
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        want = [plain.generate(p, params).outputs[0] for p in PROMPTS]
        got = [spec.generate(p, params).outputs[0] for p in PROMPTS]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for out in got:
            m = out.request_perf_metrics
            if tree:  # the top-1 path is accepted, its siblings are not (3 accepted of 6 per full static tree)
                assert 0 < m.total_accepted_draft_tokens < m.total_draft_tokens
            else:
                assert m.total_draft_tokens > 0 and m.total_accepted_draft_tokens == m.total_draft_tokens
            # Every step commits its accepted drafts plus one token: 30 tokens in 30 - accepted steps. The dynamic
            # tree always keeps the best depth-1 node (no node scores above it), deeper ones by their scores.
            assert m.total_accepted_draft_tokens >= (15 if tree == "dynamic" else 20)
        assert_all_blocks_free(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


# ---- the proposer against a dense reference of the draft layer ------------------------------------------------


def dense_layer(draft, embeds, features, positions):
    """The draft layer over one whole causal sequence, without the paged cache (an independent reference)."""
    layer, attn = draft.layer, draft.layer.self_attn
    x = F.linear(torch.cat((embeds, features), -1), draft.fc.weight, draft.fc.bias)
    qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
    q, k, v = qkv.split(attn.split_sizes, dim=-1)
    cos, sin = draft.rotary_emb(positions, x.dtype)

    def rotate(t, heads):
        t = t.view(len(positions), heads, attn.head_dim)
        half = attn.head_dim // 2
        return t * cos[:, None] + torch.cat((-t[..., half:], t[..., :half]), -1) * sin[:, None]

    q, k = rotate(q, attn.num_heads), rotate(k, attn.num_kv_heads)
    v = v.view(len(positions), attn.num_kv_heads, attn.head_dim)
    repeat = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    out = (
        F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=attn.scale
        )
        .transpose(0, 1)
        .reshape(len(positions), -1)
    )
    x = x + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def reference_outputs(draft, target, tokens, features, first):
    """output(drafted): the draft layer's output after the committed inputs from position `first` and then the
    `drafted` tokens (each fed with the output before it); () is the root's."""
    embed = target.embed_tokens.weight
    committed = list(range(first, len(tokens) - 1))
    base_embeds = embed[torch.tensor([tokens[j + 1] for j in committed], device=embed.device)]
    base_features = features[first : len(tokens) - 1]

    def output(drafted):
        embeds = torch.cat([base_embeds] + [embed[[t]] for t in drafted])
        feats = torch.cat([base_features] + [output(drafted[:i])[None] for i in range(len(drafted))])
        positions = committed + [len(tokens) - 2 + depth for depth in range(1, len(drafted) + 1)]
        return dense_layer(draft, embeds, feats, torch.tensor(positions, device=embed.device))[-1]

    return output


def reference_tree(draft, target, tokens, features, first, paths, k):
    """Each static tree node's token: the top-k of its parent's output."""
    output = reference_outputs(draft, target, tokens, features, first)

    def drafted(path):
        return tuple(token(path[:depth]) for depth in range(1, len(path) + 1))

    def token(path):
        logits = target.compute_logits(output(drafted(path[:-1]))[None])[0]
        return logits.topk(k).indices[path[-1]].item()

    return [token(tuple(p)) for p in paths]


def reference_dynamic(draft, target, tokens, features, first, k, depth, total):
    """EAGLE-2's tree: (tokens, parents) of the `total` best nodes, expanding the k best of each depth."""
    output = reference_outputs(draft, target, tokens, features, first)

    def children(score, drafted):
        logp = torch.log_softmax(target.compute_logits(output(drafted)[None])[0], -1)
        values, indices = logp.topk(k)
        return [(score + v, drafted + (t,)) for v, t in zip(values.tolist(), indices.tolist())]

    frontier = children(0.0, ())
    nodes = list(frontier)
    for _ in range(1, depth):
        grown = [child for score, drafted in frontier for child in children(score, drafted)]
        nodes += grown
        frontier = sorted(grown, key=lambda node: -node[0])[:k]
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], len(nodes[i][1]), i))[:total]
    kept = sorted(order, key=lambda i: (len(nodes[i][1]), i))
    index = {nodes[i][1]: n for n, i in enumerate(kept)}
    return ([nodes[i][1][-1] for i in kept], [index.get(nodes[i][1][:-1], -1) for i in kept])


@pytest.mark.parametrize(
    "choices",
    [None, TREE, [[0], [1], [0, 0], [1, 0], [1, 1], [0, 0, 0], [1, 0, 0]]],
    ids=["chain", "tree", "wide_tree"],
)
def test_drafts_are_the_draft_layers_own_top_k(targets, eagles, choices):
    torch.manual_seed(0)
    target, target_config = load_model(targets["qwen2"], torch.float32, DEVICE)
    draft = load_eagle(eagles["qwen2"], device=DEVICE, target=target_config)
    proposer = EagleProposer(
        draft, target, 3, choices, num_blocks=64, block_size=BLOCK, dtype=torch.float32, device=torch.device(DEVICE)
    )
    dynamic = EagleProposer(
        draft,
        target,
        3,
        None,
        num_blocks=64,
        block_size=BLOCK,
        dtype=torch.float32,
        device=torch.device(DEVICE),
        dynamic_top_k=2,
        total_tokens=5,
    )
    tokens = [int(t) for t in torch.randint(3, 900, (30,))]
    features = torch.randn(len(tokens), draft.hidden_size).to(DEVICE) * 2
    paths = sorted(choices or [[0], [0, 0], [0, 0, 0]], key=lambda p: (len(p), p))  # the tree's node order
    k = max(max(p) for p in paths) + 1
    # A shadow that starts at position 3 (a reused prefix), is fed in uneven pieces and drafts three times.
    proposer.observe(7, 3, features[3:10])
    for end in (12, 19, 30):
        proposer.observe(7, proposer.shadows[7].next_position, features[proposer.shadows[7].next_position : end - 1])
        (tree,) = proposer.propose([ProposalInput(7, tokens[:end])])
        assert tree.tokens == reference_tree(draft, target, tokens[:end], features, 3, paths, k)
        assert proposer.shadows[7].num_stable == end - 1 - 3  # drafted slots dropped
        if choices is None:  # EAGLE-2's dynamic tree (top-k 2, 3 deep, 5 nodes) over the same inputs
            start = dynamic.shadows[7].next_position if 7 in dynamic.shadows else 3
            dynamic.observe(7, start, features[start : end - 1])
            (tree,) = dynamic.propose([ProposalInput(7, tokens[:end])])
            assert (tree.tokens, tree.parents) == reference_dynamic(draft, target, tokens[:end], features, 3, 2, 3, 5)
    (short,) = proposer.propose([ProposalInput(7, tokens, max_draft_tokens=2)])
    assert len(short) == 0  # nothing new observed since the last proposal: no draft
    proposer.release(7)
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


# ---- the checkpoint folder ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pickle", [False, True], ids=["safetensors", "bin"])
def test_round_trip_and_ignored_embedding(targets, eagles, tmp_path, pickle):
    draft = load_eagle(eagles["llama"])
    config = json.loads((eagles["llama"] / "config.json").read_text())
    save_eagle(draft, tmp_path, config, pickle=pickle)
    if pickle:
        state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
        state["embed_tokens.weight"] = torch.zeros(config["vocab_size"], config["hidden_size"])
        torch.save(state, tmp_path / "pytorch_model.bin")
    again = load_eagle(tmp_path)
    assert set(again.checkpoint_state()) == set(draft.checkpoint_state())
    for key, value in draft.checkpoint_state().items():
        assert torch.equal(again.checkpoint_state()[key], value), key
    assert {
        "fc.weight",
        "fc.bias",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= set(draft.checkpoint_state())
    assert not any("input_layernorm" in key for key in draft.checkpoint_state())
    qwen = load_eagle(eagles["qwen2"]).checkpoint_state()
    assert "layers.0.self_attn.q_proj.bias" in qwen and "layers.0.self_attn.o_proj.bias" not in qwen


def test_bad_folders_name_what_is_wrong(targets, eagles, tmp_path):
    _, target_config = load_model(targets["llama"], torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_eagle(tmp_path)
    shutil.copy(eagles["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no model.safetensors or pytorch_model.bin"):
        load_eagle(tmp_path)
    good = load_file(str(eagles["llama"] / "model.safetensors"))

    def write(state, config_changes=None):
        save_file(state, str(tmp_path / "model.safetensors"))
        config = json.loads((eagles["llama"] / "config.json").read_text())
        config.update(config_changes or {})
        (tmp_path / "config.json").write_text(json.dumps(config))

    write({k: v for k, v in good.items() if k != "layers.0.mlp.up_proj.weight"})
    with pytest.raises(ModelLoadError, match=f"{tmp_path}: EAGLE weights lack layers.0.mlp.up_proj.weight"):
        load_eagle(tmp_path)
    write({k: v for k, v in good.items() if k != "fc.bias"})
    with pytest.raises(ModelLoadError, match='lack fc.bias.*"bias": false'):
        load_eagle(tmp_path)
    write({k: v for k, v in good.items() if k != "fc.bias"}, {"bias": False})
    assert load_eagle(tmp_path).fc.bias is None
    write({**good, "fc.weight": good["fc.weight"][:, :10].contiguous()})
    with pytest.raises(ModelLoadError, match=r"EAGLE tensor fc.weight has shape \[64, 10\], expected \[64, 128\]"):
        load_eagle(tmp_path)
    write({**good, "layers.0.input_layernorm.weight": torch.ones(64)})
    with pytest.raises(ModelLoadError, match="unexpected tensor layers.0.input_layernorm.weight"):
        load_eagle(tmp_path)
    write({**good, "midlayer.hidden_norm.weight": torch.ones(64)})
    with pytest.raises(ModelLoadError, match="EAGLE-3 draft.*only EAGLE-1/2"):
        load_eagle(tmp_path)
    write(good, {"hidden_size": 32})
    with pytest.raises(ModelLoadError, match="hidden_size is 32, the target's 64"):
        load_eagle(tmp_path, target=target_config)
    write(good, {"vocab_size": 77})
    with pytest.raises(ModelLoadError, match="vocab_size is 77, the target's"):
        load_eagle(tmp_path, target=target_config)
    write(good, {"num_hidden_layers": 2})
    with pytest.raises(ModelLoadError, match="num_hidden_layers is 2; an EAGLE-1/2 draft has one layer"):
        load_eagle(tmp_path)


def test_engine_errors_name_the_key(targets, eagles, tmp_path):
    with pytest.raises(InvalidRequestError, match="speculative_config.speculative_model_dir: .*no config.json"):
        make_engine(targets["llama"], eagle_spec(tmp_path))
    with pytest.raises(InvalidRequestError, match="speculative_model_dir: .*the draft's vocab_size is"):
        make_engine(targets["llama"], eagle_spec(_other_size_eagle(eagles["llama"], tmp_path)))
    with pytest.raises(InvalidRequestError, match="an EAGLE-1/2 draft .*use decoding_type Eagle for it"):
        make_engine(targets["llama"], {"decoding_type": "Eagle3", "speculative_model_dir": str(eagles["llama"])})


def _other_size_eagle(eagle_dir, tmp_path):
    out = tmp_path / "other"
    shutil.copytree(eagle_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] += 5
    (out / "config.json").write_text(json.dumps(config))
    return out


# ---- the command line -----------------------------------------------------------------------------------------


def test_generate_json_lines_report_draft_counts(bigram, tmp_path, capsys):
    from tritonllm.commands.main import main as cli_main

    target, eagle_dir = bigram
    config = tmp_path / "model.yaml"
    config.write_text(
        f"speculative_config:\n  decoding_type: Eagle\n  max_draft_len: 3\n  speculative_model_dir: {eagle_dir}\n"
    )
    assert (
        cli_main(
            [
                "generate",
                "--model",
                str(target),
                "--config",
                str(config),
                "--prompt",
                "hello there",
                "--prompt",
                "a b c d",
                "--max-tokens",
                "12",
                "--json",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(records) == 2
    for record in records:
        stats = record["stats"]
        assert stats["total_draft_tokens"] > 0 and stats["total_accepted_draft_tokens"] > 0


def test_bench_spec_runs_with_eagle(targets, eagles, capsys):
    from tritonllm.commands.main import main as cli_main

    assert (
        cli_main(
            [
                "bench",
                "spec",
                "--model",
                str(targets["qwen2"]),
                "--method",
                "eagle",
                "--spec-model-dir",
                str(eagles["qwen2"]),
                "--draft-len",
                "2",
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
    assert result["method"] == "Eagle" and result["identical_outputs"]
    assert result["speculative_config"]["max_draft_len"] == 2
