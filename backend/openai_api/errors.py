"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Status codes used (and nothing else):
  400 a field with a bad value, a prompt too long for the model (code `context_length_exceeded`), a template
      that cannot render the messages;
  404 a model name this server does not serve (code `model_not_found`);
  422 a valid OpenAI field asking for something this server cannot do yet (code `unsupported_parameter`), the
      backend's refusal of guided decoding included;
  500 the backend model failed on a request it accepted;
  503 Triton unreachable, or the backend model not ready (code `service_unavailable`)."""

from __future__ import annotations

from typing import Any, Optional


class OpenAIError(Exception):
    status = 400
    type = "invalid_request_error"
    code: Optional[str] = None

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(OpenAIError):
    pass


class PromptTooLong(OpenAIError):
    code = "context_length_exceeded"


class ModelNotFound(OpenAIError):
    status = 404
    code = "model_not_found"

    def __init__(self, model: str):
        super().__init__(
            f"The model '{model}' does not exist on this server; GET /v1/models lists those it serves.", param="model"
        )


class Unsupported(OpenAIError):
    status = 422
    code = "unsupported_parameter"


class BackendFailed(OpenAIError):
    status = 500
    type = "server_error"


class ServiceUnavailable(OpenAIError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"
