"""The `tensorrt_llm` Triton model: token ids in, token ids out, an engine behind TensorRT-LLM's LLM-API seam."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..engine import choose_engine, create_engine
from ..triton.engine_args import load_tensorrt_llm_settings
from ..triton.llm_metrics import EngineMetrics
from ..triton.llm_server import LLMRequestServer
from ..triton.logging_bridge import route_logs_to_triton
from ..triton.request_metrics import RequestMetrics


class TritonPythonModel:
    def initialize(self, args):
        route_logs_to_triton()
        log = logging.getLogger("tritonllm.tensorrt_llm")
        model_config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"])
        settings = load_tensorrt_llm_settings(model_config, model_dir)
        log.info("starting the %s engine for %s (decoupled=%s)", choose_engine(settings.engine),
                 settings.engine.model, settings.decoupled)
        self.engine = create_engine(settings.engine)
        self.request_metrics = RequestMetrics(args["model_name"], args["model_version"])
        self.server = LLMRequestServer(self.engine, settings.decoupled, settings.exclude_input_in_output,
                                       settings.cancellation_check_period_ms, on_finished=self.request_metrics.observe)
        self.metrics = EngineMetrics(self.engine.stats, args["model_name"], args["model_version"],
                                     settings.stats_check_period_ms).start()

    def execute(self, requests):
        for request in requests:
            self.server.submit(request)
        return None

    def finalize(self):
        self.metrics.stop()
        self.server.shutdown()
        self.engine.shutdown()
