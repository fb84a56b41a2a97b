"""The `tensorrt_llm_bls` model's parameters (config.pbtxt), read once at load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..triton.params import Parameters
from .grpc_endpoint import server_grpc_url

DEFAULT_CANCELLATION_CHECK_MS = 100


@dataclass
class BlsConfig:
    decoupled: bool
    accumulate_tokens: bool
    llm_model_name: str
    draft_model_name: Optional[str]  # tensorrt_llm_draft_model_name: the draft/target loop's draft model
    grpc_url: Optional[str]  # set: the triton_grpc_url parameter; None: found from tritonserver's command line
    cancellation_check_period_ms: int

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any]) -> "BlsConfig":
        params = Parameters.from_model_config(model_config)
        policy = model_config.get("model_transaction_policy") or {}
        return cls(
            decoupled=bool(policy.get("decoupled", False)),
            accumulate_tokens=params.bool("accumulate_tokens", False),
            llm_model_name=params.str("tensorrt_llm_model_name", "tensorrt_llm"),
            draft_model_name=params.str("tensorrt_llm_draft_model_name"),
            grpc_url=params.str("triton_grpc_url"),
            cancellation_check_period_ms=params.int(
                "cancellation_check_period_ms", DEFAULT_CANCELLATION_CHECK_MS, minimum=1
            ),
        )

    def resolved_grpc_url(self) -> str:
        return self.grpc_url or server_grpc_url()
