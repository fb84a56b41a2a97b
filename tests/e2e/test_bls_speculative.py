"""The tensorrt_llm_bls draft/target loop on the real server: a draft model served as tensorrt_llm_draft proposes
num_draft_tokens tokens per round, tensorrt_llm verifies them (draft_input_ids); the text equals plain greedy
decoding, streamed (one piece per round) and not, and the perf outputs count the drafted and accepted tokens."""

import pytest

pytestmark = pytest.mark.server

PROMPT = "The lighthouse keeper counted ships"
BODY = {
    "text_input": PROMPT,
    "max_tokens": 24,
    "bad_words": "",
    "stop_words": "",
    "temperature": 0.0,
    "exclude_input_in_output": True,
}


def test_speculative_text_equals_plain_greedy(draft_server):
    plain = draft_server.generate(BODY, model="tensorrt_llm_bls")["text_output"]
    spec = draft_server.generate({**BODY, "num_draft_tokens": 4, "return_perf_metrics": True}, model="tensorrt_llm_bls")
    assert spec["text_output"] == plain
    assert spec["total_draft_tokens"] > 0 and 0 <= spec["total_accepted_draft_tokens"] <= spec["total_draft_tokens"]


def test_speculative_stream_joins_to_the_plain_text(draft_server):
    plain = draft_server.generate(BODY, model="tensorrt_llm_bls")["text_output"]
    events = draft_server.generate_stream({**BODY, "num_draft_tokens": 3, "stream": True}, model="tensorrt_llm_bls")
    assert "".join(e["text_output"] for e in events) == plain
    assert len(events) > 1


def test_draft_logits_path_gives_the_same_greedy_text(draft_server):
    plain = draft_server.generate(BODY, model="tensorrt_llm_bls")["text_output"]
    spec = draft_server.generate({**BODY, "num_draft_tokens": 4, "use_draft_logits": True}, model="tensorrt_llm_bls")
    assert spec["text_output"] == plain


def test_stop_word_ends_the_speculative_loop(draft_server, tokenizer):
    plain = draft_server.generate(BODY, model="tensorrt_llm_bls")["text_output"]
    word = plain.split()[2] if len(plain.split()) > 2 else plain.split()[-1]
    spec = draft_server.generate({**BODY, "num_draft_tokens": 4, "stop_words": [word]}, model="tensorrt_llm_bls")
    assert spec["text_output"] == plain[: plain.index(word) + len(word)]


def test_without_a_draft_model_the_request_is_refused(server):
    status, message = server.generate_error({**BODY, "num_draft_tokens": 4}, model="tensorrt_llm_bls")
    assert status == 400 and "tensorrt_llm_draft_model_name" in message


def test_bls_spec_bench_reports_equal_texts_and_the_counts(tiny_model, capsys):
    """`tritonllm bench bls-spec` on the tiny model drafting for itself: every draft token is accepted."""
    import json

    from tritonllm.commands.main import main

    assert (
        main(
            [
                "bench",
                "bls-spec",
                "--model",
                str(tiny_model),
                "--draft-model",
                str(tiny_model),
                "--prompts",
                "1",
                "--max-tokens",
                "12",
                "--num-draft-tokens",
                "3",
                "--json",
            ]
        )
        == 0
    )
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert result["texts_equal"] and result["plain_s"] > 0 and result["speculative_s"] > 0
    assert result["total_draft_tokens"] > 0 and result["acceptance_rate"] == 1.0
