"""EAGLE-3 drafts: the checkpoint format round-trips (safetensors and .bin), the draft layer through a paged cache
matches a dense reference written from the checkpoint's own tensors (features from the target through fc, and the
draft's own output without it), its head scores with its lm_head and proposes target ids through d2t, and bad
folders fail naming the tensor or setting. The tiny targets have two layers, too few for the default capture
layers, so their drafts name theirs; a config-only eight-layer target covers the default (three layers, fc 3H)."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tritonllm.engine.embedded.attention import step_metadata
from tritonllm.engine.embedded.network.model_config import ModelConfig, ModelLoadError
from tritonllm.engine.embedded.speculation.eagle import load_eagle, random_eagle
from tritonllm.engine.embedded.speculation.eagle3 import load_eagle3, random_eagle3, save_eagle3

from .test_eagle import targets  # noqa: F401 (fixture: the tiny Llama and Qwen2 targets)

BLOCK = 4
TWO_LAYERS = (0, 1)
DEEP_LAYERS = 8


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory, targets):
    """The tiny Llama's config.json with eight layers: enough for the default capture layers (1, 3, 4)."""
    folder = tmp_path_factory.mktemp("deep_target")
    config = json.loads((targets["llama"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": DEEP_LAYERS}))
    return folder


@pytest.fixture(scope="module")
def eagles(tmp_path_factory, targets, deep_target):
    def make(name, target, **options):
        return random_eagle3(target, tmp_path_factory.mktemp(name), seed=1, **options)

    return {
        "llama": make("eagle3_llama", targets["llama"], draft_vocab_size=100, capture_layers=TWO_LAYERS),
        "qwen2": make("eagle3_qwen2", targets["qwen2"], capture_layers=TWO_LAYERS),
        "deep": make("eagle3_deep", deep_target, draft_vocab_size=100),
    }


def target_config(target_dir):
    return ModelConfig.from_dict(json.loads((target_dir / "config.json").read_text()))


def load(eagle_dir, target_dir, **options):
    config = target_config(target_dir)
    return load_eagle3(eagle_dir, torch.float32, "cpu", target=config, target_num_layers=config.num_layers, **options)


# ---- the checkpoint folder ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pickle", [False, True], ids=["safetensors", "bin"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_round_trip(targets, eagles, tmp_path, arch, pickle):
    saved = load_file(str(eagles[arch] / "model.safetensors"))
    draft = load(eagles[arch], targets[arch])
    assert draft.capture_layers == TWO_LAYERS
    # vLLM's key names the layers whose inputs are captured: the outputs of the layers before them
    config = json.loads((eagles[arch] / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [layer + 1 for layer in TWO_LAYERS]
    state = draft.checkpoint_state()
    assert set(state) == set(saved)
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    config = json.loads((eagles[arch] / "config.json").read_text())
    save_eagle3(draft, tmp_path, config, pickle=pickle)
    assert (tmp_path / ("pytorch_model.bin" if pickle else "model.safetensors")).is_file()
    again = load(tmp_path, targets[arch]).checkpoint_state()
    for key, value in saved.items():
        assert torch.equal(again[key], value), key


def test_the_format_s_shapes_and_draft_vocabulary(targets, eagles):
    saved = load_file(str(eagles["llama"] / "model.safetensors"))
    hidden, q_size = 64, 4 * 16
    assert list(saved["fc.weight"].shape) == [hidden, 2 * hidden]  # two captured target layers
    assert list(saved["midlayer.self_attn.q_proj.weight"].shape) == [q_size, 2 * hidden]
    assert list(saved["midlayer.self_attn.k_proj.weight"].shape) == [2 * 16, 2 * hidden]
    assert list(saved["lm_head.weight"].shape) == [100, hidden]
    assert not any(key.endswith("bias") for key in saved)
    ids = torch.arange(100) + saved["d2t"]
    assert saved["d2t"].dtype == torch.int64 and torch.all(ids[1:] > ids[:-1])
    assert int(ids.max()) < target_config(targets["llama"]).vocab_size
    assert torch.equal(
        load_file(str(eagles["qwen2"] / "model.safetensors"))["d2t"],
        torch.zeros(target_config(targets["qwen2"]).vocab_size, dtype=torch.long),
    )  # the whole vocabulary by default


def test_capture_layers_come_from_the_config_the_argument_or_the_default(targets, eagles, deep_target):
    assert load(eagles["deep"], deep_target).capture_layers == (1, 3, 4)
    assert load(eagles["llama"], targets["llama"], capture_layers=[1, 0]).capture_layers == (0, 1)
    deep = load(eagles["deep"], deep_target, capture_layers=(6, 0, 2))
    assert deep.capture_layers == (0, 2, 6)


# ---- the layer against a dense reference ----------------------------------------------------------------------


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta=10000.0):
    """HF Llama's rotary embedding: rotate_half over pairs (i, i + head_dim / 2)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def dense_draft(state, embeds, features, positions):
    """The EAGLE-3 draft over one whole causal sequence, from the checkpoint's tensors alone."""
    h = F.linear(features, state["fc.weight"]) if features.shape[-1] != embeds.shape[-1] else features
    return dense_layer(state, embeds, h, positions)


def dense_layer(state, embeds, h, positions, heads=4, kv_heads=2, head_dim=16):
    """The draft's layer over one causal sequence whose rows' features are already H wide (`h`)."""
    w = {key.removeprefix("midlayer."): value for key, value in state.items()}
    tokens = embeds.shape[0]
    x = torch.cat((rms_norm(embeds, w["input_layernorm.weight"]), rms_norm(h, w["hidden_norm.weight"])), -1)
    q = rotate(F.linear(x, w["self_attn.q_proj.weight"]).view(tokens, heads, head_dim), positions)
    k = rotate(F.linear(x, w["self_attn.k_proj.weight"]).view(tokens, kv_heads, head_dim), positions)
    v = F.linear(x, w["self_attn.v_proj.weight"]).view(tokens, kv_heads, head_dim)
    k, v = (t.repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for t in (k, v))
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / head_dim**0.5
    scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(tokens, -1)
    h = h + F.linear(out, w["self_attn.o_proj.weight"])
    y = rms_norm(h, w["post_attention_layernorm.weight"])
    gated = F.silu(F.linear(y, w["mlp.gate_proj.weight"])) * F.linear(y, w["mlp.up_proj.weight"])
    return h + F.linear(gated, w["mlp.down_proj.weight"])


def paged_forward(draft, embeds, features, positions, pieces):
    """The draft fed in consecutive pieces of one sequence (slot i holds position i), through a zeroed cache."""
    config = draft.config
    shape = (8, BLOCK, config.num_kv_heads, config.head_dim)
    cache = (torch.zeros(shape), torch.zeros(shape))
    outputs, start = [], 0
    for length in pieces:
        end = start + length
        attn = step_metadata(
            list(range(start, end)), [list(range(8))], [0], [length], [end], BLOCK, [None], "cpu", torch.float32
        )
        outputs.append(draft(embeds[start:end], features[start:end], positions[start:end], attn, cache))
        start = end
    return torch.cat(outputs)


@pytest.mark.parametrize("pieces", [[13], [6, 7], [5, 1, 7]], ids=["whole", "two", "three"])
@pytest.mark.parametrize("width", ["target", "own"])
@pytest.mark.parametrize("eagle", ["deep", "llama"])
def test_the_layer_matches_a_dense_reference(targets, eagles, deep_target, eagle, width, pieces):
    torch.manual_seed(0)
    draft = load(eagles[eagle], deep_target if eagle == "deep" else targets["llama"])
    state = load_file(str(eagles[eagle] / "model.safetensors"))
    tokens = sum(pieces)
    # The target's features: three captured layers (the default) or two; the draft's own output: H wide.
    feature_size = {"deep": 3 * 64, "llama": 2 * 64}[eagle] if width == "target" else draft.hidden_size
    embeds, features = torch.randn(tokens, 64), torch.randn(tokens, feature_size) * 2
    positions = torch.arange(tokens) + 3  # positions need not start at 0: a reused prefix
    with torch.no_grad():
        got = paged_forward(draft, embeds, features, positions, pieces)
    torch.testing.assert_close(got, dense_draft(state, embeds, features, positions), rtol=0, atol=1e-5)


def test_the_head_scores_with_its_own_lm_head_and_maps_through_d2t(targets, eagles):
    draft = load(eagles["llama"], targets["llama"])
    state = load_file(str(eagles["llama"] / "model.safetensors"))
    head = draft.make_head(target=None)  # EAGLE-3 drafts never use the target's head
    hidden = torch.randn(5, 64)
    with torch.no_grad():
        logits = head.logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, 100)
    want = F.linear(rms_norm(hidden, state["norm.weight"]), state["lm_head.weight"])
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    indices = torch.tensor([0, 7, 99, 7])
    assert torch.equal(head.token_ids(indices), indices + state["d2t"][indices])


# ---- bad folders ----------------------------------------------------------------------------------------------


def test_bad_folders_name_what_is_wrong(targets, eagles, tmp_path):
    source, target = eagles["llama"], targets["llama"]
    good = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())

    def write(state, config_changes=None):
        save_file(state, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))

    def fails(match, **options):
        with pytest.raises(ModelLoadError, match=match):
            load(tmp_path, target, **options)

    write({k: v for k, v in good.items() if k != "midlayer.hidden_norm.weight"})
    fails(f"{tmp_path}: EAGLE-3 weights lack midlayer.hidden_norm.weight")
    write({**good, "fc.weight": good["fc.weight"][:, :10].contiguous()})
    fails(r"EAGLE-3 tensor fc.weight has shape \[64, 10\], expected \[64, 128\]")
    write({**good, "midlayer.self_attn.q_proj.weight": good["midlayer.self_attn.q_proj.weight"][:, :64].clone()})
    fails(r"midlayer.self_attn.q_proj.weight has shape \[64, 64\], expected \[64, 128\]")
    write({**good, "midlayer.self_attn.q_proj.bias": torch.zeros(64)})
    fails("unexpected tensor midlayer.self_attn.q_proj.bias in the EAGLE-3 weights")
    write(
        {
            **good,
            "t2d": torch.ones(config["vocab_size"], dtype=torch.bool),
            "embed_tokens.weight": torch.zeros(config["vocab_size"], 64),
        }
    )
    load(tmp_path, target)  # the format's optional tensors are ignored
    write({**good, "d2t": good["d2t"] + 5000})
    fails(r"d2t maps draft ids outside the vocabulary \[0, ")
    write({**good, "d2t": good["d2t"][:50].clone()})
    fails(r"d2t must hold 100 integer offsets \(draft_vocab_size\), got shape \[50\]")
    write({k: v for k, v in good.items() if k != "d2t"})
    fails("lack d2t, which a draft_vocab_size")
    write(good, {"target_hidden_size": 32})
    fails("the draft's target_hidden_size is 32, the target's 64")
    write(good, {"vocab_size": 77})
    fails("the draft's vocab_size is 77, the target's")
    write(good, {"num_hidden_layers": 2})
    fails("num_hidden_layers is 2; an EAGLE-3 draft has one layer")
    write(good, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}})  # the inputs of layers 1 and 3
    fails(r"capture layer 2 is outside the target's layers \[0, 2\)")
    write(good, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2]}})
    fails(r"eagle_aux_hidden_state_layer_ids must list target layers >= 1")
    fails(r"capture layer 5 is outside", capture_layers=[0, 5])  # eagle3_layers_to_capture overrides the config
    fails(r"capture layers \[1, 1\] must be at least two distinct", capture_layers=[1, 1])
    write(good, {"eagle_config": {}})
    fails(
        r"default capture layers \[1, 0, -2\] do not fit a target of 2 layers; set "
        r"eagle_aux_hidden_state_layer_ids"
    )


def test_the_wrong_eagle_version_is_refused_naming_the_right_one(targets, eagles, tmp_path):
    eagle12 = random_eagle(targets["llama"], tmp_path / "eagle12", seed=1)
    with pytest.raises(
        ModelLoadError, match="an EAGLE-1/2 draft .*layers.0.*use decoding_type Eagle for it, not Eagle3"
    ):
        load(eagle12, targets["llama"], capture_layers=TWO_LAYERS)
    with pytest.raises(ModelLoadError, match="an EAGLE-3 draft .*use decoding_type: Eagle3"):
        load_eagle(eagles["llama"])
    with pytest.raises(ModelLoadError, match="default capture layers"):
        random_eagle3(targets["llama"], tmp_path / "too_shallow")
