"""The LLM-API `tensorrt_llm` model (contract 1.3) on the real tritonserver: text in, text out over gRPC (plain and
streaming) and HTTP, typed optional outputs, stop strings, guided decoding (a JSON schema, a regex), cancellation
that frees the engine, errors that name the input, and the same metrics as the token-level model."""

from __future__ import annotations

import json
import re
import threading
import time

import e2e_clients as clients
import numpy as np
import pytest

from tritonllm.commands.bench_guided import schema_errors

pytestmark = pytest.mark.server

PROMPT = "The lamp turned"
MODEL = "tensorrt_llm"


def inputs(prompt: str = PROMPT, **values) -> dict[str, np.ndarray]:
    """One request's tensors (max_batch_size 0: no batch dimension): text_input [1], the others [1]."""
    tensors = {"text_input": np.array([prompt], dtype=object)}
    for name, value in values.items():
        tensors[name] = (
            value if isinstance(value, np.ndarray) else np.array([value], dtype=clients.PYTHON_DTYPES[type(value)])
        )
    return tensors


def ok(reply: clients.StreamReply) -> clients.StreamReply:
    assert reply.error is None, reply.error
    assert reply.finished
    return reply


def test_max_tokens_request_gets_typed_outputs_over_grpc(llmapi_server):
    reply = ok(
        llmapi_server.stream_infer(
            MODEL,
            inputs(
                sampling_param_max_tokens=8,
                return_finish_reason=True,
                return_stop_reason=True,
                return_cumulative_logprob=True,
            ),
        )
    )
    (result,) = reply.results
    datatypes = {output.name: output.datatype for output in result.get_response().outputs}
    assert datatypes == {
        "text_output": "BYTES",
        "finish_reason": "BYTES",
        "stop_reason": "BYTES",
        "cumulative_logprob": "FP32",
    }  # FP32, not strings: the anchor's bug Q5 fixed
    (text,) = reply.texts()
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert result.as_numpy("finish_reason").tolist() in ([b"length"], [b"stop"])
    assert result.as_numpy("stop_reason").tolist() == [b"None"]
    assert result.as_numpy("cumulative_logprob").dtype == np.float32 and result.as_numpy("cumulative_logprob")[0] < 0


def test_streaming_over_grpc_sends_growing_text_that_ends_as_the_plain_answer(llmapi_server):
    plain = ok(
        llmapi_server.stream_infer(
            MODEL, inputs(sampling_param_max_tokens=16, sampling_param_exclude_input_from_output=True)
        )
    )
    stream = ok(
        llmapi_server.stream_infer(
            MODEL, inputs(sampling_param_max_tokens=16, streaming=True, return_finish_reason=True)
        )
    )
    texts = stream.texts()
    assert len(texts) > 1
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert texts[-1] == plain.texts()[0]
    reasons = [r.as_numpy("finish_reason")[0] for r in stream.results]
    assert reasons[:-1] == [b"None"] * (len(reasons) - 1) and reasons[-1] in (b"length", b"stop")


def test_http_generate_answers_with_text(llmapi_server):
    reply = llmapi_server.generate(
        {
            "text_input": PROMPT,
            "sampling_param_max_tokens": 4,
            "sampling_param_exclude_input_from_output": True,
            "return_finish_reason": True,
        },
        model=MODEL,
    )
    assert isinstance(reply["text_output"], str) and reply["finish_reason"] in ("length", "stop")


def test_a_stop_string_ends_the_answer(llmapi_server):
    plain = ok(
        llmapi_server.stream_infer(
            MODEL, inputs(sampling_param_max_tokens=24, sampling_param_exclude_input_from_output=True)
        )
    )
    full = plain.texts()[0]
    stop = full[6:9]
    assert stop.strip(), f"pick another slice of {full!r}"
    reply = ok(
        llmapi_server.stream_infer(
            MODEL,
            inputs(
                sampling_param_max_tokens=24,
                sampling_param_exclude_input_from_output=True,
                streaming=True,
                sampling_param_stop=np.array([stop], dtype=object),
                return_stop_reason=True,
            ),
        )
    )
    assert reply.texts()[-1] == full[: full.index(stop)]
    assert reply.results[-1].as_numpy("stop_reason").tolist() == [stop.encode()]


GUIDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
    },
    "required": ["name", "kind", "tags"],
}
GUIDED_REGEX = r"(yes|no), [a-z]{2,4}!"


def guided_text(server, guide_type: str, guide: str, streaming: bool) -> str:
    """The answer to a guided request over HTTP: /generate_stream's last event, or /generate's one reply."""
    body = {
        "text_input": PROMPT,
        "sampling_param_max_tokens": 400,  # the tiny random model writes no JSON by chance: only the guide ends it
        "sampling_param_exclude_input_from_output": True,
        "guided_decoding_guide_type": guide_type,
        "guided_decoding_guide": guide,
        "return_finish_reason": True,
    }
    if streaming:
        events = server.generate_stream({**body, "streaming": True}, model=MODEL)
        assert len(events) > 1 and events[-1]["finish_reason"] == "stop"
        return events[-1]["text_output"]
    reply = server.generate(body, model=MODEL)
    assert reply["finish_reason"] == "stop", reply
    return reply["text_output"]


@pytest.mark.parametrize("streaming", [False, True], ids=["generate", "generate_stream"])
def test_a_json_schema_guided_answer_parses_and_validates(llmapi_server, streaming):
    text = guided_text(llmapi_server, "json_schema", json.dumps(GUIDED_SCHEMA), streaming)
    assert schema_errors(GUIDED_SCHEMA, json.loads(text)) == [], text


@pytest.mark.parametrize("streaming", [False, True], ids=["generate", "generate_stream"])
def test_a_regex_guided_answer_fully_matches(llmapi_server, streaming):
    text = guided_text(llmapi_server, "regex", GUIDED_REGEX, streaming)
    assert re.fullmatch(GUIDED_REGEX, text), text


def test_a_bad_guide_is_refused_by_name(llmapi_server):
    body = {"text_input": PROMPT, "guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"}
    status, message = llmapi_server.generate_error(body, model=MODEL)
    assert status == 400 and "'guided_decoding_guide_type'" in message, message


def test_cancelling_a_grpc_stream_aborts_the_engine_request(llmapi_server):
    before = llmapi_server.wait_engine_idle()
    assert clients.engine_is_idle(before), before
    stream = llmapi_server.grpc_stream()
    max_tokens = llmapi_server.max_seq_len - 16
    stream.send(MODEL, inputs(sampling_param_max_tokens=max_tokens, streaming=True))
    reply = clients.StreamReply()
    while len(reply.results) < 3:
        clients.add_event(reply, *stream.next_event(timeout=30))
    assert not reply.finished, reply.error
    stream.close(cancel=True)
    clients.assert_cut_short(llmapi_server, before, max_tokens)


def wait_running(server, timeout: float = 30) -> None:
    """Until the engine runs a request (the gauges refresh every stats_check_period_ms)."""
    deadline = time.monotonic() + timeout
    while server.metrics().get(("nv_trt_llm_request_metrics", "active"), 0) < 1:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)


def stop_until_found(server, request_id: str, thread: threading.Thread, timeout: float = 30) -> tuple[int, str]:
    """A curl-style stop, sent again while no request of that id runs yet and its call has not returned: the
    running gauge wait_running reads can be a sample old or still count the test before's request, so the first
    stop may come before this request has reached the engine (the server answers NOT_FOUND then)."""
    deadline = time.monotonic() + timeout
    while True:
        status, message = server.generate_error({"id": request_id, "text_input": "", "stop": True}, model=MODEL)
        if "no running request" not in message or not thread.is_alive() or time.monotonic() > deadline:
            return status, message
        time.sleep(0.05)


def in_background(call) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def target():
        try:
            result["value"] = call()
        except BaseException as exc:  # handed to the test
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


def assert_freed(server, before) -> None:
    after = server.wait_engine_idle(timeout=10)
    assert clients.engine_is_idle(after), f"the engine kept the request: {after}"
    steps = (
        after[("nv_trt_llm_general_metrics", "iteration_counter")]
        - before[("nv_trt_llm_general_metrics", "iteration_counter")]
    )
    assert steps < server.max_seq_len - 200, f"the stopped request ran {steps} steps: it was not aborted"


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_a_curl_style_stop_with_the_running_requests_id_aborts_it(llmapi_server, endpoint):
    """TensorRT-LLM's llmapi cancel, as curl sends it: POST /generate {"id": ID, "text_input": "", "stop": true}
    while POST /generate(_stream) {"id": ID, ...} runs. The stop answers CANCELLED "Request cancelled by client";
    the running request ends with its text so far and finish_reason "cancelled"; its KV blocks are freed."""
    before = llmapi_server.wait_engine_idle()
    body = {
        "id": f"curl-{endpoint}",
        "text_input": PROMPT,
        "sampling_param_max_tokens": llmapi_server.max_seq_len - 16,
        "sampling_param_exclude_input_from_output": True,
        "return_finish_reason": True,
        "streaming": endpoint == "generate_stream",
    }
    call = llmapi_server.generate_stream if endpoint == "generate_stream" else llmapi_server.generate
    thread, result = in_background(lambda: call(body, model=MODEL))
    wait_running(llmapi_server)
    status, message = stop_until_found(llmapi_server, body["id"], thread)
    thread.join(timeout=60)
    assert message == "Request cancelled by client", (status, message)
    assert "error" not in result, result
    final = result["value"][-1] if endpoint == "generate_stream" else result["value"]
    assert final["finish_reason"] == "cancelled" and isinstance(final["text_output"], str)
    assert_freed(llmapi_server, before)


def test_a_grpc_stop_request_with_the_running_requests_id_aborts_it(llmapi_server):
    """The same over gRPC: the stop request carries the running request's request_id."""
    before = llmapi_server.wait_engine_idle()
    stream = llmapi_server.grpc_stream()
    stream.send(
        MODEL,
        inputs(sampling_param_max_tokens=llmapi_server.max_seq_len - 16, streaming=True, return_finish_reason=True),
        request_id="llmapi-stop-me",
    )
    reply = clients.StreamReply()
    while len(reply.results) < 3:
        clients.add_event(reply, *stream.next_event(timeout=30))
    stopper = llmapi_server.stream_infer(MODEL, inputs("", stop=True), request_id="llmapi-stop-me")
    assert stopper.error is not None and "Request cancelled by client" in stopper.error
    stream.collect(reply, timeout=30)
    stream.close()
    assert reply.error is None and reply.results[-1].as_numpy("finish_reason").tolist() == [b"cancelled"]
    assert_freed(llmapi_server, before)


def test_a_stop_for_an_unknown_id_is_answered_clearly_and_disturbs_nobody(llmapi_server):
    body = {"id": "busy", "text_input": PROMPT, "sampling_param_max_tokens": 64, "return_finish_reason": True}
    thread, result = in_background(lambda: llmapi_server.generate(body, model=MODEL))
    status, message = llmapi_server.generate_error({"id": "nobody", "text_input": "", "stop": True}, model=MODEL)
    thread.join(timeout=60)
    assert status == 400 and "no running request has the id 'nobody'" in message, (status, message)
    assert result["value"]["finish_reason"] in ("length", "stop")


def test_a_stop_request_without_an_id_is_refused(llmapi_server):
    status, message = llmapi_server.generate_error({"text_input": "", "stop": True}, model=MODEL)
    assert status == 400 and "request id must be provided" in message


PERF_OUTPUTS = (
    "kv_cache_reused_block",
    "kv_cache_missed_block",
    "kv_cache_alloc_new_blocks",
    "kv_cache_alloc_total_blocks",
    "kv_cache_hit_rate",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)


def test_sampling_param_return_perf_metrics_answers_the_kv_cache_and_timing_outputs_over_http(llmapi_server):
    body = {"text_input": PROMPT, "sampling_param_max_tokens": 4, "sampling_param_return_perf_metrics": True}
    reply = llmapi_server.generate(body, model=MODEL)
    assert set(PERF_OUTPUTS) <= set(reply), reply
    assert all(
        isinstance(reply[name], int) for name in PERF_OUTPUTS if name not in ("kv_cache_hit_rate", "acceptance_rate")
    )
    assert reply["kv_cache_alloc_new_blocks"] > 0 and reply["kv_cache_missed_block"] >= 1
    assert 0 < reply["arrival_time_ns"] <= reply["first_token_time_ns"] <= reply["last_token_time_ns"]
    assert not set(PERF_OUTPUTS) & set(llmapi_server.generate({"text_input": PROMPT}, model=MODEL))


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"image_url": "https://example.invalid/cat.png"}, "image_url"),
        ({"sampling_param_logits_post_processor_name": "json_only"}, "sampling_param_logits_post_processor_name"),
        ({"lora_name": "mine"}, "lora_id"),
        ({"lora_id": 3, "lora_name": "mine", "lora_path": "/"}, "lora_id"),  # LoRA is off in this repository
    ],
)
def test_inputs_that_cannot_be_served_are_refused_by_name(llmapi_server, extra, named):
    status, message = llmapi_server.generate_error({"text_input": PROMPT, **extra}, model=MODEL)
    assert status == 400 and f"'{named}'" in message, message


@pytest.mark.parametrize(
    "values, named",
    [
        (dict(sampling_param_max_tokens=0), "sampling_param_max_tokens"),
        (dict(sampling_param_top_p=0.0), "sampling_param_top_p"),
        (dict(sampling_param_max_tokens=100000), "sampling_param_max_tokens"),
    ],
)
def test_errors_name_the_input(llmapi_server, values, named):
    reply = llmapi_server.stream_infer(MODEL, inputs(**values))
    assert reply.error is not None and f"'{named}'" in reply.error


def test_the_llmapi_model_exports_the_metrics_families(llmapi_server):
    def count(samples, name):
        return sum(s.value for s in samples if s.name == name and s.labels.get("model") == MODEL)

    before = clients.parse_samples(llmapi_server.metrics_text())
    ok(llmapi_server.stream_infer(MODEL, inputs(sampling_param_max_tokens=3)))
    after = clients.parse_samples(llmapi_server.metrics_text())
    for name in (
        "nv_llm_input_token_len_count",
        "nv_llm_output_token_len_count",
        "nv_llm_time_to_first_token_seconds_count",
    ):
        assert count(after, name) - count(before, name) == 1, name
    families = {s.name for s in after if s.labels.get("model") == MODEL and s.labels.get("version") == "1"}
    assert {
        "nv_trt_llm_request_metrics",
        "nv_trt_llm_runtime_memory_metrics",
        "nv_trt_llm_kv_cache_block_metrics",
        "nv_trt_llm_inflight_batcher_metrics",
        "nv_trt_llm_general_metrics",
    } <= families


def test_a_repo_built_with_triton_config_params_and_a_hub_id_serves_as_built(
    tiny_model, tmp_path, monkeypatch, fill_hub_cache
):
    """`tritonllm repo build --llmapi --model org/name --param triton_config.decoupled=false --param
    triton_config.max_batch_size=8`: model.yaml keeps both and the id, Triton runs the model as built (its config
    says so), the id resolves through a hub cache filled here (HF_HOME, offline), and a plain infer answers."""
    import json

    from tritonllm.commands.main import main as cli_main
    from tritonllm.deploy.tritonserver import Ports, TritonServer

    fill_hub_cache(tmp_path / "hf_home" / "hub", "acme/tiny-llama", tiny_model)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # the server inherits the environment
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    repo = tmp_path / "repo"
    argv = ["repo", "build", "--llmapi", "--model", "acme/tiny-llama", "--out", str(repo), "--max-seq-len", "256"]
    argv += ["--param", "triton_config.decoupled=false", "--param", "triton_config.max_batch_size=8"]
    assert cli_main(argv) == 0
    with TritonServer(repo, Ports.free(), log_file=tmp_path / "tritonserver.log") as triton:
        server = clients.LiveServer(triton, tmp_path / "tritonserver.log", 256)
        connection = server.connection()
        connection.request("GET", f"/v2/models/{MODEL}/config")
        config = json.loads(connection.getresponse().read())
        connection.close()
        assert config["max_batch_size"] == 8 and config["model_transaction_policy"]["decoupled"] is False
        body = {
            "inputs": [
                {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [PROMPT]},
                {"name": "sampling_param_max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [4]},
                {"name": "return_finish_reason", "shape": [1, 1], "datatype": "BOOL", "data": [True]},
            ]
        }
        status, data = server.post(f"/v2/models/{MODEL}/infer", body)
        outputs = {output["name"]: output for output in json.loads(data)["outputs"]}
        assert status == 200 and outputs["text_output"]["shape"] == [1, 1]
        assert outputs["text_output"]["data"][0].startswith(PROMPT)
        assert outputs["finish_reason"]["data"][0] in ("length", "stop")
        reply = server.generate({"text_input": PROMPT, "sampling_param_max_tokens": 4}, model=MODEL)
        assert reply["text_output"].startswith(PROMPT)
        status, error = server.generate_error({"text_input": PROMPT, "streaming": True}, model=MODEL)
        assert "'streaming'" in error and "decoupled" in error
    log = (tmp_path / "tritonserver.log").read_text()
    assert "models--acme--tiny-llama" in log  # the engine ran from the cached snapshot
