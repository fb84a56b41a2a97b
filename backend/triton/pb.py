"""Typed plumbing over `triton_python_backend_utils` (pb_utils).

pb_utils exists only inside Triton's Python stub, so it is looked up when needed (`pb_utils()`), never at import:
tests put a fake under the same name in `sys.modules`. Every problem with a request's inputs is an `InputError`
that names the input and the rule; the models turn it into an error response for that request only.

Triton prepends the batch dimension to every declared shape (the models have max_batch_size > 0): a `dims: [1]`
input arrives as [B, 1], a `reshape: { shape: [] }` input as [B].
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Optional

import numpy as np

# Triton data type name -> the numpy dtype `as_numpy()` returns for it. STRING (BYTES) arrives as object arrays.
TRITON_TO_NUMPY = {
    "BOOL": np.dtype(np.bool_),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "STRING": np.dtype(np.object_),
}
_NUMPY_TO_TRITON = {dtype: name for name, dtype in TRITON_TO_NUMPY.items()}

SCALAR_KINDS = ("int", "float", "bool", "str")


class InputError(ValueError):
    """A request input that is missing, mistyped or malformed; the message names the input and the rule.

    `InputError(name, rule)` words it as "input 'name' rule"; `InputError(message)` takes a message that
    already names the input."""

    def __init__(self, name_or_message: str, rule: Optional[str] = None):
        super().__init__(name_or_message if rule is None else f"input '{name_or_message}' {rule}")
        self.input_name = None if rule is None else name_or_message


def pb_utils() -> ModuleType:
    """The `triton_python_backend_utils` module (the real stub's, or a test fake placed in sys.modules)."""
    return importlib.import_module("triton_python_backend_utils")


def triton_dtype_name(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.kind in "SU":
        return "STRING"
    return _NUMPY_TO_TRITON.get(dtype, str(dtype))


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


def optional_input(request: Any, name: str, dtype: Optional[str] = None) -> Optional[np.ndarray]:
    """The input as a numpy array, or None when the request does not carry it. `dtype` is a Triton type name."""
    tensor = pb_utils().get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if dtype is not None:
        check_dtype(array, name, dtype)
    return array


def required_input(request: Any, name: str, dtype: Optional[str] = None) -> np.ndarray:
    array = optional_input(request, name, dtype)
    if array is None:
        raise InputError(name, "is required")
    return array


def check_dtype(array: np.ndarray, name: str, dtype: str) -> None:
    expected = TRITON_TO_NUMPY[dtype]
    actual = array.dtype
    matches = actual.kind in "OSU" if dtype == "STRING" else actual == expected
    if not matches:
        raise InputError(name, f"must be {dtype}, got {triton_dtype_name(actual)}")


def check_batch_size(array: np.ndarray, name: str, batch_size: int) -> None:
    """Every input of one request shares its leading (batch) dimension."""
    rows = array.shape[0] if array.ndim else 0
    if rows != batch_size:
        raise InputError(
            name, f"must have batch size {batch_size} like the other inputs, got shape {list(array.shape)}"
        )


def row_scalar(array: np.ndarray, row: int, name: str, kind: str) -> Any:
    """The single value of batch row `row` of a [B] or [B, 1] input, as a Python int/float/bool/str."""
    if kind not in SCALAR_KINDS:
        raise ValueError(f"kind must be one of {SCALAR_KINDS}, got {kind!r}")
    values = np.asarray(array[row]).reshape(-1)
    if values.size != 1:
        raise InputError(name, f"must hold one value per batch row, got shape {list(array.shape)}")
    value = values[0]
    if kind == "str":
        return decode_string(value, name)
    if kind == "bool":
        return bool(value)
    return int(value) if kind == "int" else float(value)


def decode_string(value: Any, name: str) -> str:
    """One element of a STRING input as `str`; Triton delivers bytes, which must be UTF-8."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InputError(name, f"must be UTF-8 text ({error.reason} at byte {error.start})") from None
    raise InputError(name, f"must be a STRING, got an element of type {type(value).__name__}")


def string_rows(array: np.ndarray, name: str) -> list[list[str]]:
    """A [B, N] (or [B]) STRING input as B lists of strings."""
    rows = array.reshape(array.shape[0], -1) if array.ndim else array.reshape(1, -1)
    return [[decode_string(value, name) for value in row] for row in rows]


def reject_input(request: Any, name: str, why: str) -> None:
    """Refuse a request that carries an input this implementation does not support."""
    if pb_utils().get_input_tensor_by_name(request, name) is not None:
        raise InputError(name, f"is not supported: {why}")


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------


def output_tensor(name: str, array: np.ndarray) -> Any:
    return pb_utils().Tensor(name, np.ascontiguousarray(array))


def string_tensor(name: str, texts: list[str]) -> Any:
    """A STRING output: Triton wants an object array of UTF-8 bytes."""
    return output_tensor(name, np.array([text.encode("utf-8") for text in texts], dtype=np.object_))


def error_response(message: Any, cancelled: bool = False) -> Any:
    """An InferenceResponse that carries only an error: CANCELLED when `cancelled`, INVALID_ARG for a ValueError
    (InputError among them), Triton's default code otherwise."""
    pb = pb_utils()
    code_name = "CANCELLED" if cancelled else "INVALID_ARG" if isinstance(message, ValueError) else None
    code = getattr(pb.TritonError, code_name, None) if code_name else None  # codes exist since Triton 23.xx
    text = str(message)
    error = pb.TritonError(text) if code is None else pb.TritonError(text, code)
    return pb.InferenceResponse(output_tensors=[], error=error)


def send_response(sender: Any, response: Any) -> None:
    """Send one non-final response of a decoupled request."""
    sender.send(response)


def send_final(sender: Any, response: Any = None) -> None:
    """Send the last response of a request with the FINAL flag; `None` sends the flag alone."""
    flag = pb_utils().TRITONSERVER_RESPONSE_COMPLETE_FINAL
    if response is None:
        sender.send(flags=flag)
    else:
        sender.send(response, flags=flag)


def respond(model_name: str, build_outputs: Callable[[], list]) -> Any:
    """An InferenceResponse with the tensors `build_outputs()` returns, or an error response when it raises.

    Bad inputs (ValueError, InputError among them) become INVALID_ARG errors; anything else is a bug, logged and
    still answered, so that one request never takes the other requests of the same execute() batch down."""
    try:
        tensors = build_outputs()
    except ValueError as error:
        return error_response(error)
    except Exception as error:
        log("error", f"{model_name}: {type(error).__name__}: {error}")
        return error_response(f"{model_name} failed: {type(error).__name__}: {error}")
    return pb_utils().InferenceResponse(output_tensors=tensors)


def log(level: str, message: str) -> None:
    """Log through the Triton logger: level is info, warn, error or verbose (the stub has `log_warn`, no
    `log_warning`)."""
    getattr(pb_utils().Logger, f"log_{level}")(message)
