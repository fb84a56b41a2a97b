"""A small fake of `triton_python_backend_utils`: the subset the tritonllm models use, with the stub's names.

Tests install it as `sys.modules["triton_python_backend_utils"]` (see `install`). It is strict where the real
stub is strict (e.g. a Logger without `log_warning`, string tensors as object arrays of bytes), so code that
passes here does not trip on the first real server run.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Mapping, Optional

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL):
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


def _as_triton_array(value: Any) -> np.ndarray:
    """Numpy the way the stub hands it out: strings become object arrays of bytes."""
    array = np.asarray(value)
    if array.dtype.kind in "SU" or (array.dtype.kind == "O" and array.size and isinstance(array.flat[0], str)):
        encode = np.vectorize(lambda s: s.encode("utf-8") if isinstance(s, str) else bytes(s), otypes=[object])
        array = encode(array) if array.size else array.astype(object)
    return array


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        if not isinstance(array, np.ndarray):
            raise TritonModelException(f"Tensor '{name}' needs a numpy array, got {type(array).__name__}")
        if array.dtype.kind == "U":
            raise TritonModelException(f"Tensor '{name}': unicode arrays are not supported, use bytes objects")
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True


class InferenceResponse:
    def __init__(self, output_tensors: Optional[list] = None, error: Optional[TritonError] = None):
        self._tensors = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Optional[TritonError]:
        return self._error


class ResponseSender:
    """Records what a decoupled model sends: a list of (response, flags). Cancelled when its request is."""

    def __init__(self, request: Optional["InferenceRequest"] = None):
        self.sent: list[tuple[Optional[InferenceResponse], int]] = []
        self._request = request

    def is_cancelled(self) -> bool:
        return self._request is not None and self._request.is_cancelled()

    def send(self, response: Optional[InferenceResponse] = None, flags: int = 0) -> None:
        if self.sent and self.sent[-1][1] & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise TritonModelException("response sent after the FINAL flag")
        self.sent.append((response, flags))

    @property
    def finished(self) -> bool:
        return bool(self.sent) and bool(self.sent[-1][1] & TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class InferenceRequest:
    """A received request built from {input name: array-like}; strings become object arrays of bytes."""

    def __init__(
        self,
        inputs: Mapping[str, Any],
        request_id: str = "",
        cancelled: bool = False,
        requested_outputs: Optional[list[str]] = None,
    ):
        self._inputs = {name: Tensor(name, _as_triton_array(value)) for name, value in inputs.items()}
        self._request_id = request_id
        self._cancelled = cancelled
        self._requested_outputs = list(requested_outputs or [])
        self._sender = ResponseSender(self)

    def requested_output_names(self) -> list[str]:
        return self._requested_outputs

    def get_input_tensor_by_name(self, name: str) -> Optional[Tensor]:
        return self._inputs.get(name)

    def inputs(self) -> list[Tensor]:
        return list(self._inputs.values())

    def request_id(self) -> str:
        return self._request_id

    def is_cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True

    def get_response_sender(self) -> ResponseSender:
        return self._sender


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Optional[Tensor]:
    return request.get_input_tensor_by_name(name)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Optional[Tensor]:
    for tensor in response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


class Logger:
    """Records messages per level; like the stub, it has `log_warn` and no `log_warning`."""

    records: list[tuple[str, str]] = []

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.records.append(("info", message))

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.records.append(("warn", message))

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.records.append(("error", message))

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.records.append(("verbose", message))


class MetricFamily:
    """Records every metric created, like the stub's registry; `kind` must be one of the stub's constants, and,
    as in the stub, a histogram's metrics need buckets and other metrics must not have them."""

    COUNTER, GAUGE, HISTOGRAM = range(3)
    families: dict[str, "MetricFamily"] = {}

    def __init__(self, name: str, description: str, kind: int):
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise TritonModelException(f"MetricFamily {name}: unknown kind {kind!r}")
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list["Metric"] = []
        MetricFamily.families[name] = self

    def Metric(self, labels: Mapping[str, str], buckets: Optional[list] = None) -> "Metric":  # noqa: N802
        if (self.kind == self.HISTOGRAM) != (buckets is not None):
            raise TritonModelException(f"MetricFamily {self.name}: buckets are required for histograms only")
        if buckets is not None and (not isinstance(buckets, list) or list(buckets) != sorted(buckets)):
            raise TritonModelException(f"MetricFamily {self.name}: buckets must be a sorted list")
        metric = Metric(self.kind, dict(labels), buckets)
        self.metrics.append(metric)
        return metric


class Metric:
    def __init__(self, kind: int, labels: dict[str, str], buckets: Optional[list] = None):
        self.kind = kind
        self.labels = labels
        self.buckets = buckets
        self._value = 0.0
        self.observations: list[float] = []

    def set(self, value: float) -> None:
        if self.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("set() is not supported for a histogram")
        self._value = float(value)

    def observe(self, value: float) -> None:
        if self.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException("observe() is only supported for a histogram")
        self.observations.append(float(value))

    def value(self) -> float:
        if self.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("value() is not supported for a histogram")
        return self._value


class ModelConfig:
    """What `auto_complete_config` receives: the model config dict, with the stub's setters and their checks."""

    def __init__(self, config: Mapping[str, Any]):
        self._config = {"max_batch_size": 0, **dict(config)}

    def as_dict(self) -> dict:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if self._config["max_batch_size"] > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {self._config['max_batch_size']}, but "
                f"auto-complete specified {max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_model_transaction_policy(self, policy: Mapping[str, Any]) -> None:
        if set(policy) - {"decoupled"}:
            raise ValueError("model transaction policy contains property other than 'decoupled'")
        current = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in current and current["decoupled"] != policy["decoupled"]:
            raise ValueError(f"trying to change decoupled property, which is already set to '{current['decoupled']}'")
        current.update(policy)


model_dir = ""  # what get_model_dir() answers: tests set it to the model's version folder


def get_model_dir() -> str:
    return model_dir


def install() -> types.ModuleType:
    """Put this module in sys.modules as `triton_python_backend_utils`; returns it. Undo with `uninstall`."""
    module = sys.modules[__name__]
    Logger.records = []
    MetricFamily.families = {}
    sys.modules["triton_python_backend_utils"] = module
    return module


def uninstall() -> None:
    sys.modules.pop("triton_python_backend_utils", None)
