"""The TensorRT-LLM adapter against a recording stand-in of the LLM API (tests/engine/fake_tensorrt_llm.py):
what LLM() and SamplingParams are built with, how outputs come back (streaming deltas, finals, callbacks, abort),
stats, shutdown, and engine selection. The real library is never imported here."""

from __future__ import annotations

import asyncio
import datetime
import importlib
import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import torch

from tritonllm.engine import create_engine, trtllm_args, trtllm_outputs
from tritonllm.engine import trtllm as adapter
from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.seam import EngineError
from tritonllm.engine.types import GuidedDecodingParams, InvalidRequestError, SamplingParams

WAIT = 5.0  # seconds any single output may take before a test fails instead of hanging


def load_fake(monkeypatch):
    """A fresh copy of the stand-in per test, so recorded calls never leak between tests."""
    path = Path(__file__).resolve().parent / "fake_tensorrt_llm.py"
    spec = importlib.util.spec_from_file_location("fake_tensorrt_llm", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake(monkeypatch):
    module = load_fake(monkeypatch)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    return module


@pytest.fixture
def engine(fake):
    engine = adapter.TensorRTLLMEngine(EngineConfig.from_dict({"model": "some/model", "engine": "tensorrt_llm"}))
    yield engine
    engine.shutdown()


def collect(handle) -> list:
    outputs = []
    while True:
        try:
            outputs.append(handle._next(WAIT))
        except StopIteration:
            return outputs


def params(**overrides) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "end_id": 2, **overrides})


# -- LLM() arguments ------------------------------------------------------------------------------------------


def test_llm_kwargs_maps_every_engine_setting(fake):
    config = EngineConfig.from_dict(
        {
            "model": "org/llama",
            "tokenizer": "org/llama-tokenizer",
            "engine": "tensorrt_llm",
            "device": "cuda",
            "dtype": "bfloat16",
            "max_batch_size": 16,
            "max_num_tokens": 4096,
            "max_seq_len": 2048,
            "max_beam_width": 2,
            "enable_chunked_prefill": True,
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 1,
            "backend": "pytorch",
            "normalize_log_probs": False,
            "kv_cache_config": {
                "enable_block_reuse": False,
                "tokens_per_block": 64,
                "max_tokens": 100000,
                "free_gpu_memory_fraction": 0.5,
            },
            "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"},
            # keys EngineConfig does not know go through unchanged
            "enable_iter_perf_stats": True,
            "cuda_graph_config": {"batch_sizes": [1, 2, 4]},
        }
    )
    engine = adapter.TensorRTLLMEngine(config)
    try:
        llm = engine.llm
        kwargs = llm.called_with
        kv, scheduler = kwargs.pop("kv_cache_config"), kwargs.pop("scheduler_config")
        assert kwargs == {
            "model": "org/llama",
            "tokenizer": "org/llama-tokenizer",
            "dtype": "bfloat16",
            "max_batch_size": 16,
            "max_num_tokens": 4096,
            "max_seq_len": 2048,
            "max_beam_width": 2,
            "enable_chunked_prefill": True,
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 1,
            "backend": "pytorch",
            "enable_iter_perf_stats": True,
            "cuda_graph_config": {"batch_sizes": [1, 2, 4]},
        }
        assert isinstance(kv, fake.KvCacheConfig)
        assert kv.called_with == {
            "enable_block_reuse": False,
            "tokens_per_block": 64,
            "max_tokens": 100000,
            "free_gpu_memory_fraction": 0.5,
        }
        assert isinstance(scheduler, fake.SchedulerConfig)
        assert scheduler.called_with == {"capacity_scheduler_policy": fake.CapacitySchedulerPolicy.MAX_UTILIZATION}
    finally:
        engine.shutdown()


def test_llm_kwargs_leaves_unset_settings_to_the_library(fake):
    kwargs = trtllm_args.llm_kwargs(EngineConfig(model="m", engine="tensorrt_llm"), fake)
    assert set(kwargs) == {
        "model",
        "dtype",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "max_batch_size",
        "max_num_tokens",
        "max_beam_width",
        "enable_chunked_prefill",
        "kv_cache_config",
        "scheduler_config",
    }
    assert kwargs["scheduler_config"].capacity_scheduler_policy is fake.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    assert kwargs["kv_cache_config"].called_with == {
        "enable_block_reuse": True,
        "tokens_per_block": 32,
        "max_tokens": None,
        "free_gpu_memory_fraction": 0.9,
    }


def test_llm_kwargs_passes_the_attention_windows(fake):
    config = EngineConfig.from_dict(
        {"model": "m", "engine": "tensorrt_llm", "kv_cache_config": {"max_attention_window": [4096, 1024]}}
    )
    kv = trtllm_args.llm_kwargs(config, fake)["kv_cache_config"]
    assert kv.called_with["max_attention_window"] == [4096, 1024]


def test_llm_kwargs_passes_an_fp8_kv_cache_dtype(fake):
    config = EngineConfig.from_dict({"model": "m", "engine": "tensorrt_llm", "kv_cache_config": {"dtype": "fp8"}})
    assert trtllm_args.llm_kwargs(config, fake)["kv_cache_config"].called_with["dtype"] == "fp8"


def test_llm_kwargs_passes_lora_and_speculative_settings(fake):
    config = EngineConfig(
        model="m",
        enable_lora=True,
        lora_config={"lora_dir": ["a"]},
        speculative_config={"decoding_type": "NGram", "max_draft_len": 4},
    )
    kwargs = trtllm_args.llm_kwargs(config, fake)
    assert kwargs["enable_lora"] is True
    assert kwargs["lora_config"] == {"lora_dir": ["a"]}
    assert kwargs["speculative_config"] == {"decoding_type": "NGram", "max_draft_len": 4}


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"decoding_type": "Medusa", "speculative_model_dir": "/heads", "min_path_probability": 0.1},
            "speculative_config.min_path_probability is an extension of the embedded engine",
        ),
        (
            {"decoding_type": "Eagle", "speculative_model_dir": "builtin:smollm2"},
            "speculative_model_dir=builtin:smollm2: the drafters shipped with tritonllm",
        ),
    ],
)
def test_embedded_only_speculative_settings_are_refused_naming_the_key(fake, spec, message):
    with pytest.raises(ConfigError, match=message):
        trtllm_args.llm_kwargs(EngineConfig(model="m", speculative_config=spec), fake)


def test_llm_kwargs_refusals(fake):
    with pytest.raises(ConfigError, match="CUDA GPUs only"):
        trtllm_args.llm_kwargs(EngineConfig(model="m", device="cpu"), fake)
    with pytest.raises(ConfigError, match="given twice"):
        trtllm_args.llm_kwargs(EngineConfig(model="m", extra={"max_batch_size": 3}), fake)


def test_an_unknown_extra_key_reaches_the_library_which_refuses_it(fake):
    config = EngineConfig.from_dict({"model": "m", "engine": "tensorrt_llm", "no_such_knob": 1})
    with pytest.raises(ValueError, match="invalid argument: no_such_knob"):
        adapter.TensorRTLLMEngine(config)


# -- SamplingParams -------------------------------------------------------------------------------------------


def test_sampling_params_maps_every_field(fake):
    ours = SamplingParams(
        max_tokens=20,
        end_id=2,
        pad_id=0,
        n=2,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        seed=1234,
        min_tokens=3,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        stop_token_ids=[7, 8],
        stop_words=[[11, 12], [13]],
        bad_words=[[21], [22, 23, 24]],
        embedding_bias=[0.0, -1.5, 2.0],
        logprobs=True,
        ignore_eos=True,
        length_penalty=0.8,
        early_stopping=1,
        return_perf_metrics=True,
    )
    theirs = trtllm_args.trtllm_sampling_params(ours, fake)
    assert isinstance(theirs, fake.SamplingParams)
    expected = {
        "max_tokens": 20,
        "end_id": 2,
        "pad_id": 0,
        "n": 2,
        "best_of": 2,
        "use_beam_search": False,
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "seed": 1234,
        "min_tokens": 3,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.3,
        "stop_token_ids": [7, 8],
        "logprobs": 1,
        "ignore_eos": True,
        "length_penalty": 0.8,
        "early_stopping": 1,
        "return_perf_metrics": True,
        "detokenize": False,
        "include_stop_str_in_output": True,
    }
    assert {name: getattr(theirs, name) for name in expected} == expected
    assert theirs.embedding_bias.dtype == torch.float32
    assert theirs.embedding_bias.tolist() == [0.0, -1.5, 2.0]
    # what the library hands the executor: single stop tokens first, then our sequences
    assert theirs._get_stop_words() == [[7], [8], [11, 12], [13]]
    assert theirs._get_bad_words() == [[21], [22, 23, 24]]
    reasons = [reason for reason, _ in theirs._get_stop_reasons_and_words()]
    assert reasons[:2] == [7, 8]
    assert [trtllm_outputs.stop_reason_from_trtllm(r, "stop", ours.stop_words, 2) for r in reasons[2:]] == [
        [11, 12],
        [13],
    ]


def test_sampling_params_defaults_leave_the_library_defaults(fake):
    theirs = trtllm_args.trtllm_sampling_params(SamplingParams(max_tokens=5), fake)
    assert theirs.end_id is None and theirs.stop is None and theirs.bad is None
    assert theirs.logprobs is None and theirs.embedding_bias is None and theirs.stop_token_ids is None
    assert theirs._get_stop_words() == [] and theirs._get_bad_words() == []


def test_sampling_params_beam_width_becomes_beam_search(fake):
    theirs = trtllm_args.trtllm_sampling_params(SamplingParams(max_tokens=5, end_id=2, beam_width=3), fake)
    assert theirs.use_beam_search is True and theirs.best_of == 3 and theirs.n == 1


def test_the_stand_in_refuses_misspelt_arguments(fake):
    with pytest.raises(TypeError):
        fake.SamplingParams(stop_words=[[1]])
    with pytest.raises(TypeError):
        fake.KvCacheConfig(block_size=16)
    with pytest.raises(TypeError):
        fake.SchedulerConfig(policy="MAX_UTILIZATION")


def test_stop_words_survive_the_library_setup_when_end_id_is_unset(engine, fake):
    ours = SamplingParams(max_tokens=5, stop_words=[[11, 12]], bad_words=[[21, 22]])
    collect(engine.generate_async([1, 2, 3], ours))
    sent = engine.llm.generate_calls[-1]["sampling_params"]
    assert sent.end_id == fake.FakeTokenizer.eos_token_id  # filled by the adapter, so no re-encoding happened
    assert sent._get_stop_words() == [[11, 12]]
    assert sent._get_bad_words() == [[21, 22]]
    # Had end_id stayed unset, the library's setup would have replaced our ids with the placeholder's encoding.
    unsafe = trtllm_args.trtllm_sampling_params(ours, fake)
    engine.llm._prepare_sampling_params(unsafe)
    assert unsafe._get_stop_words() != [[11, 12]]


def test_end_id_unset_without_words_is_left_to_the_library(engine):
    collect(engine.generate_async([1, 2, 3], SamplingParams(max_tokens=5)))
    assert engine.llm.generate_calls[-1]["sampling_params"].end_id == 2  # the library's tokenizer filled it


def test_a_refusal_by_the_library_raises_at_submission(engine):
    # The LLM API refuses several greedy samples; the error reaches the caller, as a bad request would.
    with pytest.raises(ValueError, match="greedy"):
        engine.generate_async([1, 2, 3], params(n=2))
    assert engine.num_in_flight == 0


def test_our_own_checks_run_before_the_library(engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate_async([], params())
    with pytest.raises(InvalidRequestError, match="top_p"):
        engine.generate_async([1], params(top_p=1.5))
    with pytest.raises(InvalidRequestError, match="no request priority"):
        engine.generate_async([1], params(priority=0.9))
    assert engine.llm.generate_calls == []


def test_a_continued_guided_output_is_refused_by_name(fake):
    from tritonllm.engine.types import GuidedDecodingParams

    config = EngineConfig.from_dict({"model": "m", "engine": "tensorrt_llm", "guided_decoding_backend": "xgrammar"})
    engine = adapter.TensorRTLLMEngine(config)
    try:
        guide = GuidedDecodingParams(regex="a+")
        with pytest.raises(InvalidRequestError, match="guided_prefix_len .* TensorRT-LLM has no such setting"):
            engine.generate_async([1, 2], params(guided_decoding=guide, guided_prefix_len=1))
        assert engine.llm.generate_calls == []
    finally:
        engine.shutdown()


# -- outputs --------------------------------------------------------------------------------------------------


def test_streaming_updates_carry_only_new_tokens(engine, fake):
    engine.llm.scripts.append(
        [fake.Update([5]), fake.Update([5, 6, 7]), fake.Update([5, 6, 7, 8], finish_reason="length")]
    )
    outputs = collect(engine.generate_async([1, 2, 3], params(), streaming=True))
    assert [o.outputs[0].token_ids_diff for o in outputs] == [[5], [6, 7], [8]]
    assert [o.finished for o in outputs] == [False, False, True]
    assert [o.outputs[0].finish_reason for o in outputs] == [None, None, "length"]
    assert outputs[-1].outputs[0].token_ids == [5, 6, 7, 8]
    assert all(o.prompt_token_ids == [1, 2, 3] for o in outputs)


def test_streaming_with_two_sequences_keeps_each_delta_apart(engine, fake):
    engine.llm.scripts.append(
        [
            fake.Update([5], index=0),
            fake.Update([6], index=1),
            fake.Update([5, 7], index=0, finish_reason="length"),
            fake.Update([6, 8], index=1, finish_reason="stop"),
        ]
    )
    outputs = collect(engine.generate_async([1], params(n=2, temperature=0.8), streaming=True))
    diffs = [[c.token_ids_diff for c in o.outputs] for o in outputs]
    assert diffs == [[[5], []], [[], [6]], [[7], []], [[], [8]]]
    assert [c.finish_reason for c in outputs[-1].outputs] == ["length", "stop"]
    assert outputs[-1].finished


def test_non_streaming_gives_one_final_output(engine, fake):
    engine.llm.scripts.append([fake.Update([5]), fake.Update([5, 6]), fake.Update([5, 6, 7], finish_reason="stop")])
    handle = engine.generate_async([1, 2, 3], params())
    outputs = collect(handle)
    assert len(outputs) == 1
    final = outputs[0]
    assert final.finished and final.outputs[0].token_ids == [5, 6, 7]
    assert final.outputs[0].token_ids_diff == [5, 6, 7]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == 2  # the end token
    assert handle.result() is final and handle.finished


def test_handles_are_async_iterable(engine, fake):
    engine.llm.scripts.append([fake.Update([5]), fake.Update([5, 6], finish_reason="length")])
    handle = engine.generate_async([1], params(), streaming=True)

    async def consume():
        return [o.outputs[0].token_ids_diff async for o in handle]

    assert asyncio.run(asyncio.wait_for(consume(), WAIT)) == [[5], [6]]


def test_on_output_callbacks_receive_every_update(engine, fake):
    engine.llm.scripts.append([fake.Update([5]), fake.Update([5, 6], finish_reason="length")])
    received, done = [], threading.Event()

    def on_output(handle, item):
        received.append((handle, item, threading.current_thread().name))
        if item.finished:
            done.set()

    handle = engine.generate_async([1], params(), streaming=True, on_output=on_output)
    assert done.wait(WAIT)
    assert [item.outputs[0].token_ids_diff for _, item, _ in received] == [[5], [6]]
    assert all(h is handle for h, _, _ in received)
    assert {thread for _, _, thread in received} == {"tritonllm-trtllm-loop"}


def test_every_request_is_submitted_on_the_one_loop_thread(engine):
    handles = [engine.generate_async([1, i], params(), streaming=True) for i in range(3)]
    for handle in handles:
        collect(handle)
    calls = engine.llm.generate_calls
    assert len(calls) == 3
    assert {c["thread"] for c in calls} == {"tritonllm-trtllm-loop"} and all(c["loop_running"] for c in calls)
    assert [c["inputs"] for c in calls] == [[1, 0], [1, 1], [1, 2]]
    assert all(c["streaming"] for c in calls)
    loop_threads = [t for t in threading.enumerate() if t.name == "tritonllm-trtllm-loop"]
    assert len(loop_threads) == 1  # one loop thread for all requests, not one per request


def test_stop_reasons_come_back_in_our_terms(engine, fake):
    stop_words = [[3, 4], [9, 10]]
    engine.llm.scripts.append(
        [fake.Update([5, 9, 10], finish_reason="stop", stop_reason=f"{trtllm_args.STOP_WORD_PREFIX}1")]
    )
    final = engine.generate_async([1], params(stop_words=stop_words)).result(WAIT)
    assert final.outputs[0].stop_reason == [9, 10]
    engine.llm.scripts.append([fake.Update([5, 7], finish_reason="stop", stop_reason=7)])
    assert engine.generate_async([1], params(stop_token_ids=[7])).result(WAIT).outputs[0].stop_reason == 7


def test_logprobs_and_perf_metrics_are_converted(engine, fake):
    perf = fake.RequestPerfMetrics(
        timing_metrics=fake.TimingMetrics(
            arrival_time=datetime.timedelta(seconds=100, microseconds=1),
            first_scheduled_time=datetime.timedelta(seconds=100, microseconds=2),
            first_token_time=datetime.timedelta(seconds=101),
            last_token_time=datetime.timedelta(seconds=102),
        ),
        kv_cache_metrics=fake.KvCacheMetrics(
            num_total_allocated_blocks=3, num_new_allocated_blocks=2, num_reused_blocks=1
        ),
        speculative_decoding=fake.SpeculativeDecodingMetrics(total_accepted_draft_tokens=4, total_draft_tokens=6),
    )
    top = [{5: fake.Logprob(-0.5, 1), 9: fake.Logprob(-2.0, 2)}, {9: fake.Logprob(-0.1, 1), 6: fake.Logprob(-3.0, 2)}]
    engine.llm.scripts.append([fake.Update([5, 6], finish_reason="length", logprobs=top, request_perf_metrics=perf)])
    completion = engine.generate_async([1], params(logprobs=True, return_perf_metrics=True)).result(WAIT).outputs[0]
    assert completion.logprobs == [-0.5, -3.0]  # the sampled tokens' entries
    assert completion.cumulative_logprob == pytest.approx(-3.5)
    metrics = completion.request_perf_metrics
    assert metrics.arrival_time_ns == 100_000_001_000 and metrics.first_scheduled_time_ns == 100_000_002_000
    assert metrics.first_token_time_ns == 101_000_000_000 and metrics.last_token_time_ns == 102_000_000_000
    assert (metrics.kv_cache_alloc_total_blocks, metrics.kv_cache_alloc_new_blocks, metrics.kv_cache_reused_blocks) == (
        3,
        2,
        1,
    )
    assert (metrics.total_draft_tokens, metrics.total_accepted_draft_tokens) == (6, 4)
    assert metrics.num_preemptions == 0 and metrics.prefill_steps == 0  # the library does not report these


def test_float_logprobs_and_a_library_cumulative_logprob_pass_through(engine, fake):
    engine.llm.scripts.append(
        [fake.Update([5, 6], finish_reason="length", logprobs=[-1.0, -2.0], cumulative_logprob=-3.25)]
    )
    completion = engine.generate_async([1], params(logprobs=True)).result(WAIT).outputs[0]
    assert completion.logprobs == [-1.0, -2.0] and completion.cumulative_logprob == -3.25


# -- abort, ids, stats, shutdown ------------------------------------------------------------------------------


def test_abort_reaches_the_library_and_ends_the_request(engine, fake):
    engine.llm.scripts.append([fake.Update([5]), fake.WAIT_FOR_ABORT])
    handle = engine.generate_async([1], params(), streaming=True)
    first = handle._next(WAIT)
    assert first.outputs[0].token_ids == [5] and not first.finished
    engine.abort(handle.request_id)
    final = handle._next(WAIT)
    assert final.finished and final.outputs[0].finish_reason == "cancelled"
    assert engine.llm.aborted == [1000]  # the library's own id for the request
    assert engine.llm.abort_threads == ["tritonllm-trtllm-loop"]
    engine.abort(handle.request_id)  # already finished: ignored
    engine.wait_idle(WAIT)
    assert engine.llm.aborted == [1000]


def test_handle_abort_goes_through_the_engine(engine, fake):
    engine.llm.scripts.append([fake.WAIT_FOR_ABORT])
    handle = engine.generate_async([1], params())
    handle.abort()
    assert handle.result(WAIT).outputs[0].finish_reason == "cancelled"


def test_request_ids_are_ours(engine, fake):
    engine.llm.scripts.append([fake.WAIT_FOR_ABORT])
    handle = engine.generate_async([1], params(), request_id=77)
    assert handle.request_id == 77
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.generate_async([1], params(), request_id=77)
    engine.abort(77)
    handle.result(WAIT)
    automatic = [engine.generate_async([1], params()) for _ in range(2)]
    assert automatic[0].request_id != automatic[1].request_id


def test_stats_use_iteration_stats_when_the_library_has_them(engine, fake):
    engine.llm.scripts.append([fake.WAIT_FOR_ABORT])
    handle = engine.generate_async([1], params())
    engine.llm.stats_records.append({"iter": 41, "numActiveRequests": 1, "numQueuedRequests": 0})
    engine.llm.stats_records.append(
        {
            "iter": 42,
            "numActiveRequests": 1,
            "numQueuedRequests": 2,
            "kvCacheStats": {"maxNumBlocks": 100, "freeNumBlocks": 60, "tokensPerBlock": 64},
        }
    )
    stats = engine.stats()
    assert (stats.num_steps, stats.num_running, stats.num_waiting) == (42, 1, 2)
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.tokens_per_block) == (100, 60, 64)
    assert (stats.max_batch_size, stats.max_num_tokens) == (64, 8192)
    assert engine.llm.get_stats_timeouts[-1] == adapter.STATS_POLL_TIMEOUT_S
    handle.abort()
    idle = engine.wait_idle(WAIT)
    assert (idle.num_running, idle.num_waiting, idle.num_steps) == (0, 0, 42)


def test_stats_without_iteration_stats_report_what_the_adapter_knows(engine, fake):
    assert engine.stats().num_running == 0
    engine.llm.scripts.append([fake.WAIT_FOR_ABORT])
    handle = engine.generate_async([1], params())
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_total_blocks, stats.tokens_per_block) == (1, 0, 0, 32)
    handle.abort()
    engine.wait_idle(WAIT)


def test_shutdown_cancels_running_requests_and_shuts_the_llm_down(fake):
    engine = adapter.TensorRTLLMEngine(EngineConfig(model="m", engine="tensorrt_llm"))
    engine.llm.scripts.append([fake.WAIT_FOR_ABORT])
    handle = engine.generate_async([1], params())
    engine.shutdown()
    assert handle.result(WAIT).outputs[0].finish_reason == "cancelled"
    assert engine.llm.shutdown_calls == 1
    assert not engine._loop.thread.is_alive()
    with pytest.raises(EngineError, match="shut down"):
        engine.generate_async([1], params())
    engine.shutdown()  # a second call does nothing
    assert engine.llm.shutdown_calls == 1


def test_a_failing_library_result_fails_only_its_request(engine, fake, monkeypatch):
    def broken(self):
        raise RuntimeError("executor died")

    engine.llm.scripts.append([fake.WAIT_FOR_ABORT])
    handle = engine.generate_async([1], params())
    with monkeypatch.context() as patch:
        patch.setattr(fake.GenerationResult, "_cancel", broken)
        handle.abort()
        with pytest.raises(EngineError, match="executor died"):
            handle.result(WAIT)
    assert engine.generate_async([1], params()).result(WAIT).finished


# -- selection ------------------------------------------------------------------------------------------------


def test_create_engine_picks_the_adapter(fake):
    engine = create_engine(EngineConfig(model="m", engine="tensorrt_llm"))
    try:
        assert isinstance(engine, adapter.TensorRTLLMEngine)
        assert isinstance(engine.llm, fake.LLM)
    finally:
        engine.shutdown()


def test_a_missing_library_gives_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # makes `import tensorrt_llm` fail
    importlib.reload(adapter)  # importing the adapter module itself never needs the library
    with pytest.raises(ImportError, match="TensorRT-LLM is not installed; use engine: embedded"):
        create_engine(EngineConfig(model="m", engine="tensorrt_llm"))


def test_sampling_params_lookahead_config_becomes_the_executor_binding(fake):
    from tritonllm.spec_decode.config import LookaheadConfig

    ours = SamplingParams(
        max_tokens=5, lookahead_config=LookaheadConfig(max_window_size=3, max_ngram_size=4, max_verification_set_size=2)
    )
    theirs = trtllm_args.trtllm_sampling_params(ours, fake)
    assert theirs.lookahead_config == fake.bindings.executor.LookaheadDecodingConfig(3, 4, 2)
    assert trtllm_args.trtllm_sampling_params(SamplingParams(max_tokens=5), fake).lookahead_config is None


def test_attention_backend_and_overlap_switch_pass_through_only_when_set():
    from tritonllm.engine.config import ConfigError, EngineConfig
    from tritonllm.engine.trtllm_args import _optional_llm_kwargs

    default = _optional_llm_kwargs(EngineConfig.from_dict({"model": "m"}))
    assert not {"attn_backend", "disable_overlap_scheduler", "load_format"} & set(default)
    chosen = _optional_llm_kwargs(
        EngineConfig.from_dict(
            {"model": "m", "attn_backend": "flashinfer", "disable_overlap_scheduler": True, "load_format": "DUMMY"}
        )
    )
    assert (chosen["attn_backend"], chosen["disable_overlap_scheduler"], chosen["load_format"]) == (
        "FLASHINFER",
        True,
        "dummy",
    )
    with pytest.raises(ConfigError, match="TRITON"):
        _optional_llm_kwargs(EngineConfig.from_dict({"model": "m", "attn_backend": "TRITON"}))


# -- guided decoding ----------------------------------------------------------------------------------------------


def test_guided_decoding_backend_passes_through_when_set(fake):
    on = trtllm_args.llm_kwargs(
        EngineConfig(model="m", engine="tensorrt_llm", guided_decoding_backend="xgrammar"), fake
    )
    assert on["guided_decoding_backend"] == "xgrammar"
    assert "guided_decoding_backend" not in trtllm_args.llm_kwargs(EngineConfig(model="m", engine="tensorrt_llm"), fake)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (GuidedDecodingParams(json={"type": "object"}), {"json": {"type": "object"}}),
        (GuidedDecodingParams(json='{"type": "string"}'), {"json": '{"type": "string"}'}),
        (GuidedDecodingParams(json_object=True), {"json_object": True}),
        (GuidedDecodingParams(regex="[ab]+"), {"regex": "[ab]+"}),
        (GuidedDecodingParams(grammar='root ::= "x"'), {"grammar": 'root ::= "x"'}),
        (
            GuidedDecodingParams(structural_tag={"type": "structural_tag"}),
            {"structural_tag": '{"type": "structural_tag"}'},
        ),
    ],
)
def test_sampling_params_guided_decoding_becomes_the_library_params(fake, ours, theirs):
    mapped = trtllm_args.trtllm_sampling_params(SamplingParams(max_tokens=5, guided_decoding=ours), fake)
    assert isinstance(mapped.guided_decoding, fake.GuidedDecodingParams)
    defaults = {"json": None, "regex": None, "grammar": None, "json_object": False, "structural_tag": None}
    got = {name: getattr(mapped.guided_decoding, name) for name in defaults}
    assert got == {**defaults, **theirs}
    assert trtllm_args.trtllm_sampling_params(SamplingParams(max_tokens=5), fake).guided_decoding is None


def test_a_guided_request_without_a_backend_is_refused_naming_it(engine):
    guided = params(guided_decoding=GuidedDecodingParams(regex="a+"))
    with pytest.raises(InvalidRequestError, match="guided_decoding_backend"):
        engine.generate_async([1, 2, 3], guided)
