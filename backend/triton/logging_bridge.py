"""Sends the package's `logging` records to Triton's log (pb_utils.Logger), so the server log tells what the
models do. Inside Triton only; elsewhere logging stays as configured."""

from __future__ import annotations

import logging


class TritonLogHandler(logging.Handler):
    def __init__(self, logger):
        super().__init__()
        self.logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        message = f"[{record.name}] {self.format(record)}"
        if record.levelno >= logging.ERROR:
            self.logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            self.logger.log_warn(message)  # the stub has log_warn, not log_warning
        elif record.levelno >= logging.INFO:
            self.logger.log_info(message)
        else:
            self.logger.log_verbose(message)


def route_logs_to_triton(level: int = logging.INFO) -> None:
    try:
        import triton_python_backend_utils as pb_utils
    except ImportError:
        return
    package_logger = logging.getLogger("tritonllm")
    if not any(isinstance(h, TritonLogHandler) for h in package_logger.handlers):
        package_logger.addHandler(TritonLogHandler(pb_utils.Logger))
        package_logger.setLevel(level)
        package_logger.propagate = False
