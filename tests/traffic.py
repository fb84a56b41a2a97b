"""Random traffic for the embedded engine, as a server sees it: requests arriving while others run, streaming and
not, clients that abort after a few outputs, requests the engine must refuse, sampled requests, stop words, beams,
requests that opt out of speculation and, with adapters, a LoRA adapter per request.

`send` plays the traffic into one engine; `mismatches` replays every greedy request alone on a reference engine and
reports the ones whose tokens differ (an aborted request's tokens must be a prefix of its solo answer). Sampled
requests, and beams cut short, only have to finish: draws depend on the batch they ran in, and beams are reordered
until the end."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from tritonllm.engine.types import InvalidRequestError, SamplingParams

END_ID = 2
BAD_KINDS = ("empty prompt", "token outside the vocabulary", "prompt past max_seq_len", "max_tokens 0")


@dataclass
class TrafficRequest:
    prompt: list[int]
    max_tokens: int
    streaming: bool
    abort_after: Optional[int]  # outputs the client reads before it aborts; None: reads to the end
    speculate: bool
    delay_s: float  # pause before sending it
    kind: str = "greedy"  # greedy, sampled, stop words, beams, or one of BAD_KINDS
    adapter: int = 0  # 0: the base model

    def params(self, alone: bool = False) -> SamplingParams:
        """The request's sampling parameters; `alone`: for its solo reference run (no speculation knob)."""
        knobs = dict(
            max_tokens=0 if self.kind == "max_tokens 0" else self.max_tokens, end_id=END_ID, return_perf_metrics=True
        )
        if self.kind == "sampled":
            knobs.update(temperature=0.8, top_k=20, seed=len(self.prompt))
        elif self.kind == "beams":
            knobs.update(beam_width=2)
        elif self.kind == "stop words":
            knobs.update(stop_words=[self.prompt[-2:]])
        if not alone:
            knobs["speculate"] = self.speculate
        return SamplingParams(**knobs)

    def token_ids(self) -> list[int]:
        if self.kind == "empty prompt":
            return []
        if self.kind == "token outside the vocabulary":
            return self.prompt + [10**7]
        if self.kind == "prompt past max_seq_len":
            return [5] * 100_000
        return self.prompt


PREEMPTING_PACE = 0.2  # the preempting cases' delays between arrivals, as a share of the traffic's own


def close_together(traffic: list[TrafficRequest], pace: float = PREEMPTING_PACE) -> list[TrafficRequest]:
    """`traffic` with its delays between arrivals scaled by `pace`, so that a small KV budget surely preempts (how
    far apart they land otherwise depends on how fast the machine steps)."""
    return [replace(request, delay_s=request.delay_s * pace) for request in traffic]


def random_traffic(seed: int, count: int, vocab: int, beams: bool = True, adapters: int = 0) -> list[TrafficRequest]:
    """Prompts of 2-50 tokens, two in five sharing a prefix (prefix reuse) and many repetitive (drafts accepted)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(30)]
    kinds = ["greedy"] * 12 + ["sampled", "stop words"] + (["beams"] if beams else [])
    traffic = []
    for _ in range(count):
        if rng.random() < 0.4:
            prompt = shared[: rng.randrange(4, 30)] + [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 6))]
        else:
            unit = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 6))]
            prompt = (unit * 25)[: rng.randrange(2, 50)]
        kind = rng.choice(BAD_KINDS) if rng.random() < 0.08 else rng.choice(kinds)
        traffic.append(
            TrafficRequest(
                prompt=prompt,
                max_tokens=rng.randrange(1, 40),
                streaming=rng.random() < 0.4,
                abort_after=rng.randrange(0, 6) if rng.random() < 0.15 else None,
                speculate=rng.random() > 0.15,
                delay_s=rng.random() * 0.03,
                kind=kind,
                adapter=rng.randrange(adapters + 1),
            )
        )
    return traffic


def send(engine, traffic: list[TrafficRequest], lora_for: Callable = lambda adapter: None) -> dict:
    """Play `traffic` into `engine`; returns {index: (aborted, final output)} of the requests it accepted. Bad
    requests must be refused at once, naming what is wrong; every other one must be accepted."""
    handles = []
    for index, request in enumerate(traffic):
        time.sleep(request.delay_s)
        try:
            handle = engine.generate_async(
                request.token_ids(),
                request.params(),
                streaming=request.streaming or request.abort_after is not None,
                lora_request=lora_for(request.adapter),
            )
        except InvalidRequestError as error:
            assert request.kind in BAD_KINDS, f"request {index} ({request.kind}) refused: {error}"
            continue
        assert request.kind not in BAD_KINDS, f"request {index} ({request.kind}) accepted"
        handles.append((index, request, handle))
    return {index: _collect(request, handle) for index, request, handle in handles}


def _collect(request: TrafficRequest, handle) -> tuple[bool, object]:
    if request.abort_after is None:
        return False, handle.result(timeout=120)
    for seen, _ in enumerate(handle, 1):
        if seen > request.abort_after:
            handle.abort()
            break
    return True, handle.result(timeout=120)


def mismatches(
    reference, traffic: list[TrafficRequest], results: dict, lora_for: Callable = lambda adapter: None
) -> list[str]:
    """Every greedy request of `results` against its own run alone on `reference` (a plain engine)."""
    found = []
    for index, (aborted, output) in sorted(results.items()):
        request = traffic[index]
        if request.kind == "sampled" or (aborted and request.kind == "beams"):  # no fixed answer to hold them to
            assert output.finished
            continue
        alone = reference.generate(request.prompt, request.params(alone=True), lora_for(request.adapter))
        got, want = [o.token_ids for o in output.outputs], [o.token_ids for o in alone.outputs]
        if aborted:
            got, want = got[0], want[0][: len(got[0])]
        if got != want:
            found.append(
                f"request {index} ({request.kind}, {'aborted' if aborted else 'finished'}): {got} instead of {want}"
            )
    return found


def preemptions(results: dict) -> int:
    return sum(output.outputs[0].request_perf_metrics.num_preemptions for _, output in results.values())
