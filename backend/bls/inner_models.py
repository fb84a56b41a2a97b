"""BLS calls to the non-decoupled helper models (preprocessing, postprocessing) and their errors."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import numpy as np

from ..triton.pb import output_tensor, pb_utils


class InnerModelError(RuntimeError):
    """A model the BLS called answered with an error; `is_input_error` when it blamed the request's inputs."""

    def __init__(self, model: str, message: str, is_input_error: bool):
        super().__init__(f"{model}: {message}")
        self.is_input_error = is_input_error


def exec_model(
    model: str, inputs: Mapping[str, np.ndarray], outputs: Iterable[str] = (), request_id: str = ""
) -> dict[str, np.ndarray]:
    """One BLS `exec` of a non-decoupled model: its outputs by name (copies: a view into the response's shared
    memory must not outlive the response)."""
    pb = pb_utils()
    request = pb.InferenceRequest(
        model_name=model,
        inputs=[output_tensor(n, a) for n, a in inputs.items()],
        requested_output_names=list(outputs),
        request_id=request_id,
    )
    response = request.exec()
    if response.has_error():
        raise inner_error(model, response.error())
    return {tensor.name(): np.array(tensor.as_numpy(), copy=True) for tensor in response.output_tensors()}


def inner_error(model: str, error) -> InnerModelError:
    code: Optional[int] = error.code() if hasattr(error, "code") else None
    invalid = getattr(pb_utils().TritonError, "INVALID_ARG", None)
    return InnerModelError(model, error.message(), code is not None and code == invalid)


PREPROCESSING_OUTPUTS = (
    "INPUT_ID",
    "REQUEST_INPUT_LEN",
    "REQUEST_OUTPUT_LEN",
    "OUT_END_ID",
    "OUT_PAD_ID",
    "STOP_WORDS_IDS",
    "BAD_WORDS_IDS",
    "EMBEDDING_BIAS",
)


def preprocess(inputs: Mapping[str, np.ndarray], request_id: str = "") -> dict[str, np.ndarray]:
    return exec_model("preprocessing", inputs, PREPROCESSING_OUTPUTS, request_id)


def postprocess(llm_outputs: Mapping[str, np.ndarray], request_id: str = "") -> list[str]:
    """The text of each row of a tensorrt_llm response. With tensorrt_llm's detok_prefix_ids / detok_is_final a
    streamed chunk decodes in its context, exactly as the ensemble's postprocessing step decodes it."""
    inputs = {"TOKENS_BATCH": llm_outputs["output_ids"], "SEQUENCE_LENGTH": llm_outputs["sequence_length"]}
    if "detok_prefix_ids" in llm_outputs:
        inputs["PREFIX_IDS"] = llm_outputs["detok_prefix_ids"]
    if "detok_is_final" in llm_outputs:
        inputs["IS_FINAL"] = llm_outputs["detok_is_final"]
    texts = exec_model("postprocessing", inputs, ("OUTPUT",), request_id)["OUTPUT"]
    return [text.decode("utf-8") if isinstance(text, bytes) else str(text) for text in texts.reshape(-1)]
