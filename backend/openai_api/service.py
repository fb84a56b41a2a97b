"""What the routes call: checks a request against this server (model name, context length), renders chat
prompts, and starts its `Generation`. Nothing here knows about HTTP."""

from __future__ import annotations

import json
import logging
from typing import Optional

import numpy as np

from .chat import ChatTemplate
from .config import FrontendConfig
from .errors import BadRequest, ModelNotFound
from .generation import Generation, PreparedPrompt, prepare_prompt
from .schemas import (
    ChatCompletionBody,
    CompletionBody,
    GenerationRequest,
    chat_max_tokens,
    chat_messages,
    check_chat_fields,
    check_completion_fields,
    completion_prompts,
    include_usage,
    sampling_of,
    stop_strings,
)
from .structured import Guide, response_format_guide
from .tools import Function, ToolPlan, parse_tool_choice, parse_tools, plan_tools
from .triton_client import TritonClient

log = logging.getLogger("tritonllm.openai")


def _load_tokenizer(config: FrontendConfig):
    """The model folder's Hugging Face tokenizer; any failure is a TokenizerFolderError naming --model-dir."""
    from ..tokenizer import TokenizerFolderError, load_tokenizer

    try:
        return load_tokenizer(str(config.model_dir)).hf
    except TokenizerFolderError as error:
        raise TokenizerFolderError(f"--model-dir {config.model_dir}: {error}") from None
    except Exception as error:  # transformers and tokenizers raise many types for a file they cannot read
        raise TokenizerFolderError(
            f"--model-dir {config.model_dir}: cannot load its tokenizer ({type(error).__name__}: {error})"
        ) from error


class OpenAIService:
    def __init__(self, config: FrontendConfig, tokenizer=None, client: Optional[TritonClient] = None):
        if tokenizer is None:
            tokenizer = _load_tokenizer(config)
        self.config = config
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer, config.model_dir)
        self.client = client or TritonClient(config.triton_url)
        self._context_length: Optional[int] = config.max_model_len

    # -- server state ----------------------------------------------------------------------------------------

    async def ready(self) -> bool:
        return await self.client.ready(self.config.backend_model)

    async def context_length(self) -> int:
        """Prompt plus completion tokens the engine takes: --max-model-len, else the tensorrt_llm model's
        max_seq_len parameter as Triton loaded it, else the model's max_position_embeddings."""
        if self._context_length is None:
            from_triton = await self.client.model_parameter("tensorrt_llm", "max_seq_len")
            if from_triton is not None and from_triton.isdigit():
                self._context_length = int(from_triton)
            else:
                config = json.loads((self.config.model_dir / "config.json").read_text())
                return int(config.get("max_position_embeddings", 2048))  # not cached: Triton may come up later
        return self._context_length

    def check_model(self, name: str) -> None:
        if name not in self.config.model_names:
            raise ModelNotFound(name)

    def adapter_inputs(self, name: str) -> dict[str, np.ndarray]:
        """The backend inputs that pick the LoRA adapter a model name stands for: `lora_name`, the name of an
        adapter the repository preloads (lora_prefetch_dir); none for the base model."""
        if name not in self.config.lora_names:
            return {}
        return {"lora_name": np.array([[name.encode("utf-8")]], dtype=object)}

    def check_max_tokens(self, max_tokens: Optional[int], field: str) -> None:
        """Refuses a request above --max-tokens-limit, rather than clamp it as vLLM's override does: a client
        then learns why its answer would stop short, as OpenAI's own API answers a too large max_tokens."""
        limit = self.config.max_tokens_limit
        if limit is not None and max_tokens is not None and max_tokens > limit:
            raise BadRequest(
                f"{field} is {max_tokens}, but this server allows at most {limit} completion tokens a request "
                "(--max-tokens-limit)",
                param=field,
            )

    # -- requests --------------------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionBody) -> Generation:
        self.check_model(body.model)
        check_chat_fields(body)
        max_tokens = chat_max_tokens(body)
        self.check_max_tokens(
            max_tokens, "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        )
        functions = parse_tools(body.tools)
        plan, guide = self._answer_plan(body, functions)
        template_tools = [function.as_template_tool() for function in functions] or None
        prompt = self.template.render(chat_messages(body), template_tools)
        request = GenerationRequest(
            model=body.model,
            prompts=(prompt,),
            n=body.n,
            sampling=sampling_of(body, max_tokens),
            stop=stop_strings(body),
            end_of_turn=self.template.end_of_turn,
            logprobs=body.logprobs,
            stream=body.stream,
            include_usage=include_usage(body),
            guide=guide,
            tool_plan=plan,
        )
        return Generation(
            self.client,
            self.config.backend_model,
            request,
            await self._prepare(request.prompts, max_tokens, "messages", body.min_tokens),
            self.adapter_inputs(body.model),
        )

    async def completion(self, body: CompletionBody) -> Generation:
        self.check_model(body.model)
        check_completion_fields(body)
        self.check_max_tokens(body.max_tokens, "max_tokens")
        request = GenerationRequest(
            model=body.model,
            prompts=completion_prompts(body),
            n=body.n,
            sampling=sampling_of(body, body.max_tokens),
            stop=stop_strings(body),
            end_of_turn=(),
            logprobs=body.logprobs is not None,
            stream=body.stream,
            include_usage=include_usage(body),
            guide=response_format_guide(body.response_format),
        )
        return Generation(
            self.client,
            self.config.backend_model,
            request,
            await self._prepare(request.prompts, body.max_tokens, "prompt", body.min_tokens),
            self.adapter_inputs(body.model),
        )

    def _answer_plan(
        self, body: ChatCompletionBody, functions: tuple[Function, ...]
    ) -> tuple[Optional[ToolPlan], Optional[Guide]]:
        """How the answer is guided and read: by its tool choice, or by its response_format (not both)."""
        choice = parse_tool_choice(body.tool_choice, functions)
        plan, tools_guide = plan_tools(functions, choice, body.parallel_tool_calls, self.template.call_format)
        format_guide = response_format_guide(body.response_format)
        if format_guide is not None and plan is not None:
            raise BadRequest(
                f"response_format {(body.response_format or {}).get('type')!r} cannot go with tool_choice {choice!r}: "
                "send tool_choice 'none' or drop response_format",
                param="response_format",
            )
        return plan, tools_guide or format_guide

    async def _prepare(
        self, prompts: tuple[str, ...], max_tokens: Optional[int], prompt_param: str, min_tokens: Optional[int]
    ) -> list[PreparedPrompt]:
        context = await self.context_length()
        default = max(self.config.max_tokens_default, min_tokens or 0)  # min_tokens above it raises the default
        # Counted as the preprocessing step tokenizes (add_special_tokens, the repository default).
        return [
            prepare_prompt(
                text,
                len(self.tokenizer.encode(text, add_special_tokens=True)),
                max_tokens,
                context,
                prompt_param,
                default,
            )
            for text in prompts
        ]
