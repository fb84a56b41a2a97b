"""The BLS draft/target loop against scripted draft and target models (token rules, no engine): the output is the
target's own greedy sequence whatever the draft proposes, rounds end on max_tokens and on the end id, streams send
one piece per round, and the draft logits reach the target."""

import numpy as np
import pytest

from tritonllm.bls.llm_calls import LlmResponse
from tritonllm.bls.speculative import SpeculationSettings, SpeculativeCall

VOCAB = 50


def target_next(context):
    return (sum(context) * 31 + len(context) * 7) % VOCAB


def draft_next(context):  # right two times in three
    guess = target_next(context)
    return guess if len(context) % 3 else (guess + 1) % VOCAB


class ScriptedModel:
    """A tensorrt_llm stand-in: greedy by `rule`; with draft_input_ids, accepts the longest matching prefix and
    adds one token of its own (what the engine's external draft tokens do for greedy requests)."""

    def __init__(self, rule, vocab_logits=False):
        self.rule, self.vocab_logits, self.calls = rule, vocab_logits, []

    def start(self, inputs, request_id):
        self.calls.append(inputs)
        return self

    def responses(self):
        inputs = self.calls[-1]
        assert inputs["end_id"].item() == -1 and not inputs["streaming"].item()
        context = inputs["input_ids"][0].tolist()
        out = []
        if "draft_input_ids" in inputs:
            for token in inputs["draft_input_ids"][0].tolist():
                if token != self.rule(context + out):
                    break
                out.append(token)
            out.append(self.rule(context + out))
        else:
            for _ in range(inputs["request_output_len"].item()):
                out.append(self.rule(context + out))
        outputs = {
            "output_ids": np.array(out, np.int32).reshape(1, 1, -1),
            "sequence_length": np.array([[len(out)]], np.int32),
        }
        if self.vocab_logits and inputs.get("return_generation_logits", np.array([[False]])).item():
            outputs["generation_logits"] = np.zeros((1, 1, len(out), VOCAB), np.float32)
        yield LlmResponse(outputs, final=True)

    def cancel(self):
        pass


def greedy(prompt, count, end_id=-1):
    out = []
    for _ in range(count):
        token = target_next(prompt + out)
        if token == end_id:
            break
        out.append(token)
    return out


def request_inputs(prompt, max_tokens, end_id=-1):
    return {
        "input_ids": np.array([prompt], np.int32),
        "input_lengths": np.array([[len(prompt)]], np.int32),
        "request_output_len": np.array([[max_tokens]], np.int32),
        "end_id": np.array([[end_id]], np.int32),
        "temperature": np.array([[0.0]], np.float32),
    }


def run(prompt, max_tokens, streaming, k=4, end_id=-1, use_logits=False, draft=None):
    target, draft = ScriptedModel(target_next), draft or ScriptedModel(draft_next)
    call = SpeculativeCall(
        target,
        draft,
        request_inputs(prompt, max_tokens, end_id),
        SpeculationSettings(k, use_logits),
        streaming=streaming,
        echo_prompt=False,
        request_id="r",
    )
    return call, list(call.responses()), target, draft


def tokens_of(responses):
    return [t for r in responses for t in r.outputs["output_ids"].reshape(-1).tolist()]


@pytest.mark.parametrize("max_tokens", [1, 5, 23])
@pytest.mark.parametrize("streaming", [False, True])
def test_output_is_the_targets_greedy_sequence(max_tokens, streaming):
    prompt = [3, 1, 4, 1, 5]
    call, responses, target, draft = run(prompt, max_tokens, streaming)
    assert tokens_of(responses) == greedy(prompt, max_tokens)
    assert responses[-1].final and all(not r.final for r in responses[:-1])
    if streaming and max_tokens > 5:
        assert len(responses) == call.rounds > 1  # one piece per round
        assert responses[1].outputs["detok_prefix_ids"].reshape(-1).tolist()[-1] == tokens_of(responses[:1])[-1]
    if max_tokens > 1:
        assert call.accepted < call.drafted  # the draft is wrong now and then, and that was noticed
    assert all(
        c["request_output_len"].item() == len(c.get("draft_input_ids", np.zeros((1, 0)))[0]) + 1 for c in target.calls
    )


def test_a_perfect_draft_is_accepted_whole():
    call, responses, _, _ = run([2, 7], 20, streaming=False, draft=ScriptedModel(target_next))
    assert tokens_of(responses) == greedy([2, 7], 20)
    assert call.accepted == call.drafted and call.rounds == 4  # 5 tokens per round of 4 drafts
    assert responses[-1].outputs["acceptance_rate"].item() == 1.0


def test_the_end_id_ends_the_loop_and_is_not_returned():
    prompt = [3, 1, 4, 1, 5]
    end_id = greedy(prompt, 9)[6]
    _, responses, _, _ = run(prompt, 30, streaming=True, end_id=end_id)
    assert tokens_of(responses) == greedy(prompt, 30, end_id=end_id)
    assert responses[-1].final


def test_draft_logits_go_to_the_target():
    _, _, target, draft = run(
        [1, 2, 3], 10, streaming=False, use_logits=True, draft=ScriptedModel(draft_next, vocab_logits=True)
    )
    verifying = [c for c in target.calls if "draft_input_ids" in c]
    assert verifying and all(c["draft_logits"].shape == (1, c["draft_input_ids"].shape[1], VOCAB) for c in verifying)
    assert all(c["return_generation_logits"].item() for c in draft.calls)
