"""`tritonllm bench guided`: the cost of guided decoding per output token, guided against unguided, in one engine.

One engine starts with `guided_decoding_backend: xgrammar`; the same chat prompts (each asks for a person as a JSON
object) go in as concurrent requests, once with `guided_decoding` (a JSON schema: an object of typed fields, an enum
and an array) and once without, in rounds whose order alternates (unguided first, then guided first, ...) so that
machine drift hits both sides alike. Both decode greedily. A guided answer ends where its object closes; each
unguided request ignores the end token and runs to exactly the length of the same prompt's guided answer in the
untimed warm-up, so both sides have the same token counts and the same batch as it shrinks.

Per-output-token time is the engine's own per-request timing: from a request's first token to its last, over the
tokens after the first (prefill left out), pooled over requests and rounds. Wall time over all output tokens comes
too. The grammar's own cost is measured apart, with no model: the engine's mask and matcher advance replayed over
the guided answers' tokens, per batch step (`grammar_ratio`: 1 + that cost over the unguided time per token, an
estimate that machine noise moves far less than the timed ratio). Grammar compile time: how long the first guided
request's submission took (the compile runs there, a cache miss) against the median of the other guided
submissions (cached)."""

from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace
from typing import Any

from tritonllm.commands.arg_types import count
from tritonllm.commands.bench_report import progress, report

# No string length bounds: xgrammar checks the tokens inside a bounded string one by one, which costs about 50 times
# a free string's mask on SmolLM2's vocabulary (docs/guided-decoding.md); OpenAI's structured outputs refuse them.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist", "farmer"]},
        "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "active"],
    "additionalProperties": False,
}
PEOPLE = (
    "a retired sailor who now grows tomatoes",
    "a young surgeon who plays chess",
    "a village schoolteacher who loves astronomy",
    "a painter who works only at night",
    "a software engineer who builds robots",
    "a farmer who keeps bees and goats",
    "a doctor who volunteers abroad",
    "an artist who carves wood",
)
SIDES = ("unguided", "guided")


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=count, default=8, help="concurrent requests per batch (default 8)")
    parser.add_argument(
        "--rounds",
        type=count,
        default=5,
        help="timed rounds, each one batch per side, their order alternating (default 5)",
    )
    parser.add_argument(
        "--max-tokens",
        type=count,
        default=96,
        help="most tokens of a guided answer (default 96; it ends earlier, where the JSON object closes: "
        "SmolLM2-135M-Instruct's answers take 50-65 tokens); "
        "unguided requests run to the length of the same prompt's guided answer",
    )
    parser.add_argument(
        "--json", action="store_true", help="the result as one JSON object on stdout (progress stays on stderr)"
    )


def bench_prompts(count: int) -> list[str]:
    """`count` requests, the descriptions taken in turn (numbered once they repeat, so no two prompts are equal)."""
    prompts = []
    for index in range(count):
        person = PEOPLE[index % len(PEOPLE)]
        suffix = f" (person number {index + 1})" if index >= len(PEOPLE) else ""
        prompts.append(
            f"Invent {person}{suffix}. Answer with one JSON object with the fields name, age, role (one of "
            "engineer, doctor, teacher, artist, farmer), skills (a list of up to three) and active (true or false)."
        )
    return prompts


# ---- checking the answers ----


def schema_errors(schema: dict, value: Any, where: str = "$", strict: bool = False) -> list[str]:
    """Where `value` breaks `schema`, for the keywords SCHEMA uses (type, enum, properties, required,
    additionalProperties, items, min/maxItems, min/maxLength, minimum/maximum); empty when it conforms. `strict`:
    an object's keys beyond its properties are errors even where the schema allows them (what a grammar built
    from the schema emits; the tests check that)."""
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    kind = schema.get("type")
    if kind is not None and not _has_type(value, kind):
        return errors + [f"{where}: expected {kind}, got {type(value).__name__}"]
    if kind == "object":
        errors += _object_errors(schema, value, where, strict)
    elif kind == "array":
        errors += _bounds(len(value), schema, "minItems", "maxItems", f"{where}: {len(value)} items")
        for index, item in enumerate(value):
            errors += schema_errors(schema.get("items", {}), item, f"{where}[{index}]", strict)
    elif kind == "string":
        errors += _bounds(len(value), schema, "minLength", "maxLength", f"{where}: length {len(value)}")
    elif kind in ("integer", "number"):
        errors += _bounds(value, schema, "minimum", "maximum", f"{where}: {value}")
    return errors


def _has_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}[kind]
    return isinstance(value, python)


def _object_errors(schema: dict, value: dict, where: str, strict: bool) -> list[str]:
    properties = schema.get("properties", {})
    errors = [f"{where}: missing {key!r}" for key in schema.get("required", ()) if key not in value]
    if strict or schema.get("additionalProperties") is False:
        errors += [f"{where}: unexpected {key!r}" for key in value if key not in properties]
    for key, sub in properties.items():
        if key in value:
            errors += schema_errors(sub, value[key], f"{where}.{key}", strict=strict)
    return errors


def _bounds(size: float, schema: dict, low: str, high: str, what: str) -> list[str]:
    errors = []
    if low in schema and size < schema[low]:
        errors.append(f"{what} < {low} {schema[low]}")
    if high in schema and size > schema[high]:
        errors.append(f"{what} > {high} {schema[high]}")
    return errors


def conforms(text: str) -> bool:
    try:
        return not schema_errors(SCHEMA, json.loads(text))
    except ValueError:
        return False


# ---- timing ----


def run_batch(engine, prompts: list[list[int]], params: list) -> dict:
    """All requests at once; each one's tokens, finish reason and decode span, the submissions' times, wall time."""
    start = time.perf_counter()
    handles, submit_s = [], []
    for ids, request_params in zip(prompts, params):
        before = time.perf_counter()
        handles.append(engine.generate_async(ids, request_params))
        submit_s.append(time.perf_counter() - before)
    outputs = [handle.result().outputs[0] for handle in handles]
    wall_s = time.perf_counter() - start
    metrics = [output.request_perf_metrics for output in outputs]
    return {
        "tokens": [o.token_ids for o in outputs],
        "finish_reasons": [o.finish_reason for o in outputs],
        "decode_s": [(m.last_token_time_ns - m.first_token_time_ns) / 1e9 for m in metrics],
        "ttft_s": [(m.first_token_time_ns - m.arrival_time_ns) / 1e9 for m in metrics],
        "submit_s": submit_s,
        "wall_s": wall_s,
    }


def summarise(batches: list[dict]) -> dict:
    tokens = sum(len(ids) for batch in batches for ids in batch["tokens"])
    decode_tokens = sum(max(len(ids) - 1, 0) for batch in batches for ids in batch["tokens"])
    decode_s = sum(sum(batch["decode_s"]) for batch in batches)
    wall_s = sum(batch["wall_s"] for batch in batches)
    ttft = [seconds for batch in batches for seconds in batch["ttft_s"]]
    return {
        "output_tokens": tokens,
        "decode_tokens": decode_tokens,
        "ms_per_token": round(1e3 * decode_s / decode_tokens, 3) if decode_tokens else None,
        "wall_s": round(wall_s, 3),
        "wall_ms_per_token": round(1e3 * wall_s / tokens, 3) if tokens else None,
        "mean_ttft_ms": round(1e3 * statistics.fmean(ttft), 3) if ttft else None,
    }


def _ratio(guided, unguided):
    return round(guided / unguided, 3) if guided and unguided else None


def _grammar_ratio(cost, unguided_ms):
    """The ratio guided/unguided if the grammar's replayed cost were all guidance adds to an unguided step."""
    if not cost or not unguided_ms:
        return None
    return round(1 + (cost["mask_ms_per_step"] + cost["advance_ms_per_step"]) / unguided_ms, 3)


def bench_result(args, runs: dict[str, list[dict]], warmup: dict, texts: list[str], facts: dict) -> dict:
    sides = {side: summarise(runs[side]) for side in SIDES}
    per_round = [_ratio(summarise([g])["ms_per_token"], summarise([u])["ms_per_token"]) for u, g in zip(*runs.values())]
    valid = sum(conforms(text) for text in texts)
    submits = warmup["submit_s"]
    return {
        **facts,
        "requests": args.requests,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "schema": SCHEMA,
        "timing": "ms_per_token: the engine's per-request timestamps, first to last token over the tokens after "
        "the first, pooled; wall_ms_per_token: each batch's wall time over its output tokens",
        **sides,
        "ratio": _ratio(sides["guided"]["ms_per_token"], sides["unguided"]["ms_per_token"]),
        "wall_ratio": _ratio(sides["guided"]["wall_ms_per_token"], sides["unguided"]["wall_ms_per_token"]),
        "round_ratios": per_round,
        # A round the machine slowed on one side only moves the pooled ratio; the median of the rounds' ratios less.
        "median_round_ratio": statistics.median(r for r in per_round if r) if any(per_round) else None,
        "grammar_ratio": _grammar_ratio(facts.get("grammar_step_cost"), sides["unguided"]["ms_per_token"]),
        "guided_outputs": len(texts),
        "valid_outputs": valid,
        "valid_fraction": round(valid / len(texts), 3) if texts else None,
        "finished_fraction": round(
            sum(reason == "stop" for batch in runs["guided"] for reason in batch["finish_reasons"]) / len(texts), 3
        )
        if texts
        else None,
        "same_lengths_as_warmup": all(
            [len(ids) for ids in batch["tokens"]] == [len(ids) for ids in warmup["tokens"]] for batch in runs["guided"]
        ),
        "compile": {
            "first_request_ms": round(1e3 * submits[0], 3),
            "cached_request_ms": round(1e3 * statistics.median(submits[1:]), 3) if len(submits) > 1 else None,
        },
        "example_output": texts[0] if texts else None,
    }


# ---- the grammar's own cost ----


def grammar_step_cost(decoder, params, answers: list[list[int]], vocab_size: int) -> dict:
    """The engine's guided path alone, replayed over the guided answers' tokens with no model: per batch step, the
    mask (every live row's bitmask filled, then applied to [rows, vocab] logits) and the matchers' advance. On a
    loaded machine this is steadier than the ratio of two timed runs."""
    import torch

    seqs = [SimpleNamespace(seq_id=-1 - index, params=params) for index in range(len(answers))]
    for seq in seqs:
        decoder.start(seq)
    mask_s = advance_s = 0.0
    rejected = 0  # tokens the replayed grammar refuses: none, as the engine committed only tokens it allowed
    steps = max(len(tokens) for tokens in answers)
    try:
        for step in range(steps):
            live = [(seq, tokens[step]) for seq, tokens in zip(seqs, answers) if step < len(tokens)]
            logits = torch.zeros(len(live), vocab_size)
            start = time.perf_counter()
            decoder.mask(logits, [seq for seq, _ in live])
            middle = time.perf_counter()
            rejected += sum(decoder.advance(seq, token) is None for seq, token in live)
            advance_s += time.perf_counter() - middle
            mask_s += middle - start
    finally:
        for seq in seqs:
            decoder.release(seq)
    return {
        "steps": steps,
        "mask_ms_per_step": round(1e3 * mask_s / steps, 3),
        "advance_ms_per_step": round(1e3 * advance_s / steps, 3),
        "rejected_tokens": rejected,
    }


# ---- the command ----


def timed_rounds(engine, prompts: list[list[int]], params: dict[str, list], rounds: int) -> dict[str, list[dict]]:
    """One batch per side and round, unguided first in even rounds and guided first in odd ones."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for round_ in range(rounds):
        order = SIDES if round_ % 2 == 0 else SIDES[::-1]
        for side in order:
            runs[side].append(run_batch(engine, prompts, params[side]))
        line = {side: summarise(runs[side][-1:])["ms_per_token"] for side in SIDES}
        progress(f"round {round_ + 1}/{rounds} ({' first, '.join(order)} second): {line} ms per token")
    return runs


def main(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from tritonllm.commands.bench_engine import engine_facts
    from tritonllm.commands.generate import build_engine_config
    from tritonllm.engine.embedded.engine import EmbeddedEngine
    from tritonllm.engine.types import GuidedDecodingParams, SamplingParams
    from tritonllm.spec_decode.training.distill import chat_ids

    overrides = dict(dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size)
    config = build_engine_config(args.model, args.config, guided_decoding_backend="xgrammar", **overrides)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or args.model)
    eos = tokenizer.eos_token_id
    prompts = [chat_ids(tokenizer, text) for text in bench_prompts(args.requests)]
    guide = GuidedDecodingParams(json=SCHEMA)
    guided = [SamplingParams(max_tokens=args.max_tokens, end_id=eos, guided_decoding=guide)] * len(prompts)
    progress(f"{len(prompts)} prompts, {args.rounds} rounds; starting the engine (guided_decoding_backend xgrammar)")
    engine = EmbeddedEngine(config)
    try:
        assert engine.core.guided is not None  # started with guided_decoding_backend above
        facts = {**engine_facts(engine, config), "model": str(args.model), "threads": torch.get_num_threads()}
        progress("warm-up: one guided batch (its first submission compiles the grammar)")
        warmup = run_batch(engine, prompts, guided)
        facts["grammars_compiled"] = engine.core.guided.num_compiled
        lengths = [len(ids) for ids in warmup["tokens"]]
        unguided = [SamplingParams(max_tokens=max(n, 1), ignore_eos=True, end_id=eos) for n in lengths]
        progress(f"guided answers of {lengths} tokens; warm-up: one unguided batch of the same lengths")
        run_batch(engine, prompts, unguided)
        runs = timed_rounds(engine, prompts, {"unguided": unguided, "guided": guided}, args.rounds)
    finally:
        engine.shutdown()
    vocab = engine.core.model_config.vocab_size
    facts["grammar_step_cost"] = grammar_step_cost(engine.core.guided, guided[0], warmup["tokens"], vocab)
    texts = [
        str(tokenizer.decode(ids, skip_special_tokens=True)) for batch in runs["guided"] for ids in batch["tokens"]
    ]
    result = bench_result(args, runs, warmup, texts, facts)
    report(
        result,
        args.json,
        f"guided {result['guided']['ms_per_token']} ms/token vs unguided {result['unguided']['ms_per_token']} "
        f"ms/token ({result['ratio']}x; wall {result['wall_ratio']}x; the grammar's replayed cost alone "
        f"{result['grammar_ratio']}x), {result['valid_outputs']}/"
        f"{result['guided_outputs']} guided answers valid, grammar compile: first request "
        f"{result['compile']['first_request_ms']} ms, cached {result['compile']['cached_request_ms']} ms",
    )
    return 0
