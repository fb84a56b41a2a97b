"""Guided decoding of one LLM-API request: `guided_decoding_guide_type` and `guided_decoding_guide` into the engine's
GuidedDecodingParams.

TensorRT-LLM's llmapi config.pbtxt declares no guided-decoding inputs (its LLM API takes
`SamplingParams.guided_decoding`); this model takes the inflight-batcher models' two names, so one client speaks to
both. The types are the executor's: `json` (any JSON object, no guide), `json_schema`, `regex`, `ebnf_grammar`,
`structural_tag`. Unlike the executor, an unknown type is refused rather than ignored. The engine needs
`guided_decoding_backend: xgrammar` in model.yaml."""

from __future__ import annotations

from typing import Any, Optional

from ..engine.types import GuidedDecodingParams, InvalidRequestError
from .llmapi_inputs import read_input
from .pb import InputError, decode_string

GUIDE_TYPE_INPUT = "guided_decoding_guide_type"
GUIDE_INPUT = "guided_decoding_guide"
GUIDED_INPUTS = (GUIDE_TYPE_INPUT, GUIDE_INPUT)


def guided_decoding(request: Any) -> Optional[GuidedDecodingParams]:
    """None when the request sets no guide type (an empty string counts as absent)."""
    guide_type, guide = _text(request, GUIDE_TYPE_INPUT), _text(request, GUIDE_INPUT)
    if not guide_type:
        if guide:
            raise InputError(GUIDE_INPUT, f"needs {GUIDE_TYPE_INPUT} (json, json_schema, regex, ebnf_grammar ...)")
        return None
    try:
        return GuidedDecodingParams.from_guide(guide_type, guide)
    except InvalidRequestError as exc:
        # from_guide speaks of the type when the type is wrong, else of the guide (missing or not JSON).
        name = GUIDE_TYPE_INPUT if str(exc).startswith(f"{GUIDE_TYPE_INPUT} must be") else GUIDE_INPUT
        raise InputError(f"input '{name}': {exc}") from None


def _text(request: Any, name: str) -> Optional[str]:
    array = read_input(request, name, "STRING")
    if array is None:
        return None
    if array.size != 1:
        raise InputError(name, f"must hold one string, got shape {list(array.shape)}")
    return decode_string(array.reshape(-1)[0], name)
