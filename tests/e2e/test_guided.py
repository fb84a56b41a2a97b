"""Guided decoding through the real tritonserver, on the tiny random-weight Llama (which never writes valid JSON, a
matching regex or a sentence of a grammar by chance, so every check fails if the guide is dropped on the way): the
session's decoupled repository (`build_repo` fills guided_decoding_backend=xgrammar by default) serves the
ensemble, the BLS and tensorrt_llm with guided_decoding_guide_type / guided_decoding_guide, streamed and not;
unguided greedy requests batched with guided ones keep their tokens; bad guides are errors naming the input; and a
repository speculating with n-gram or Medusa drafts, or through the BLS draft/target loop, keeps guided output
valid."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import e2e_clients
import pytest

from tritonllm.commands.bench_guided import schema_errors
from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.tritonserver import Ports, TritonServer

pytestmark = pytest.mark.server

BLS = "tensorrt_llm_bls"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fox"]},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
        },
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["kind", "owner", "tags"],
}
REGEX = r"(yes|no), [a-z]{2,5} [0-9]{1,3}!"
GRAMMAR = r"""
root ::= "[" item ("," item){0,3} "]"
item ::= number | word
number ::= [1-9] [0-9]?
word ::= "\"" [a-z] [a-z]? "\""
"""
GRAMMAR_LANGUAGE = r'\[(?:[1-9][0-9]?|"[a-z][a-z]?")(?:,(?:[1-9][0-9]?|"[a-z][a-z]?")){0,3}\]'
GUIDES = {
    "json_schema": (json.dumps(SCHEMA), lambda text: check_schema(json.loads(text))),
    "regex": (REGEX, lambda text: _assert(re.fullmatch(REGEX, text), text)),
    "ebnf_grammar": (GRAMMAR, lambda text: _assert(re.fullmatch(GRAMMAR_LANGUAGE, text), text)),
    "json": ("", lambda text: _assert(isinstance(json.loads(text), dict), text)),
}
MAX_TOKENS = 300  # a grammar ends well before: the output is the grammar's whole sentence


def _assert(ok, text: str) -> None:
    assert ok, f"not in the guide's language: {text!r}"


def check_schema(value) -> None:
    errors = schema_errors(SCHEMA, value, strict=True)
    assert not errors, (errors, value)


def body(guide_type: str, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    guide, _ = GUIDES[guide_type]
    return {
        "text_input": PROMPT,
        "max_tokens": max_tokens,
        "exclude_input_in_output": True,
        "guided_decoding_guide_type": guide_type,
        "guided_decoding_guide": guide,
        **extra,
    }


def text_of(server, model: str, request: dict, stream: bool) -> str:
    if stream:
        return "".join(event["text_output"] for event in server.generate_stream({**request, "stream": True}, model))
    return server.generate(request, model)["text_output"]


def direct_inputs(tokenizer, guide_type: str, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    guide, _ = GUIDES[guide_type]
    return e2e_clients.direct_request(
        tokenizer.encode(PROMPT, add_special_tokens=True),
        max_tokens,
        tokenizer.end_id,
        exclude_input_in_output=True,
        guided_decoding_guide_type=e2e_clients.strings(guide_type),
        guided_decoding_guide=e2e_clients.strings(guide),
        **extra,
    )


def direct_text(server, tokenizer, inputs: dict) -> tuple[str, list[int]]:
    reply = server.stream_infer("tensorrt_llm", inputs)
    assert reply.error is None, reply.error
    ids = [int(t) for array in reply.outputs("output_ids") for t in array.reshape(-1) if t >= 0]
    return tokenizer.decode(ids, skip_special_tokens=True), ids


# ---------------------------------------------------------------------------------------------- every model


@pytest.mark.parametrize("guide_type", list(GUIDES))
@pytest.mark.parametrize("model, stream", [("ensemble", False), ("ensemble", True), (BLS, False), (BLS, True)])
def test_the_text_models_output_follows_the_guide(server, model, stream, guide_type):
    text = text_of(server, model, body(guide_type), stream)
    GUIDES[guide_type][1](text)


@pytest.mark.parametrize("guide_type", list(GUIDES))
@pytest.mark.parametrize("streaming", [False, True])
def test_tensorrt_llm_output_ids_follow_the_guide(server, tokenizer, guide_type, streaming):
    text, ids = direct_text(server, tokenizer, direct_inputs(tokenizer, guide_type, streaming=streaming))
    GUIDES[guide_type][1](text)
    # The grammar ended the sequence at its end id, which (as at any end id) is not part of the output.
    assert len(ids) < MAX_TOKENS and tokenizer.end_id not in ids


def test_the_same_guide_gives_the_same_greedy_text_through_every_model(server, tokenizer):
    ensemble = text_of(server, "ensemble", body("json_schema"), stream=False)
    assert text_of(server, BLS, body("json_schema"), stream=True) == ensemble
    assert direct_text(server, tokenizer, direct_inputs(tokenizer, "json_schema"))[0] == ensemble


def test_too_few_tokens_end_with_a_cut_json_prefix(server, tokenizer):
    """max_tokens runs out before the grammar ends: the request ends (length) with what it has, a prefix of a
    valid answer that is not JSON yet; no hang and no error."""
    text = text_of(server, "ensemble", body("json_schema", max_tokens=6), stream=True)
    assert text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    _, ids = direct_text(server, tokenizer, direct_inputs(tokenizer, "json_schema", max_tokens=6))
    assert len(ids) == 6 and tokenizer.end_id not in ids


def test_unguided_greedy_requests_batched_with_guided_ones_keep_their_tokens(server, tokenizer):
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in ("one two three", "a b c d e", PROMPT)]
    alone = [e2e_clients.greedy_token_ids(server, ids, 24, tokenizer.end_id) for ids in prompts]
    guided = [direct_inputs(tokenizer, kind) for kind in ("json_schema", "regex", "ebnf_grammar")]
    with ThreadPoolExecutor(6) as pool:
        plain_futures = [
            pool.submit(e2e_clients.greedy_token_ids, server, ids, 24, tokenizer.end_id) for ids in prompts
        ]
        guided_futures = [pool.submit(direct_text, server, tokenizer, inputs) for inputs in guided]
        assert [future.result() for future in plain_futures] == alone
        for ids in alone:  # the tiny model's own text follows none of the guides: the checks above can fail
            for kind in ("json_schema", "regex", "ebnf_grammar"):
                with pytest.raises((AssertionError, ValueError)):
                    GUIDES[kind][1](tokenizer.decode(ids, skip_special_tokens=True))
        for future, kind in zip(guided_futures, ("json_schema", "regex", "ebnf_grammar")):
            GUIDES[kind][1](future.result()[0])


# ---------------------------------------------------------------------------------------------- bad guides


@pytest.mark.parametrize(
    "guide, words",
    [
        ({"guided_decoding_guide_type": "yaml"}, ["'guided_decoding_guide_type'", "must be one of"]),
        ({"guided_decoding_guide": "a+"}, ["'guided_decoding_guide'", "needs input 'guided_decoding_guide_type'"]),
        ({"guided_decoding_guide_type": "regex"}, ["'guided_decoding_guide'", "is required"]),
        (
            {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"type": "no-such-type"}'},
            ["'guided_decoding_guide'", "json_schema", "does not compile"],
        ),
        (
            {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{not json"},
            ["'guided_decoding_guide'", "not valid JSON"],
        ),
        (
            {"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[a-"},
            ["'guided_decoding_guide'", "regex", "does not compile"],
        ),
    ],
)
@pytest.mark.parametrize("model", ["ensemble", BLS])
def test_a_bad_guide_is_an_error_naming_the_input(server, model, guide, words):
    status, message = server.generate_error({"text_input": "Hi", "max_tokens": 5, **guide}, model=model)
    assert status == 400, message
    for word in words:
        assert word in message, message


# ---------------------------------------------------------------------------------------------- speculation


def _speculative_config(method: str, model_dir, work) -> str:
    if method == "NGram":
        return "  decoding_type: NGram\n  max_draft_len: 4\n  max_matching_ngram_size: 2\n"
    import torch

    from tritonllm.spec_decode.medusa import MedusaHeads, save_medusa

    torch.manual_seed(0)  # untrained heads, as test_speculative's: drafts that are mostly wrong
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    heads = MedusaHeads(hidden, 0, num_heads=3, shared_lm_head=True)
    for head in heads.heads:
        torch.nn.init.normal_(head[0].linear.weight, std=0.05)
    save_medusa(heads, work / "heads")
    return f"  decoding_type: Medusa\n  speculative_model_dir: {work / 'heads'}\n"


@pytest.fixture(scope="module", params=["NGram", "Medusa"])
def spec_server(request, tiny_model, tmp_path_factory):
    from tritonllm.checkpoints.tiny import build_tiny_model

    work = tmp_path_factory.mktemp(f"guided_{request.param.lower()}")
    draft = build_tiny_model(work / "draft_model", seed=7)  # for the BLS draft/target loop: other weights
    repo = build_repo(tiny_model, work / "repo", streaming=True, max_seq_len=512, draft_model_dir=draft)
    with (repo / "tensorrt_llm" / "1" / "model.yaml").open("a") as yaml_file:
        yaml_file.write("\nspeculative_config:\n" + _speculative_config(request.param, tiny_model, work))
    triton = TritonServer(repo, Ports.free(), log_file=work / "tritonserver.log")
    triton.start(timeout=180)
    try:
        live = e2e_clients.LiveServer(triton, work / "tritonserver.log", 512)
        live.method = request.param  # type: ignore[attr-defined]
        yield live
    finally:
        triton.stop()


def test_speculation_keeps_guided_output_valid_and_greedy_tokens(server, spec_server, tokenizer):
    for kind in ("json_schema", "regex"):
        want = direct_text(server, tokenizer, direct_inputs(tokenizer, kind))
        got = direct_text(spec_server, tokenizer, direct_inputs(tokenizer, kind, return_perf_metrics=True))
        GUIDES[kind][1](got[0])
        assert got == want, "greedy guided decoding drafts only what the target, masked, would take"
    assert text_of(spec_server, "ensemble", body("ebnf_grammar"), stream=True) == text_of(
        server, "ensemble", body("ebnf_grammar"), stream=True
    )
    ids = tokenizer.encode("a b c d e f g a b c d e f g a b c", add_special_tokens=True)
    assert e2e_clients.greedy_token_ids(spec_server, ids, 20, tokenizer.end_id) == e2e_clients.greedy_token_ids(
        server, ids, 20, tokenizer.end_id
    )
    reply = spec_server.stream_infer("tensorrt_llm", direct_inputs(tokenizer, "json", return_perf_metrics=True))
    assert reply.error is None, reply.error
    if spec_server.method == "Medusa":  # n-gram drafts only where the text repeats itself
        assert int(reply.outputs("total_draft_tokens")[-1].reshape(-1)[0]) > 0, "the guided request was speculated"


@pytest.mark.parametrize("stream", [False, True])
def test_the_bls_draft_target_loop_keeps_guided_output_valid(server, spec_server, stream):
    """Each round's target call continues the guide past the tokens so far (guided_decoding_prefix_len); the
    unguided draft's tokens that the grammar forbids are rejected. Greedy: the plain ensemble's guided text."""
    for kind in ("json_schema", "regex"):
        want = text_of(server, "ensemble", body(kind), stream=False)
        got = text_of(spec_server, BLS, body(kind, num_draft_tokens=3), stream)
        GUIDES[kind][1](got)
        assert got == want
