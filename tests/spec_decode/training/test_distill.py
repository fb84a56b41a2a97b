"""Self-distillation for Medusa heads: the bench's texts and chat topics stay out of training, batched
(left-padded) greedy answers equal one-at-a-time greedy answers, validation topics are kept apart, and training on
chat data keeps the heads that do best on validation."""

import pytest
import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import ConfigError
from tritonllm.spec_decode.medusa import load_medusa
from tritonllm.spec_decode.training import distill
from tritonllm.spec_decode.training.train_medusa import TrainSettings, default_text, train_medusa


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=7)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model_dir, AutoTokenizer.from_pretrained(str(model_dir)), base


def test_bench_texts_are_never_training_text():
    training = default_text()
    texts = distill.bench_texts()
    assert len(texts) >= 4 and distill.bench_requests("rewrite", 4) == [distill.BENCH_TASK + t for t in texts[:4]]
    for text in texts:
        assert text not in training and text[:60] not in training
    with pytest.raises(ConfigError, match="--prompts"):
        distill.bench_requests("rewrite", len(texts) + 1)


def test_chat_bench_topics_are_in_no_training_data():
    training, topics = default_text().lower(), [t.lower() for t in distill.topics()]
    requests = distill.bench_requests("chat", 8)
    for topic in distill.shipped_lines(distill.BENCH_TOPICS_FILE).splitlines():
        assert topic.lower() not in training and all(topic.lower() not in t and t not in topic.lower() for t in topics)
        assert any(topic in request for request in requests)
    assert distill.bench_requests("rewrite", 2) == [distill.BENCH_TASK + t for t in distill.bench_texts()[:2]]
    with pytest.raises(ValueError, match="only 8 chat requests"):
        distill.bench_requests("chat", 9)


def test_batched_greedy_answers_equal_answers_one_at_a_time(tiny):
    _, tokenizer, base = tiny
    prompts = [
        distill.chat_ids(tokenizer, text) for text in ("Hi", "Tell me about the sea and the boats on it.", "Bread")
    ]
    batched = distill.greedy_answers(base, tokenizer, prompts, 10, batch=3, progress=False, desc="")
    for prompt, (ids, start) in zip(prompts, batched):
        alone = base.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0]
        answer = alone[len(prompt) :].tolist()
        assert start == len(prompt) and ids[:start] == prompt
        assert ids[start:] == answer[: distill.answer_length(answer, base)]


def test_chat_sequences_keep_validation_topics_apart_and_sample_extra_rounds(tiny):
    _, tokenizer, base = tiny
    train, validation = distill.chat_sequences(
        base,
        tokenizer,
        ["A text about zebrafish. " * 10],
        count=24,
        max_new_tokens=8,
        batch=8,
        progress=False,
        rounds=2,
        validation_share=0.25,
    )
    assert train and validation
    prompts = lambda sequences: {tuple(ids[:start]) for ids, start in sequences}  # noqa: E731
    assert not prompts(train) & prompts(validation)
    assert all(0 < start < len(ids) <= start + 8 for ids, start in train + validation)
    # Requests answered twice: greedy, then sampled; the same prompts appear in both rounds.
    requests = [ids[:start] for ids, start in train]
    assert any(requests.count(prompt) == 2 for prompt in requests)
    assert not any("zebrafish" in tokenizer.decode(ids) for ids, _ in validation)  # shipped texts train only
    # Without validation nothing is kept apart: `count` answers (a third of them paragraphs), all for training.
    train, validation = distill.chat_sequences(
        base, tokenizer, ["A text about zebrafish. " * 10], count=12, max_new_tokens=4, batch=8, progress=False
    )
    assert not validation and len(train) == 12


def test_training_on_chat_data_keeps_the_best_validated_heads(tiny, tmp_path):
    model_dir, _, _ = tiny
    settings = TrainSettings(
        num_heads=2,
        steps=6,
        batch_positions=64,
        learning_rate=1e-2,
        progress=False,
        distill_prompts=12,
        distill_max_tokens=8,
        distill_batch=6,
        validation_share=0.3,
        eval_every=2,
    )
    report = train_medusa(model_dir, tmp_path / "heads", settings)
    assert report.best_step in (2, 4, 6) and len(report.validation_accuracy) == 2
    assert 0 < report.held_out_tokens <= len(distill.bench_texts()) * 8  # the bench's requests, answered
    assert load_medusa(tmp_path / "heads").num_heads == 2


def test_cli_refuses_bad_distillation_settings(tiny, tmp_path, capsys):
    from tritonllm.commands.main import main

    model_dir, _, _ = tiny
    for flag, value in (
        ("--distill-rounds", "0"),
        ("--validation-share", "1.5"),
        ("--distill-prompts", "-1"),
        ("--distill-own-requests", "-2"),
    ):
        assert main(["spec", "train-medusa", "--model", str(model_dir), "--out", str(tmp_path / "h"), flag, value]) == 2
        assert flag.split("-")[-1] in capsys.readouterr().err
    assert (
        main(
            [
                "spec",
                "train-eagle",
                "--model",
                str(model_dir),
                "--out",
                str(tmp_path / "e"),
                "--distill-own-requests",
                "-2",
            ]
        )
        == 2
    )  # the distillation flags are checked alike for both trainers
    assert "--distill-own-requests must be >= 0, got -2" in capsys.readouterr().err


def test_bench_topic_filter_catches_every_chat_bench_request_and_few_training_requests():
    assert all(distill.names_bench_topic(request) for request in distill.bench_requests("chat", 8))
    assert distill.names_bench_topic("How do I knit mittens for my guitars?")
    training_topics = distill.topics()
    assert sum(distill.names_bench_topic(topic) for topic in training_topics) <= len(training_topics) // 20
    assert not distill.names_bench_topic("Give me five practical tips about baking bread.")


def test_self_written_requests_are_distinct_and_train_only(tiny):
    _, tokenizer, base = tiny
    requests = distill.self_written_requests(base, tokenizer, 24, batch=12, progress=False)
    assert requests and len(set(requests)) == len(requests)
    assert not any(distill.names_bench_topic(r) for r in requests)
    train, validation = distill.chat_sequences(
        base, tokenizer, [], count=12, max_new_tokens=4, batch=12, progress=False, validation_share=0.25
    )
    more, same = distill.chat_sequences(
        base,
        tokenizer,
        [],
        count=12,
        max_new_tokens=4,
        batch=12,
        progress=False,
        validation_share=0.25,
        own_requests=24,
    )
    assert len(more) == len(train) + len(requests) and same == validation
    own = {tuple(distill.chat_ids(tokenizer, r)) for r in requests}
    assert own <= {tuple(ids[:start]) for ids, start in more}


def test_self_written_requests_need_a_chat_template(tiny):
    _, tokenizer, base = tiny

    class NoTemplate:
        chat_template = None

    with pytest.raises(ConfigError, match="--distill-own-requests.*chat template"):
        distill.self_written_requests(base, NoTemplate(), 4, batch=4, progress=False)
