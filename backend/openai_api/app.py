"""The HTTP side: FastAPI routes, server-sent events, OpenAI-shaped errors, metrics.

Streams: a request's first event is awaited before the response starts, so that every error that can happen
before any text (bad fields, unknown model, prompt too long, Triton unreachable) is an HTTP error, not a 200
stream carrying one. An error after that goes into the stream as an `{"error": ...}` event, then `[DONE]`.

Client disconnects: uvicorn (ASGI spec 2.3) lets Starlette cancel a streaming response when its client goes
away; a whole answer is watched here. Either way the generation's Triton call is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncGenerator, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import FrontendConfig
from .errors import BadRequest, ModelNotFound, OpenAIError, ServiceUnavailable
from .generation import ChoiceEvent, Generation
from .metrics import FrontendMetrics
from .responses import AnswerBuilder, ChoiceText
from .schemas import ChatCompletionBody, CompletionBody, parse_body
from .service import OpenAIService

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; only ever seen in the metrics


def create_app(config: FrontendConfig, service: Optional[OpenAIService] = None) -> FastAPI:
    service = service or OpenAIService(config)
    metrics = FrontendMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await service.client.close()

    app = FastAPI(title="tritonllm OpenAI-compatible API", lifespan=lifespan)
    app.state.service, app.state.metrics = service, metrics
    _error_handlers(app)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(config, name) for name in config.model_names]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model not in config.model_names:
            raise ModelNotFound(model)
        return _model_card(config, model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, service, metrics, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, service, metrics, chat=False)

    @app.get("/health")
    async def health():
        if not await service.ready():
            raise ServiceUnavailable(
                f"Triton at {config.triton_url} or its model '{config.backend_model}' is not ready"
            )
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


def _model_card(config: FrontendConfig, name: str) -> dict[str, Any]:
    card = {"id": name, "object": "model", "created": 0, "owned_by": "tritonllm", "root": name, "parent": None}
    if name in config.lora_names:
        card.update(root=config.served_model_name, parent=config.served_model_name)
    return card


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, error: StarletteHTTPException):
        kind = "not_found" if error.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(error.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=error.status_code)


# ---------------------------------------------------------------------------------------------- generation


class RequestRecord:
    """Metrics of one generation request: its status, latency, first token and token counts."""

    def __init__(self, metrics: FrontendMetrics, endpoint: str):
        self.metrics, self.endpoint = metrics, endpoint
        self.start = time.monotonic()
        self.model = "unknown"  # a known model name once the request names one (bounded label values)
        self.first_text_seen = False
        metrics.in_flight.labels(endpoint).inc()

    def text(self, event: ChoiceEvent) -> None:
        if event.text and not self.first_text_seen:
            self.first_text_seen = True
            self.metrics.first_token_latency.labels(self.endpoint).observe(time.monotonic() - self.start)

    def done(self, status: int, generation: Optional[Generation] = None) -> None:
        self.metrics.in_flight.labels(self.endpoint).dec()
        usage = generation.usage if generation is not None else None
        self.metrics.finished(
            self.endpoint,
            self.model,
            status,
            time.monotonic() - self.start,
            usage.prompt_tokens if usage else 0,
            generation.completion_tokens if generation is not None else 0,
        )


async def _generate(request: Request, service: OpenAIService, metrics: FrontendMetrics, chat: bool):
    record = RequestRecord(metrics, request.url.path)
    try:
        body = parse_body(ChatCompletionBody if chat else CompletionBody, await _json(request))
        if body.model in service.config.model_names:
            record.model = body.model
        generation = await (service.chat(body) if chat else service.completion(body))
        builder = AnswerBuilder(chat, body.model, generation.request.logprobs, generation.request.tool_plan)
        if body.stream:
            return await _stream(generation, builder, record)
        return await _whole(request, generation, builder, record)
    except OpenAIError as error:
        record.done(error.status)
        raise


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None


async def _whole(request: Request, generation: Generation, builder: AnswerBuilder, record: RequestRecord) -> Response:
    choices = [ChoiceText() for _ in range(len(generation.prompts) * generation.request.n)]

    async def collect():
        async with contextlib.aclosing(generation.events()) as events:
            async for event in events:
                record.text(event)
                choices[event.index].add(event)

    if not await _unless_client_leaves(request, collect()):
        record.done(CLIENT_CLOSED_REQUEST, generation)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    record.done(200, generation)
    return JSONResponse(builder.whole(choices, generation.usage))


async def _unless_client_leaves(request: Request, work) -> bool:
    """Run `work`; if the client disconnects first, cancel it (which cancels its Triton call): False."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # raises the generation's error, if any
    return True


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(generation: Generation, builder: AnswerBuilder, record: RequestRecord) -> StreamingResponse:
    events = generation.events()
    try:
        first = await anext(events, None)
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(
        _sse(events, first, generation, builder, record),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse(
    events: AsyncGenerator[ChoiceEvent, None],
    first: Optional[ChoiceEvent],
    generation: Generation,
    builder: AnswerBuilder,
    record: RequestRecord,
) -> AsyncIterator[bytes]:
    status = CLIENT_CLOSED_REQUEST  # unless the stream gets to its end
    sent: dict[int, int] = {}  # characters sent per choice, for text completions' text_offset
    try:
        event: Optional[ChoiceEvent] = first
        while event is not None:
            record.text(event)
            for chunk in builder.chunks(event, sent.get(event.index, 0)):
                yield _sse_line(chunk)
            sent[event.index] = sent.get(event.index, 0) + len(event.text)
            event = await anext(events, None)
        if generation.request.include_usage:
            yield _sse_line(builder.usage_chunk(generation.usage))
        status = 200
    except OpenAIError as error:
        status = error.status
        yield _sse_line(error.body())
    finally:
        await events.aclose()  # cancels the Triton call if the client left mid-stream
        record.done(status, generation)
    yield b"data: [DONE]\n\n"


def _sse_line(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
