"""What the two engine-backed Triton models share: an engine, its in-flight requests (answered through response
senders), request metrics and engine gauges; `execute` only hands requests over, `finalize` stops all three."""

from __future__ import annotations

from typing import Any, Callable

from ..engine import create_engine
from ..engine.config import EngineConfig
from .llm_metrics import EngineMetrics
from .rank_watch import stop_server_when_engine_fails
from .request_metrics import RequestMetrics


class EngineBackedModel:
    def start(
        self,
        engine_config: EngineConfig,
        args: dict,
        stats_check_period_ms: int,
        make_inflight: Callable[[Any, Callable], Any],
    ) -> None:
        """Start the engine, the in-flight requests `make_inflight(engine, on_finished)` builds, and the metrics."""
        name, version = args["model_name"], args["model_version"]
        self.engine = create_engine(engine_config)
        self.request_metrics = RequestMetrics(name, version)
        self.inflight = make_inflight(self.engine, self.request_metrics.observe)
        self.metrics = EngineMetrics(self.engine.stats, name, version, stats_check_period_ms).start()
        if engine_config.world_size > 1:  # leader mode: a lost rank ends the server
            stop_server_when_engine_fails(self.engine)

    def execute(self, requests):
        for request in requests:
            self.inflight.submit(request)
        return None

    def finalize(self):
        self.metrics.stop()
        self.inflight.shutdown()
        self.engine.shutdown()
        self.request_metrics.release()
