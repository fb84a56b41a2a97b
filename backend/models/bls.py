"""The `tensorrt_llm_bls` Triton model: text in, text out through preprocessing, tensorrt_llm and
postprocessing, orchestrated here (see tritonllm.bls for the design)."""

from __future__ import annotations

import json
import logging

from tritonllm.bls.inflight import BlsInflightRequests

from ..bls.config import BlsConfig
from ..bls.llm_calls import ExecTransport, GrpcTransport
from ..triton.logging_bridge import route_logs_to_triton
from ..triton.parent_watch import exit_with_parent
from ..triton.start_errors import reports_start_errors


class TritonPythonModel:
    @reports_start_errors
    def initialize(self, args):
        exit_with_parent()
        route_logs_to_triton()
        config = BlsConfig.from_model_config(json.loads(args["model_config"]))
        transport = _transport(config, config.llm_model_name)
        draft = _transport(config, config.draft_model_name) if config.draft_model_name else None
        self.inflight = BlsInflightRequests(
            transport,
            config.decoupled,
            config.accumulate_tokens,
            config.cancellation_check_period_ms,
            draft_transport=draft,
        )

    def execute(self, requests):
        for request in requests:
            self.inflight.submit(request)
        return None

    def finalize(self):
        self.inflight.shutdown()


def _transport(config: BlsConfig, model: str):
    if not config.decoupled:
        return ExecTransport(model)
    transport = GrpcTransport(config.resolved_grpc_url(), model)
    logging.getLogger("tritonllm.tensorrt_llm_bls").info("calling %s over gRPC at %s", model, transport.url)
    return transport
