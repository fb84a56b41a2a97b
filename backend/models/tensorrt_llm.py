"""The `tensorrt_llm` Triton model: token ids in, token ids out, an engine behind TensorRT-LLM's LLM-API seam."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tritonllm.triton.llm_inflight import LLMInflightRequests

from ..engine import choose_engine
from ..triton.engine_args import load_tensorrt_llm_settings
from ..triton.engine_model import EngineBackedModel
from ..triton.logging_bridge import route_logs_to_triton
from ..triton.parent_watch import exit_with_parent
from ..triton.start_errors import reports_start_errors


class TritonPythonModel(EngineBackedModel):
    @reports_start_errors
    def initialize(self, args):
        exit_with_parent()
        route_logs_to_triton()
        log = logging.getLogger("tritonllm.tensorrt_llm")
        model_config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"])
        settings = load_tensorrt_llm_settings(model_config, model_dir)
        log.info(
            "starting the %s engine for %s (decoupled=%s)",
            choose_engine(settings.engine),
            settings.engine.model,
            settings.decoupled,
        )

        def inflight(engine, on_finished):
            return LLMInflightRequests(
                engine,
                settings.decoupled,
                settings.exclude_input_in_output,
                settings.cancellation_check_period_ms,
                on_finished=on_finished,
            )

        self.start(settings.engine, args, settings.stats_check_period_ms, inflight)
