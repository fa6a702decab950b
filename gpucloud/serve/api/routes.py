"""The endpoints. Thin: validate, submit to the engine bridge, format what comes back."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from gpucloud.serve.api.bridge import EngineDead, Submission
from gpucloud.serve.api.errors import APIError
from gpucloud.serve.api.protocol import (
    Formatter,
    chat_prompt,
    completion_params,
    completion_prompts,
    sampling_params,
    sse,
)
from gpucloud.serve.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    SamplingFields,
    UnloadLoraAdapterRequest,
)
from gpucloud.serve.api.state import STALL_AFTER, ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the process runs and the engine loop keeps turning."""
    bridge = _state(request).bridge
    if bridge.healthy(STALL_AFTER):
        return JSONResponse({"status": "ok"})
    status = "engine failed" if bridge.error is not None else "engine stalled"
    return JSONResponse({"status": status}, status_code=503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 when the model is loaded, the engine healthy and the server not draining; with
    when the process started, its weights were loaded and it became ready (Unix time)."""
    state = _state(request)
    if state.ready:
        return JSONResponse({"status": "ready", "startup": state.startup.phases()})
    status = "draining" if state.draining else "not ready"
    return JSONResponse({"status": status}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    """The served model, then its LoRA adapters (their `parent` is the served model)."""
    state = _state(request)
    base = state.settings.model_name

    def card(name: str, parent: str | None, root: str | None) -> dict:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "gpucloud",
                "root": root, "parent": parent,
                "max_model_len": state.engine.max_model_len}  # fmt: skip

    cards = [card(base, None, None)]
    cards += [card(a.name, base, a.path) for a in state.engine.list_loras()]
    return JSONResponse({"object": "list", "data": cards})


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """vLLM's: load a PEFT adapter that requests then name as `model` (400 if it cannot)."""
    engine = _runtime_lora(request)
    await asyncio.to_thread(engine.add_lora, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    """vLLM's: forget an adapter (404 if unknown); requests in flight finish with it."""
    _runtime_lora(request).remove_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _runtime_lora(request: Request):
    state = _state(request)
    if not state.settings.runtime_lora_updating:
        raise APIError(404, "loading and unloading LoRA adapters at run time is off: start the "
                       "server with --runtime-lora-updating", "not_enabled")  # fmt: skip
    return state.engine


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    lora = state.check_model(body.model)
    prompts = completion_prompts(body)
    params = completion_params(body)
    prefixes = None
    tok = state.engine.tokenizer
    if body.echo:
        prefixes = [p if isinstance(p, str) else tok.decode(p) for p in prompts]
    echo_logprobs = body.logprobs if body.echo else None
    fmt = Formatter(f"cmpl-{uuid.uuid4().hex}", body.model, False, body.n, tok, echo_logprobs,
                    body.prompt_logprobs)  # fmt: skip
    return await _run(request, state, prompts, params, fmt, body, prefixes, lora)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    lora = state.check_model(body.model)
    prompt = chat_prompt(body, state.engine.tokenizer)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens, logprobs)
    fmt = Formatter(f"chatcmpl-{uuid.uuid4().hex}", body.model, True, body.n,
                    state.engine.tokenizer)  # fmt: skip
    return await _run(request, state, [prompt], params, fmt, body, None, lora)


async def _run(
    request, state, prompts, params, fmt, body: SamplingFields, prefixes, lora: str | None
) -> Response:
    state.admit()
    try:
        sub = state.bridge.submit(prompts, params, lora, body.priority)
    except EngineDead as e:
        raise APIError(503, f"{e}; this replica is unhealthy", "engine_dead") from None
    if body.stream:
        return StreamingResponse(
            _stream(sub, fmt, body.include_usage, prefixes),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    finals = await _until_done(request, sub)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(fmt.response(finals, prefixes))


async def _until_done(request: Request, sub: Submission):
    """The final outputs, or None when the client disconnects first (then the request is
    aborted at once, freeing its KV blocks)."""
    work = asyncio.ensure_future(sub.final())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            sub.close()
    if work.cancelled():
        return None
    try:
        return work.result()
    except EngineDead as e:
        raise APIError(503, f"{e}; this replica is unhealthy", "engine_dead") from None


async def _disconnected(request: Request) -> None:
    # The body is read already, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(sub: Submission, fmt: Formatter, include_usage: bool, prefixes):
    """Server-sent events: one chunk per choice per engine step, then usage, then [DONE].
    The events of the outputs queued since the last write go out in one write (at most one
    per engine step while the client keeps up). A client that goes away cancels this
    generator; `sub.close()` aborts its requests."""
    started: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    try:
        async for batch in sub.batches():
            events = []
            for p, out in batch:
                for c in out.outputs:
                    key = (p, c.index)
                    if key in done:
                        continue
                    first = key not in started
                    event = fmt.event(p, out, c, first, prefixes[p] if prefixes else "")
                    if event is None:
                        continue
                    started.add(key)
                    if c.finished:
                        done.add(key)
                    events.append(event)
            if len(sub.finals) == len(sub.request_ids):  # the last write ends the stream
                if include_usage:
                    events.append(sse(fmt.usage_chunk([sub.finals[r] for r in sub.request_ids])))
                events.append(sse("[DONE]"))
            if events:
                yield "".join(events)
    except EngineDead as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None,
                             "code": "engine_dead"}})  # fmt: skip
    finally:
        sub.close()
