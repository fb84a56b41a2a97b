"""`tritonllm bench spec`'s figures from timed runs: the overall ratio, and each prompt's own with their median
(one answer that repeats itself can carry a small run's overall ratio), and the methods' default settings."""

from types import SimpleNamespace

from tritonllm.commands.bench_spec import bench_result, per_prompt


def _run(tokens: int, seconds: float, steps: int, drafted: int = 0, accepted: int = 0) -> dict:
    return {
        "tokens": list(range(tokens)),
        "decode_s": seconds,
        "decode_steps": steps,
        "drafted": drafted,
        "accepted": accepted,
    }


ARGS = SimpleNamespace(task="chat", max_tokens=9)
PROMPTS = [[1, 2, 3], [4, 5], [6]]


def test_the_median_prompt_shows_what_one_repetitive_answer_hides():
    runs = {
        "plain": [_run(9, 1.0, 8), _run(9, 1.0, 8), _run(9, 1.0, 8)],
        "spec": [_run(9, 1.0, 8), _run(9, 0.25, 2, 12, 6), _run(9, 0.8, 6, 6, 2)],
    }
    result = bench_result({"decoding_type": "Medusa"}, ARGS, PROMPTS, runs)
    assert result["speedup"] == 1.464  # 11.71 tok/s (24 tokens in 2.05 s) over 8.0: carried by the second answer
    assert [row["speedup"] for row in result["per_prompt"]] == [1.0, 4.0, 1.25]
    assert result["median_prompt_speedup"] == 1.25
    assert [row["mean_accepted_length"] for row in result["per_prompt"]] == [1.0, 4.0, round(8 / 6, 3)]
    assert [row["prompt_tokens"] for row in result["per_prompt"]] == [3, 2, 1]
    assert result["spec"]["acceptance_rate"] == round(8 / 18, 3)


def test_an_answer_that_ends_at_its_first_token_has_no_speedup_and_breaks_nothing():
    rows = per_prompt([_run(1, 0.0, 0), _run(5, 1.0, 4)], [_run(1, 0.0, 0), _run(5, 0.5, 2)], PROMPTS[:2])
    assert [row["speedup"] for row in rows] == [None, 2.0]
    result = bench_result(
        {"decoding_type": "NGram"}, ARGS, PROMPTS[:1], {"plain": [_run(1, 0.0, 0)], "spec": [_run(1, 0.0, 0)]}
    )
    assert result["speedup"] is None and result["median_prompt_speedup"] is None
    assert result["identical_outputs"]


def test_rounds_pool_each_prompts_runs():
    # Two rounds of two prompts: prompt 0's runs are entries 0 and 2, prompt 1's entries 1 and 3.
    runs = {
        "plain": [_run(9, 1.0, 8), _run(5, 1.0, 4), _run(9, 3.0, 8), _run(5, 1.0, 4)],
        "spec": [_run(9, 1.0, 4), _run(5, 0.5, 2), _run(9, 1.0, 4), _run(5, 0.5, 2)],
    }
    result = bench_result({"decoding_type": "Medusa"}, ARGS, PROMPTS[:2], runs)
    assert result["rounds"] == 2
    assert [row["speedup"] for row in result["per_prompt"]] == [2.0, 2.0]  # 16 tokens in 4 s, then in 2 s
    assert [row["mean_accepted_length"] for row in result["per_prompt"]] == [2.0, 2.0]
    assert result["speedup"] == 2.0 and result["median_prompt_speedup"] == 2.0


def test_method_defaults_and_an_explicit_draft_len():
    from tritonllm.commands.bench_spec import METHODS

    default = SimpleNamespace(draft_len=None, spec_model_dir="builtin:smollm2")
    assert METHODS["eagle"](default)["max_draft_len"] == 2  # the fastest chain on the 2-core CPU
    assert METHODS["ngram"](default)["max_draft_len"] == 6
    assert METHODS["eagle"](SimpleNamespace(draft_len=3, spec_model_dir="x"))["max_draft_len"] == 3
    assert METHODS["medusa"](default)["min_path_probability"] == 0.15
