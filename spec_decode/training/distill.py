"""Self-distillation data for Medusa heads: the base model's own greedy answers to chat requests built from what
the package ships, so the heads learn how this model answers (which is what speculative decoding must guess),
not how a person wrote some text.

The requests: the model first writes a paragraph on each shipped topic (training/data/distill_topics.txt); then it is
asked to rewrite, summarise, explain or list the points of those paragraphs and of the shipped training text's
paragraphs, and to answer questions on the topics. Optionally the model also writes requests itself
(`self_written_requests`: sampled user messages), which cover far more subjects than the shipped topics. The
texts `tritonllm bench spec` rewrites (data/bench_texts.txt) and the topics of its chat requests
(data/bench_topics.txt) are never used for training: `held_out_sequences` turns the texts into the bench's own
requests, to measure the heads on, and self-written requests naming a bench topic are dropped."""

from __future__ import annotations

import logging
import random
import re
from functools import lru_cache
from importlib import resources
from typing import Any, Optional, Sequence

import torch
from tqdm import tqdm

log = logging.getLogger("tritonllm.spec_decode")

TOPICS_FILE = "training/data/distill_topics.txt"  # shipped files: paths under spec_decode/
BENCH_TEXTS_FILE = "data/bench_texts.txt"
BENCH_TOPICS_FILE = "data/bench_topics.txt"  # the chat bench's topics: none of them is in TOPICS_FILE
BENCH_TASK = "Rewrite the following text in your own words, keeping every step and detail:\n\n"
TEXT_TASKS = (
    BENCH_TASK,
    "Summarise the following text in a few sentences:\n\n",
    "Explain the following text to a ten-year-old:\n\n",
    "List the main points of the following text:\n\n",
    "Rewrite the following text as a short story:\n\n",
    "Rewrite the following text in simpler words:\n\n",
    "Turn the following text into a numbered list of steps or facts:\n\n",
    "Write a title and a one-paragraph summary for the following text:\n\n",
)
TOPIC_TASKS = (
    "What should I know about {topic}? Answer in detail.",
    "Give me five practical tips about {topic}.",
    "Explain {topic} step by step.",
    "Write a short story about {topic}.",
    "Write an email to a friend about {topic}.",
    "What are common mistakes people make with {topic}, and how can they be avoided?",
)
PARAGRAPH_TASK = "Write a paragraph of about one hundred words about {topic}."
MIN_TEXT_CHARS = 150  # shorter paragraphs (one-line questions) make poor texts to rewrite


def shipped_lines(name: str) -> str:
    return resources.files("tritonllm.spec_decode").joinpath(name).read_text(encoding="utf-8")


def paragraphs(text: str, min_chars: int = 0) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) >= max(1, min_chars)]


def bench_texts() -> list[str]:
    """The texts `tritonllm bench spec` asks the model to rewrite, longest first; kept out of training."""
    return paragraphs(shipped_lines(BENCH_TEXTS_FILE))


def bench_requests(task: str, count: int) -> list[str]:
    """The first `count` requests of `tritonllm bench spec --task`: `rewrite` a shipped bench text (input-grounded),
    or `chat` about a bench topic (open-ended). Neither is ever trained on."""
    if task == "rewrite":
        pool = [BENCH_TASK + text for text in bench_texts()]
    else:
        subjects = _lines(BENCH_TOPICS_FILE)
        pool = [TOPIC_TASKS[i % len(TOPIC_TASKS)].format(topic=topic) for i, topic in enumerate(subjects)]
    return first_shipped(pool, count, f"{task} requests")


def first_shipped(pool: Sequence[str], count: int, what: str) -> list[str]:
    """The first `count` of the benchmark's shipped `pool`; a ConfigError naming --prompts if it holds fewer."""
    from tritonllm.engine.config import ConfigError

    if count > len(pool):
        raise ConfigError(f"--prompts {count}: only {len(pool)} {what} are shipped for the benchmark")
    return list(pool[:count])


def _lines(name: str) -> list[str]:
    return [line.strip() for line in shipped_lines(name).splitlines() if line.strip()]


def topics() -> list[str]:
    return _lines(TOPICS_FILE)


def chat_ids(tokenizer, content: str) -> list[int]:
    """One user message as the model's chat template lays it out (plain text for models without one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(content)


# A training sequence: the prompt's and the answer's token ids, and where the answer starts.
Distilled = tuple[list[int], int]


def chat_sequences(
    base,
    tokenizer,
    texts: Sequence[str],
    count: int,
    max_new_tokens: int,
    batch: int,
    seed: int = 0,
    progress: bool = True,
    rounds: int = 1,
    temperature: float = 0.7,
    validation_share: float = 0.0,
    own_requests: int = 0,
) -> tuple[list[Distilled], list[Distilled]]:
    """About `count` requests answered by `base`: first its paragraphs on the shipped topics (as many as a
    third of `count`), then tasks on those paragraphs and on `texts`, and questions on the topics, plus
    `own_requests` requests the model writes itself (`self_written_requests`, training only). Each request
    is answered greedily, and `rounds - 1` more times sampled at `temperature` (more varied text; the heads'
    targets stay the greedy choices at every position). Returns (training, validation): the requests about
    `validation_share` of the topics are kept apart, so validation measures unseen content."""
    rng = random.Random(seed)
    subjects = topics()
    rng.shuffle(subjects)
    subjects = subjects[: max(1, count // 3)]
    written = greedy_answers(
        base,
        tokenizer,
        [chat_ids(tokenizer, PARAGRAPH_TASK.format(topic=t)) for t in subjects],
        max_new_tokens,
        batch,
        progress,
        "Self-distillation (paragraphs)",
    )
    own_texts = [tokenizer.decode(ids[start:], skip_special_tokens=True).strip() for ids, start in written]
    held = round(len(subjects) * validation_share)
    train_requests = _requests(list(texts) + own_texts[held:], subjects[held:], rng)
    validation_requests = _requests(own_texts[:held], subjects[:held], rng)
    train_requests = train_requests[: max(0, count - len(written) - len(validation_requests))]
    if own_requests:
        train_requests += self_written_requests(base, tokenizer, own_requests, batch, seed, progress)

    def answered(requests: list[str]) -> list[Distilled]:
        prompts = [chat_ids(tokenizer, r) for r in requests]
        return [
            answer
            for round_ in range(rounds)
            for answer in greedy_answers(
                base,
                tokenizer,
                prompts,
                max_new_tokens,
                batch,
                progress,
                f"Self-distillation (tasks, round {round_ + 1}/{rounds})",
                temperature=temperature if round_ else 0.0,
                seed=seed + round_,
            )
        ]

    return written[held:] + answered(train_requests), written[:held] + answered(validation_requests)


OWN_REQUEST_TOKENS = 64  # longest self-written request
OWN_REQUEST_TEMPERATURE = 0.9  # at 1.0 a small model's requests drift into word salad more often


def self_written_requests(base, tokenizer, count: int, batch: int, seed: int = 0, progress: bool = True) -> list[str]:
    """Up to `count` distinct requests written by `base` itself: the chat template up to a user message's text,
    continued by sampling until the message ends. They cover far more subjects than the shipped topics. Requests
    with a word of the chat bench's topics (`bench_topic_stems`) are dropped, so the bench stays unseen."""
    from tritonllm.engine.config import ConfigError

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--distill-own-requests needs a model whose tokenizer has a chat template")
    marker = "\x00"
    layout = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix = tokenizer.encode(layout[: layout.index(marker)], add_special_tokens=False)
    written = greedy_answers(
        base,
        tokenizer,
        [prefix] * count,
        OWN_REQUEST_TOKENS,
        batch,
        progress,
        "Self-distillation (the model's own requests)",
        temperature=OWN_REQUEST_TEMPERATURE,
        seed=seed + 1000,
    )
    requests: dict[str, None] = {}  # insertion-ordered set
    for ids, start in written:
        text = tokenizer.decode(ids[start:], skip_special_tokens=True).strip()
        if len(set(re.findall(r"[a-z]+", text.lower()))) >= 4 and not names_bench_topic(text):
            requests.setdefault(text, None)
    log.info(
        "self-written requests: %d distinct of %d kept (short, repeated or naming a bench topic: dropped)",
        len(requests),
        count,
    )
    return list(requests)


def names_bench_topic(text: str) -> bool:
    """Whether a word of `text` starts like a distinctive word of a chat bench topic (`bench_topic_stems`)."""
    stems = bench_topic_stems()
    return any(word.startswith(stems) for word in re.findall(r"[a-z]+", text.lower()))


GENERIC_TOPIC_WORDS = {"the", "for", "and", "home", "making", "building", "training", "learning", "planning"}


@lru_cache(maxsize=1)
def bench_topic_stems() -> tuple[str, ...]:
    """The first five letters of the chat bench's topics' distinctive words ("knitt", "guita", "sky" ...): a
    word starting with one names a bench topic (knitting, knitted, guitars ...)."""
    words = {word for topic in _lines(BENCH_TOPICS_FILE) for word in re.findall(r"[a-z]+", topic.lower())}
    return tuple(sorted({word[:5] for word in words if len(word) >= 3 and word not in GENERIC_TOPIC_WORDS}))


def distilled_sets(base, tokenizer, text: str, settings) -> tuple[list[Distilled], list[Distilled], list[Distilled]]:
    """(training, validation, held out) for a trainer: `chat_sequences` on the paragraphs of `text`, as the
    settings' distill_* fields, seed, progress and validation_share say, and the bench's requests answered."""
    train, validation = chat_sequences(
        base,
        tokenizer,
        paragraphs(text, MIN_TEXT_CHARS),
        settings.distill_prompts,
        settings.distill_max_tokens,
        settings.distill_batch,
        settings.seed,
        settings.progress,
        settings.distill_rounds,
        settings.distill_temperature,
        settings.validation_share,
        settings.distill_own_requests,
    )
    return train, validation, held_out_sequences(base, tokenizer, settings.distill_max_tokens, settings.distill_batch)


def _requests(texts: Sequence[str], subjects: Sequence[str], rng: random.Random) -> list[str]:
    """Every text task on every long enough text and every topic task on every subject, shuffled."""
    requests = [task + text for text in texts if len(text) >= MIN_TEXT_CHARS for task in TEXT_TASKS]
    requests += [task.format(topic=topic) for topic in subjects for task in TOPIC_TASKS]
    rng.shuffle(requests)
    return requests


def held_out_sequences(base, tokenizer, max_new_tokens: int, batch: int) -> list[Distilled]:
    """The bench's own requests (rewrite each bench text), answered greedily: what accuracy is measured on."""
    prompts = [chat_ids(tokenizer, BENCH_TASK + text) for text in bench_texts()]
    return greedy_answers(base, tokenizer, prompts, max_new_tokens, batch, False, "")


@torch.no_grad()
def greedy_answers(
    base,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch: int,
    progress: bool,
    desc: str,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[Distilled]:
    """Greedy answers (sampled at `temperature` when it is > 0), `batch` prompts per generate call (similar
    lengths together, left-padded); each answer ends at its first end token."""
    sampling: dict[str, Any] = dict(do_sample=False)
    if temperature > 0:
        torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    device = next(base.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[Optional[Distilled]] = [None] * len(prompts)
    with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress) as bar:
        for first in range(0, len(order), batch):
            chunk = order[first : first + batch]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk], device=device)
            out = base.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling
            )
            for i, row in zip(chunk, out[:, width:].tolist()):
                results[i] = (prompts[i] + row[: answer_length(row, base)], len(prompts[i]))
            bar.update(len(chunk))
    return [r for r in results if r is not None]


def answer_length(generated: list[int], base) -> int:
    """Tokens up to and including the first end token (all of them if none)."""
    eos = base.generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return next((i + 1 for i, token in enumerate(generated) if token in ends), len(generated))
