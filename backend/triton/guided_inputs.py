"""The `tensorrt_llm` inputs `guided_decoding_guide_type` / `guided_decoding_guide` as a row's GuidedDecodingParams.

TensorRT-LLM's backend turns an unknown guide type into None and runs the request unguided; here every bad pair is
an InputError naming the input, before the request reaches the engine. An empty string (what HTTP clients send for
"none") is an absent input."""

from __future__ import annotations

from typing import Optional

from ..engine.types import GUIDE_TYPES, GuidedDecodingParams, InvalidRequestError
from .pb import InputError

GUIDE_TYPE_INPUT = "guided_decoding_guide_type"
GUIDE_INPUT = "guided_decoding_guide"
# Ours: the last N prompt tokens are output of this guide already (SamplingParams.guided_prefix_len).
GUIDE_PREFIX_INPUT = "guided_decoding_prefix_len"


def parse_guide(guide_type: str, guide: str) -> Optional[GuidedDecodingParams]:
    """A row's two input values (as text; "" when absent) as its guide, or None when the row is not guided."""
    guide_type = guide_type.strip()
    if not guide_type:
        if guide:
            raise InputError(GUIDE_INPUT, f"needs input '{GUIDE_TYPE_INPUT}' (one of {', '.join(GUIDE_TYPES)})")
        return None
    if guide_type not in GUIDE_TYPES:
        raise InputError(GUIDE_TYPE_INPUT, f"must be one of {', '.join(GUIDE_TYPES)}, got {guide_type!r}")
    if guide_type != "json" and not guide:
        raise InputError(
            GUIDE_INPUT, f"is required with {GUIDE_TYPE_INPUT} = {guide_type!r} (the schema, regex or grammar)"
        )
    try:
        return GuidedDecodingParams.from_guide(guide_type, guide or None)
    except InvalidRequestError as exc:  # e.g. a json_schema guide that is not JSON
        raise InputError(GUIDE_INPUT, f"({guide_type}) is invalid: {exc}") from None


def name_guide_error(exc: Exception, guide: GuidedDecodingParams) -> InputError:
    """An engine refusal of a guided row (a guide that does not compile, an engine without a grammar backend) as an
    error naming the input that carried the guide."""
    guide_type, _ = guide.guide()
    return InputError(GUIDE_INPUT, f"({GUIDE_TYPE_INPUT} = {guide_type!r}) is refused: {exc}")


def is_guide_error(exc: Exception) -> bool:
    """Whether an engine's InvalidRequestError is about the request's guide (its messages name guided_decoding)."""
    return isinstance(exc, InvalidRequestError) and "guided_decoding" in str(exc)
