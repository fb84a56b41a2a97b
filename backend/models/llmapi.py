"""The LLM-API `tensorrt_llm` Triton model (contract 1.3): text in, text out, one engine behind the LLM-API seam.

Everything is configured by `1/model.yaml`: engine arguments (TensorRT-LLM `LLM()` keys) and `triton_config`
(max_batch_size, decoupled), which `auto_complete_config` hands to Triton, as TensorRT-LLM's llmapi model does.
It exports the same metrics as the token-level `tensorrt_llm` model (docs/metrics.md)."""

from __future__ import annotations

import json
import logging

from tritonllm.triton.llmapi_inflight import LLMAPIInflightRequests

from ..engine import choose_engine
from ..triton.engine_args import is_decoupled
from ..triton.engine_model import EngineBackedModel
from ..triton.llmapi_config import load_llmapi_settings, load_llmapi_tokenizer, model_yaml_path, read_triton_config
from ..triton.logging_bridge import route_logs_to_triton
from ..triton.parent_watch import exit_with_parent
from ..triton.pb import pb_utils


class TritonPythonModel(EngineBackedModel):
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        triton = read_triton_config(model_yaml_path(pb_utils().get_model_dir()))
        auto_complete_model_config.set_model_transaction_policy({"decoupled": triton.decoupled})
        auto_complete_model_config.set_max_batch_size(triton.max_batch_size)
        return auto_complete_model_config

    def initialize(self, args):
        exit_with_parent()
        route_logs_to_triton()
        log = logging.getLogger("tritonllm.llmapi")
        model_config = json.loads(args["model_config"])
        settings = load_llmapi_settings(pb_utils().get_model_dir(), model_config)
        decoupled = is_decoupled(model_config)  # what Triton runs, as auto_complete_config set it
        log.info(
            "starting the %s engine for %s from %s (decoupled=%s)",
            choose_engine(settings.engine),
            settings.engine.model,
            settings.yaml_path,
            decoupled,
        )
        tokenizer = load_llmapi_tokenizer(settings)

        def inflight(engine, on_finished):
            return LLMAPIInflightRequests(
                engine,
                tokenizer,
                decoupled,
                settings.cancellation_check_period_ms,
                on_finished=on_finished,
                batched=settings.triton.max_batch_size > 0,
            )

        self.start(settings.engine, args, settings.stats_check_period_ms, inflight)
