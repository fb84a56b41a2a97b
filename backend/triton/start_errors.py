"""One structured line in Triton's log for a model whose `initialize` failed, so that `tritonllm serve` can tell
which model failed and why, on its last lines, without digging through the server's log.

Triton reports the failure too ("failed to load '<model>' ..."), but with the Python traceback appended and the
cause wrapped in its status text. The line written here is `START_ERROR_MARKER` and a JSON object: the model, the
error's type and message, whether it is a user's mistake (a bad parameter, file or folder: no traceback then) and,
for anything else (a bug), the traceback."""

from __future__ import annotations

import functools
import json
import traceback
from typing import Any, Callable

START_ERROR_MARKER = "tritonllm start error:"

# Errors that mean a bad input (a parameter, model.yaml, a model or tokenizer folder), matched by class name along
# the exception's MRO, so that this module imports nothing of the engine.
USER_ERROR_NAMES = frozenset(
    {
        "ParameterError",
        "ConfigError",
        "ModelLoadError",
        "InvalidRequestError",
        "TokenizerFolderError",
        "LoraFormatError",
        "LoraSettingsError",
        "SpecConfigError",
        "CheckpointError",
        "GraphSettingsError",
        "FileNotFoundError",
        "NotADirectoryError",
    }
)


def is_user_error(error: BaseException) -> bool:
    return any(cls.__name__ in USER_ERROR_NAMES for cls in type(error).__mro__)


def start_error_line(model: str, error: BaseException) -> str:
    record: dict[str, Any] = {
        "model": model,
        "error": type(error).__name__,
        "message": str(error),
        "user_error": is_user_error(error),
    }
    if not record["user_error"]:
        record["traceback"] = "".join(traceback.format_exception(error)).rstrip()
    return f"{START_ERROR_MARKER} {json.dumps(record)}"


def reports_start_errors(initialize: Callable) -> Callable:
    """Decorates a TritonPythonModel's `initialize(self, args)`: a failure is logged as one structured error line,
    then raised on, so Triton still fails the model as before."""

    @functools.wraps(initialize)
    def wrapper(self, args, *rest, **kwargs):
        try:
            return initialize(self, args, *rest, **kwargs)
        except Exception as error:
            _log_error(start_error_line(str(args.get("model_name", "?")), error))
            raise

    return wrapper


def _log_error(line: str) -> None:
    try:
        import triton_python_backend_utils as pb_utils
    except ImportError:
        return  # outside Triton the exception itself is the report
    pb_utils.Logger.log_error(line)
