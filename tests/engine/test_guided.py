"""Guided decoding (guided_decoding_backend: xgrammar) in the embedded engine, on the tiny random-weight Llama, which
never writes valid JSON, a matching regex or a sentence of a grammar by chance: every check below fails if the
token bitmask is not applied. Also the seam's GuidedDecodingParams and the engine argument."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.commands.bench_guided import schema_errors
from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.embedded import guided
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.engine_core import needs_host_tokens
from tritonllm.engine.types import GuidedDecodingParams, InvalidRequestError, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
        },
    },
    "required": ["name", "kind", "tags", "owner"],
}
REGEX = r"(yes|no), [a-z]{2,5} [0-9]{1,3}!"
# A grammar with rules, alternatives and repetition; LIST_LANGUAGE is the same language as a regular expression.
LIST_GRAMMAR = r"""
root ::= "[" item ("," item){0,3} "]"
item ::= number | word
number ::= [1-9] [0-9]?
word ::= "\"" [a-z] [a-z]? "\""
"""
LIST_LANGUAGE = r'\[(?:[1-9][0-9]?|"[a-z][a-z]?")(?:,(?:[1-9][0-9]?|"[a-z][a-z]?")){0,3}\]'
# TRITONLLM_TEST_DEVICE=cuda runs the engine on the GPU (the bitmask applied on the device).
DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")
GREEDY = {}
SAMPLED = {"temperature": 1.0, "seed": 5}


def engine_config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig.from_dict(
        {
            "model": str(model_dir),
            "dtype": "float32",
            "device": DEVICE,
            "max_batch_size": 8,
            "max_seq_len": 512,
            "max_num_tokens": 256,
            "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 4096},
            **overrides,
        }
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3, arch="llama")


@pytest.fixture(scope="module")
def setup(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = EmbeddedEngine(engine_config(model_dir, guided_decoding_backend="xgrammar", max_beam_width=3))
    yield engine, tokenizer, tokenizer.encode(PROMPT)
    stats = engine.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.core.guided.matchers == {}
    engine.shutdown()


def generate(engine, ids, guide: GuidedDecodingParams, **params):
    params.setdefault("max_tokens", 400)
    return engine.generate(ids, SamplingParams(guided_decoding=guide, **params)).outputs


def text(tokenizer, output) -> str:
    return tokenizer.decode(output.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def finished_text(tokenizer, output) -> str:
    assert output.finish_reason == "stop", (output.finish_reason, text(tokenizer, output))
    return text(tokenizer, output)


def check_schema(schema: dict, value) -> None:
    errors = schema_errors(schema, value, strict=True)
    assert not errors, (errors, value)


# -- output in the language -------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_schema_output_parses_and_validates(setup, sampling):
    engine, tokenizer, ids = setup
    (out,) = generate(engine, ids, GuidedDecodingParams(json=SCHEMA), **sampling)
    check_schema(SCHEMA, json.loads(finished_text(tokenizer, out)))
    assert out.stop_reason == tokenizer.eos_token_id  # ended at the grammar's stop token, which is not returned
    assert tokenizer.eos_token_id not in out.token_ids


def test_json_schema_as_text_gives_the_same_greedy_output(setup):
    engine, tokenizer, ids = setup
    (as_dict,) = generate(engine, ids, GuidedDecodingParams(json=SCHEMA))
    (as_text,) = generate(engine, ids, GuidedDecodingParams(json=json.dumps(SCHEMA)))
    assert as_text.token_ids == as_dict.token_ids


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_object_output_is_an_object(setup, sampling):
    engine, tokenizer, ids = setup
    (out,) = generate(engine, ids, GuidedDecodingParams(json_object=True), max_tokens=400, **sampling)
    assert isinstance(json.loads(finished_text(tokenizer, out)), dict)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_regex_output_fully_matches(setup, sampling):
    engine, tokenizer, ids = setup
    (out,) = generate(engine, ids, GuidedDecodingParams(regex=REGEX), **sampling)
    assert re.fullmatch(REGEX, finished_text(tokenizer, out))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_ebnf_grammar_output_is_in_the_language(setup, sampling):
    engine, tokenizer, ids = setup
    (out,) = generate(engine, ids, GuidedDecodingParams(grammar=LIST_GRAMMAR), **sampling)
    assert re.fullmatch(LIST_LANGUAGE, finished_text(tokenizer, out))


def test_structural_tag_output_follows_the_tag(setup):
    engine, tokenizer, ids = setup
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "content": {"type": "regex", "pattern": "[0-9]{1,3}"},
            "end": "</answer>",
        },
    }
    (out,) = generate(engine, ids, GuidedDecodingParams(structural_tag=tag))
    assert re.fullmatch(r"<answer>[0-9]{1,3}</answer>", finished_text(tokenizer, out))


def test_n_samples_each_follow_the_grammar(setup):
    engine, tokenizer, ids = setup
    outputs = generate(engine, ids, GuidedDecodingParams(regex=REGEX), n=3, temperature=2.0, seed=11)
    texts = [finished_text(tokenizer, out) for out in outputs]
    assert all(re.fullmatch(REGEX, t) for t in texts)
    assert len(set(texts)) > 1  # one matcher per sample: they go their own ways


@pytest.mark.parametrize(
    "guide, language",
    [(GuidedDecodingParams(regex=REGEX), REGEX), (GuidedDecodingParams(grammar=LIST_GRAMMAR), LIST_LANGUAGE)],
)
def test_beam_search_keeps_every_beam_in_the_language(setup, guide, language):
    engine, tokenizer, ids = setup
    outputs = generate(engine, ids, guide, beam_width=3, n=3, max_tokens=60)
    texts = [finished_text(tokenizer, out) for out in outputs]
    assert all(re.fullmatch(language, t) for t in texts), texts
    assert len(set(texts)) == 3  # forked beams follow their own grammar states
    assert engine.wait_idle().num_free_blocks == engine.stats().num_total_blocks
    assert engine.core.guided.matchers == {}


def test_beam_search_output_validates_against_the_schema(setup):
    engine, tokenizer, ids = setup
    outputs = generate(engine, ids, GuidedDecodingParams(json=SCHEMA), beam_width=2, n=2)
    for out in outputs:
        check_schema(SCHEMA, json.loads(finished_text(tokenizer, out)))


def test_min_tokens_leaves_the_end_to_the_grammar(setup):
    engine, tokenizer, ids = setup
    # With end_id set, min_tokens would ban the one token the finished grammar allows.
    end_id = tokenizer.eos_token_id
    (out,) = generate(engine, ids, GuidedDecodingParams(regex=REGEX), min_tokens=100, end_id=end_id)
    assert re.fullmatch(REGEX, finished_text(tokenizer, out)) and out.stop_reason == end_id


def test_too_few_tokens_end_with_length(setup):
    engine, tokenizer, ids = setup
    (out,) = generate(engine, ids, GuidedDecodingParams(json=SCHEMA), max_tokens=4)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert text(tokenizer, out).startswith("{")


def test_an_unguided_request_in_the_batch_is_unchanged(setup):
    engine, tokenizer, ids = setup
    plain = SamplingParams(max_tokens=40)
    alone = engine.generate(ids, plain).outputs[0].token_ids
    other = tokenizer.encode("Once upon a time")
    guided_handle = engine.generate_async(
        other, SamplingParams(max_tokens=400, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    )
    plain_handle = engine.generate_async(ids, plain)
    assert plain_handle.result().outputs[0].token_ids == alone
    check_schema(SCHEMA, json.loads(finished_text(tokenizer, guided_handle.result().outputs[0])))
    assert not re.fullmatch(REGEX, tokenizer.decode(alone))


def test_a_reused_prefix_keeps_the_guided_output(setup):
    """The second request finds the prompt's blocks in the cache; its grammar starts from the output, as before."""
    engine, tokenizer, ids = setup
    params = SamplingParams(max_tokens=400, guided_decoding=GuidedDecodingParams(json=SCHEMA), return_perf_metrics=True)
    first = engine.generate(ids * 4, params).outputs[0]
    again = engine.generate(ids * 4, params).outputs[0]
    assert again.request_perf_metrics.kv_cache_reused_blocks > 0
    assert again.token_ids == first.token_ids
    check_schema(SCHEMA, json.loads(finished_text(tokenizer, again)))


def test_abort_frees_the_matcher_and_the_kv_blocks(setup):
    engine, _, ids = setup
    handle = engine.generate_async(
        ids, SamplingParams(max_tokens=300, guided_decoding=GuidedDecodingParams(json_object=True)), streaming=True
    )
    first = next(iter(handle))
    assert not first.finished
    handle.abort()
    assert handle.result().outputs[0].finish_reason == "cancelled"
    stats = engine.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.core.guided.matchers == {}


def test_compiled_grammars_are_cached_per_guide(setup):
    engine, _, ids = setup
    decoder = engine.core.guided
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    before = decoder.num_compiled
    generate(engine, ids, GuidedDecodingParams(json=schema), max_tokens=20)
    generate(engine, ids, GuidedDecodingParams(json=dict(schema)), max_tokens=20)
    assert decoder.num_compiled == before + 1
    generate(engine, ids, GuidedDecodingParams(regex="a"), max_tokens=4)
    assert decoder.num_compiled == before + 2


def test_a_continued_output_picks_up_the_grammar_after_its_prefix(setup):
    """guided_prefix_len: the BLS draft/target loop sends the text so far as the prompt; the rest then follows the
    grammar from where the prefix left it, and greedy halves join to the whole greedy output."""
    engine, tokenizer, ids = setup
    guide = GuidedDecodingParams(json=SCHEMA)
    (whole,) = generate(engine, ids, guide)
    cut = len(whole.token_ids) // 2
    (second,) = generate(engine, ids + whole.token_ids[:cut], guide, guided_prefix_len=cut)
    assert whole.token_ids[:cut] + second.token_ids == whole.token_ids
    (unguided_tail,) = generate(engine, ids + whole.token_ids[:cut], guide)  # the grammar starts over: it differs
    assert unguided_tail.token_ids != second.token_ids


def test_a_prefix_that_breaks_the_grammar_is_refused(setup):
    engine, tokenizer, ids = setup
    with pytest.raises(InvalidRequestError, match="guided_prefix_len: token .* does not follow the guide"):
        engine.generate_async(
            ids, SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[0-9]+"), guided_prefix_len=3)
        )
    with pytest.raises(InvalidRequestError, match="guided_prefix_len=99 exceeds the prompt"):
        engine.generate_async(
            ids,
            SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(json_object=True), guided_prefix_len=99),
        )
    with pytest.raises(InvalidRequestError, match="guided_prefix_len continues a guided output"):
        SamplingParams(guided_prefix_len=2).validate()


# -- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "guide, named",
    [
        (
            GuidedDecodingParams(json={"type": "no-such-type"}),
            r"guided_decoding\.json \(JSON schema\) does not compile",
        ),
        (GuidedDecodingParams(regex="[a-"), r"guided_decoding\.regex does not compile"),
        (GuidedDecodingParams(grammar='root ::= "a" |'), r"guided_decoding\.grammar \(EBNF\) does not compile"),
        (GuidedDecodingParams(grammar='start ::= "a"'), r"guided_decoding\.grammar \(EBNF\) does not compile"),
        (GuidedDecodingParams(structural_tag='{"type": "structural_tag"}'), r"guided_decoding\.structural_tag"),
    ],
)
def test_a_guide_that_does_not_compile_is_refused_before_any_step(setup, guide, named):
    engine, _, ids = setup
    steps = engine.wait_idle().num_steps
    with pytest.raises(InvalidRequestError, match=named):
        engine.generate_async(ids, SamplingParams(max_tokens=8, guided_decoding=guide))
    assert engine.wait_idle().num_steps == steps


def test_an_engine_without_a_backend_refuses_guided_requests(model_dir):
    engine = EmbeddedEngine(engine_config(model_dir))
    try:
        assert engine.core.guided is None
        with pytest.raises(InvalidRequestError, match="guided_decoding_backend"):
            engine.generate_async([5, 6, 7], SamplingParams(guided_decoding=GuidedDecodingParams(regex="a")))
        assert engine.generate([5, 6, 7], SamplingParams(max_tokens=2)).outputs[0].length == 2
    finally:
        engine.shutdown()


def test_speculative_drafts_are_verified_under_the_grammar(setup, model_dir):
    reference, tokenizer, ids = setup
    guides = [GuidedDecodingParams(json=SCHEMA), GuidedDecodingParams(regex=REGEX)]
    expected = [generate(reference, ids, guide)[0].token_ids for guide in guides]
    engine = EmbeddedEngine(
        engine_config(
            model_dir,
            guided_decoding_backend="xgrammar",
            speculative_config={"decoding_type": "NGram", "max_draft_len": 4},
        )
    )
    try:
        outputs = [generate(engine, ids, guide, return_perf_metrics=True)[0] for guide in guides]
        # Greedy speculation gives the plain greedy output: each row chosen under the grammar as it stands.
        assert [out.token_ids for out in outputs] == expected
        assert outputs[0].request_perf_metrics.total_draft_tokens > 0  # JSON's repeats give the n-grams drafts
        (sampled,) = generate(engine, ids, guides[0], **SAMPLED)
        check_schema(SCHEMA, json.loads(finished_text(tokenizer, sampled)))
        assert engine.core.guided.matchers == {}
    finally:
        engine.shutdown()


def test_an_external_draft_token_the_grammar_rejects_is_rejected(setup):
    engine, tokenizer, ids = setup
    guide = GuidedDecodingParams(regex=REGEX)
    (plain,) = generate(engine, ids, guide)
    (never,) = tokenizer.encode("#")  # no output of REGEX holds it
    drafts = plain.token_ids[:3] + [never] + plain.token_ids[4:8]
    (out,) = generate(engine, ids, guide, draft_tokens=drafts, return_perf_metrics=True)
    assert out.token_ids == plain.token_ids
    assert out.request_perf_metrics.total_accepted_draft_tokens == 3


def test_preemption_and_chunked_prefill_keep_guided_outputs(setup, model_dir):
    reference, tokenizer, _ = setup
    prompts = [tokenizer.encode(p) for p in (PROMPT, "Once upon a time there was", "Seven small birds sang")]
    # Long enough that three do not fit in the cache together (the outputs may end at the length limit).
    params = SamplingParams(max_tokens=60, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    expected = [reference.generate(ids, params).outputs[0].token_ids for ids in prompts]
    longest = max(len(ids) for ids in prompts) + params.max_tokens
    engine = EmbeddedEngine(
        engine_config(
            model_dir,
            guided_decoding_backend="xgrammar",
            enable_chunked_prefill=True,
            max_num_tokens=8,
            kv_cache_config={"tokens_per_block": 4, "max_tokens": longest + 8},
            scheduler_config={"capacity_scheduler_policy": "MAX_UTILIZATION"},
        )
    )
    try:
        timed = SamplingParams(**{**vars(params), "return_perf_metrics": True})
        outputs = [h.result().outputs[0] for h in [engine.generate_async(ids, timed) for ids in prompts]]
        assert [out.token_ids for out in outputs] == expected
        assert all(text(tokenizer, out).startswith("{") for out in outputs)
        assert sum(out.request_perf_metrics.num_preemptions for out in outputs) > 0
        assert engine.core.guided.matchers == {}
    finally:
        engine.shutdown()


def test_guided_requests_keep_the_overlap_scheduler_waiting_for_their_tokens():
    assert needs_host_tokens(SamplingParams(guided_decoding=GuidedDecodingParams(json_object=True)))
    assert not needs_host_tokens(SamplingParams(guided_decoding=GuidedDecodingParams()))


# -- the mask itself ----------------------------------------------------------------------------------------------


def test_the_torch_mask_used_off_the_host_equals_xgrammars_kernel():
    vocab, rows = 1000, [0, 2]
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab, generator=generator)
    by_kernel, by_torch = logits.clone(), logits.clone()
    guided.apply_bitmask(by_kernel, bitmask, rows, vocab)
    guided.mask_with_torch(by_torch, bitmask, rows, vocab)
    assert torch.equal(by_kernel, by_torch)
    assert torch.equal(by_torch[1], logits[1])  # an unguided row is left alone
    allowed = guided.unpack_bitmask(bitmask[:1], vocab)[0]
    assert torch.isinf(by_torch[0][~allowed]).all() and torch.equal(by_torch[0][allowed], logits[0][allowed])


def test_json_whitespace_between_elements_is_bounded(setup):
    """A weak model left free would fill its budget with blanks; JSON_MAX_WHITESPACE caps each run of them."""
    import xgrammar

    decoder = setup[0].core.guided
    for guide in (GuidedDecodingParams(json=SCHEMA), GuidedDecodingParams(json_object=True)):
        matcher = xgrammar.GrammarMatcher(decoder.compile(guide))
        assert matcher.accept_string("{" + " " * guided.JSON_MAX_WHITESPACE)
        assert not matcher.accept_string(" ")


def test_masks_filled_on_the_thread_pool_equal_those_filled_row_by_row(setup):
    import xgrammar

    decoder = setup[0].core.guided
    texts = ['{"name": "a', "{", '{"name": "ab", "kind": "c', '{"name": "", "kind": "dog", "tags": [1', '{"na']
    seqs = [SimpleNamespace(seq_id=-1 - index) for index in range(len(texts) + 1)]  # the last one unguided
    for seq, prefix in zip(seqs, texts):
        decoder.matchers[seq.seq_id] = matcher = xgrammar.GrammarMatcher(
            decoder.compile(GuidedDecodingParams(json=SCHEMA))
        )
        assert matcher.accept_string(prefix)
    try:
        logits = torch.randn(len(seqs), decoder.vocab_size, generator=torch.Generator().manual_seed(1))
        together = logits.clone()
        decoder.mask(together, seqs)  # len(texts) >= BATCH_FILL_ROWS: the thread pool
        assert len(texts) >= guided.BATCH_FILL_ROWS
        for row, seq in enumerate(seqs):
            alone = logits[row : row + 1].clone()
            decoder.mask(alone, [seq])
            assert torch.equal(alone[0], together[row])
        assert torch.equal(together[-1], logits[-1])
        assert all(torch.isinf(together[row]).any() for row in range(len(texts)))
    finally:
        for seq in seqs:
            decoder.matchers.pop(seq.seq_id, None)


# -- the seam -----------------------------------------------------------------------------------------------------


def test_guided_decoding_params_take_at_most_one_guide():
    with pytest.raises(InvalidRequestError, match="at most one of"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a", json_object=True)).validate()
    with pytest.raises(InvalidRequestError, match=r"guided_decoding\.json is not valid JSON"):
        GuidedDecodingParams(json="{not json").validate()
    with pytest.raises(InvalidRequestError, match=r"guided_decoding\.regex must be str"):
        GuidedDecodingParams(regex=3).validate()
    assert not SamplingParams(guided_decoding=GuidedDecodingParams()).guided


@pytest.mark.parametrize(
    "guide_type, guide, expected",
    [
        ("json", None, GuidedDecodingParams(json_object=True)),
        ("json_schema", '{"type": "object"}', GuidedDecodingParams(json='{"type": "object"}')),
        ("regex", "a+", GuidedDecodingParams(regex="a+")),
        ("ebnf_grammar", 'root ::= "a"', GuidedDecodingParams(grammar='root ::= "a"')),
        (
            "structural_tag",
            '{"type": "structural_tag"}',
            GuidedDecodingParams(structural_tag='{"type": "structural_tag"}'),
        ),
    ],
)
def test_the_executors_guide_types_map_onto_the_fields(guide_type, guide, expected):
    params = GuidedDecodingParams.from_guide(guide_type, guide)
    assert params == expected
    assert params.guide() == (guide_type, guide or "")


def test_an_unknown_guide_type_or_a_missing_guide_is_refused_naming_the_input():
    with pytest.raises(InvalidRequestError, match="guided_decoding_guide_type must be one of"):
        GuidedDecodingParams.from_guide("xml", "<a/>")
    with pytest.raises(InvalidRequestError, match="needs a guided_decoding_guide"):
        GuidedDecodingParams.from_guide("regex", "")


def test_the_engine_argument_is_checked():
    assert EngineConfig.from_dict({"model": "m"}).guided_decoding_backend is None
    with pytest.raises(ConfigError, match="guided_decoding_backend must be one of"):
        EngineConfig.from_dict({"model": "m", "guided_decoding_backend": "outlines"})
    llguidance = EngineConfig.from_dict({"model": "m", "guided_decoding_backend": "llguidance"})
    assert any("llguidance" in problem for problem in llguidance.embedded_unsupported())


@pytest.mark.parametrize("bounds", [{"maxLength": 6}, {"minLength": 1}], ids=["max", "min"])
def test_a_length_bounded_string_takes_escapes_and_never_a_raw_control_character(setup, bounds):
    """xgrammar 0.2.8's own rule for such strings lets raw control characters through: invalid JSON."""
    import xgrammar

    decoder = setup[0].core.guided
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", **bounds}}, "required": ["name"]})
    compiled = decoder.compile(GuidedDecodingParams(json=schema))
    for control in ("\x01", "\t", "\x1f"):
        assert not xgrammar.GrammarMatcher(compiled).accept_string('{"name": "a' + control)
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string('{"name": "a\\n\\"b\\u00e9"}')
    assert json.loads('{"name": "a\\n\\"b\\u00e9"}')["name"] == 'a\n"b\u00e9'
