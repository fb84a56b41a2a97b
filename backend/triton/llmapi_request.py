"""Turns one request to the LLM-API `tensorrt_llm` model into a prompt and engine SamplingParams.

Tensor names are the contract's (section 1.3): `text_input`, `streaming`, `sampling_param_*` (TensorRT-LLM
`SamplingParams` fields), `return_*`. The model has max_batch_size 0, so each input arrives with its declared shape:
`text_input` [N] (element 0 is the prompt), the others [1]. Every bad value raises `InputError` naming the input."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ..engine.types import LoRARequest, SamplingParams
from .llmapi_guided import GUIDED_INPUTS, guided_decoding
from .llmapi_inputs import BatchedRequest, read_input
from .llmapi_lora import LORA_INPUTS, lora_request
from .pb import InputError, decode_string

# input -> (SamplingParams field, Triton type, Python kind)
SAMPLING_INPUTS = {
    "sampling_param_temperature": ("temperature", "FP32", float),
    "sampling_param_top_k": ("top_k", "INT32", int),
    "sampling_param_top_p": ("top_p", "FP32", float),
    "sampling_param_frequency_penalty": ("frequency_penalty", "FP32", float),
    "sampling_param_presence_penalty": ("presence_penalty", "FP32", float),
    "sampling_param_max_tokens": ("max_tokens", "INT32", int),
    "sampling_param_seed": ("seed", "UINT64", int),
}
# Words of the engine's messages -> the input they are about, so an engine refusal names the input too.
INPUT_OF_WORD = {
    **{fld: name for name, (fld, _, _) in SAMPLING_INPUTS.items()},
    "prompt": "text_input",
    "n": "sampling_param_best_of",
    "lora_task_id": "lora_id",
    "return_perf_metrics": "sampling_param_return_perf_metrics",
}
DEFAULT_MAX_TOKENS = 32  # TensorRT-LLM SamplingParams' default
# Inputs of TensorRT-LLM's llmapi config.pbtxt that this model declares but cannot serve: input -> why.
REFUSED_INPUTS = {
    "image_url": "multimodal prompts are not supported: this model serves text-only models",
    "sampling_param_logits_post_processor_name": (
        "named logits post-processors (model.yaml logits_post_processors, Python LogitsProcessor objects of "
        "TensorRT-LLM) are not supported by the embedded engine"
    ),
}


@dataclass(frozen=True)
class OutputOptions:
    """Which optional outputs the client asked for."""

    finish_reason: bool = False
    stop_reason: bool = False
    cumulative_logprob: bool = False
    perf_metrics: bool = False  # sampling_param_return_perf_metrics: the KV-cache and timing outputs
    batch_dim: bool = False  # triton_config.max_batch_size > 0: every output gets a leading batch dim of 1


@dataclass
class LLMAPIRequest:
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    streaming: bool = False
    exclude_input: bool = False  # sampling_param_exclude_input_from_output
    best_of: int = 1
    stop: list[str] = field(default_factory=list)
    outputs: OutputOptions = OutputOptions()
    lora: Optional[LoRARequest] = None


def convert_request(request: Any, tokenizer: Any, decoupled: bool, batched: bool = False) -> LLMAPIRequest:
    """The validated request; `tokenizer` is a LoadedTokenizer (prompt, stop strings, end and pad ids). `batched`:
    the model has max_batch_size > 0, so inputs and outputs carry Triton's batch dimension (of 1)."""
    if batched:
        request = BatchedRequest(request)
    check_refused(request)
    prompt = prompt_text(request)
    streaming = flag(request, "streaming")
    if streaming and not decoupled:
        raise InputError("streaming", "= true needs decoupled mode (streaming is only supported in decoupled mode)")
    best_of = scalar(request, "sampling_param_best_of", "INT32", int)
    best_of = 1 if best_of is None else best_of
    if best_of < 1:
        raise InputError("sampling_param_best_of", f"must be >= 1, got {best_of}")
    if best_of > 1 and streaming:
        raise InputError(
            "sampling_param_best_of", f"= {best_of} cannot stream: the best sequence is known only at the end"
        )
    stop = stop_strings(request)
    outputs = OutputOptions(
        flag(request, "return_finish_reason"),
        flag(request, "return_stop_reason"),
        flag(request, "return_cumulative_logprob"),
        flag(request, "sampling_param_return_perf_metrics"),
        batched,
    )
    params = sampling_params(request, tokenizer, best_of, stop, outputs)
    return LLMAPIRequest(
        prompt,
        tokenizer.encode(prompt, add_special_tokens=True),
        params,
        streaming,
        flag(request, "sampling_param_exclude_input_from_output"),
        best_of,
        stop,
        outputs,
        lora_request(request),
    )


def check_refused(request: Any) -> None:
    """Refuse, by name, a declared input this model cannot serve (an empty value counts as absent)."""
    for name, why in REFUSED_INPUTS.items():
        array = read_input(request, name)
        if array is not None and any(decode_string(value, name) for value in array.reshape(-1)):
            raise InputError(name, f"cannot be served: {why}")


def sampling_params(
    request: Any, tokenizer: Any, best_of: int, stop: list[str], outputs: OutputOptions
) -> SamplingParams:
    read = {fld: scalar(request, name, dtype, kind) for name, (fld, dtype, kind) in SAMPLING_INPUTS.items()}
    values: dict[str, Any] = {fld: value for fld, value in read.items() if value is not None}
    values.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    end_id = tokenizer.end_id if tokenizer.end_id >= 0 else None
    # Token-level stop words end each sequence in the engine at once; the text-level check (SequenceText) also
    # catches stop strings that tokenize differently in context.
    words = [ids for ids in (tokenizer.encode(word, add_special_tokens=False) for word in stop) if ids]
    params = SamplingParams(
        **values,
        n=best_of,
        end_id=end_id,
        pad_id=tokenizer.pad_id,
        stop_words=words or None,
        logprobs=outputs.cumulative_logprob or best_of > 1,  # best_of ranks by log-prob
        return_perf_metrics=outputs.perf_metrics,
        guided_decoding=guided_decoding(request),
    )
    try:
        params.validate()
    except ValueError as exc:
        raise InputError(name_inputs(str(exc))) from None
    return params


def name_inputs(message: str) -> str:
    """Prefix an engine/sampling message with the inputs it is about: "max_tokens must be > 0" becomes
    "input 'sampling_param_max_tokens': max_tokens must be > 0"."""
    names = []
    for word in re.findall(r"[a-z_]+", message):
        name = INPUT_OF_WORD.get(word)
        if name and name not in names:
            names.append(name)
    if "guided_decoding" in message:  # a guide that does not compile, or guided decoding off: the compiler's
        names = list(GUIDED_INPUTS)  # words in it are about the guide, not about sampling inputs
    if not names and "lora" in message.lower():  # the engine's LoRA refusals ("LoRA is not enabled", ...)
        names = list(LORA_INPUTS)
    if not names:
        return message
    label = "input" if len(names) == 1 else "inputs"
    return f"{label} {', '.join(repr(name) for name in names)}: {message}"


def prompt_text(request: Any) -> str:
    array = read_input(request, "text_input", "STRING")
    if array is None:
        raise InputError("text_input", "is required")
    if array.ndim != 1 or array.size < 1:
        raise InputError("text_input", f"must be a 1-D tensor holding the prompt, got shape {list(array.shape)}")
    return decode_string(array[0], "text_input")


def stop_strings(request: Any) -> list[str]:
    array = read_input(request, "sampling_param_stop", "STRING")
    if array is None:
        return []
    return [word for word in (decode_string(value, "sampling_param_stop") for value in array.reshape(-1)) if word]


def scalar(request: Any, name: str, dtype: str, kind: type) -> Optional[Any]:
    """The one value of a dims [1] input, or None when the request does not carry it."""
    array = read_input(request, name, dtype)
    if array is None:
        return None
    if array.size != 1:
        raise InputError(name, f"must hold one value, got shape {list(array.shape)}")
    return kind(array.reshape(-1)[0])


def flag(request: Any, name: str) -> bool:
    return bool(scalar(request, name, "BOOL", bool))
