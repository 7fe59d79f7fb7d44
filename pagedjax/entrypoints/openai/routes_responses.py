"""POST /v1/responses: OpenAI's Responses API (the OpenAI Agents SDK's default), run as the chat
completion it translates to (responses_protocol.py) and answered as a response object or the
Responses API's events (responses_output.py). A 400 names the Responses field (``input``,
``max_output_tokens``, ``text.format``) where the chat field it became was at fault."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from pagedjax.entrypoints.openai.app_state import check_key, read_json
from pagedjax.entrypoints.openai.protocol import (
    APIError,
    ChatRequest,
    parse_body,
    parse_request,
)
from pagedjax.entrypoints.openai.request_params import structured_outputs
from pagedjax.entrypoints.openai.responses_output import ResponseEvents, new_id, response_object
from pagedjax.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    chat_body,
    echoed_fields,
)

responses_router = APIRouter()

# a chat field named in an error -> the Responses field it came from
_FIELDS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "top_logprobs": "top_logprobs",
}


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    mapped = _FIELDS.get(head)
    if mapped is None:
        return param
    return mapped + ("." + rest if rest and head != "response_format" else "")


def _chat_request(req: ResponsesRequest):
    """The chat request, parsed, and its constraint (runs off the event loop)."""
    chat = parse_request(ChatRequest, chat_body(req))
    return (chat, *structured_outputs(chat))


@responses_router.post("/v1/responses")
async def create_response(request: Request):
    check_key(request)
    state = request.app.state
    data = await read_json(request)
    req = await state.offload.run(parse_body, ResponsesRequest, data)
    lora = state.models.resolve(req.model)
    try:
        chat, constraint, field = await state.offload.run_grammar(_chat_request, req)
        serving = state.serving_chat
        result = await serving.create_chat_completion(request, chat, constraint, field, lora)
    except APIError as e:
        e.param = _responses_param(e.param)
        raise
    rid, created = new_id("resp"), int(time.time())
    echoed = echoed_fields(req)
    if not isinstance(result, StreamingResponse):
        if result.status_code != 200:  # the client went away (499)
            return result
        body = json.loads(result.body)
        answer = response_object(rid, created, echoed, body)
        return Response(json.dumps(answer, ensure_ascii=False), media_type="application/json")
    model = lora.lora_name if lora is not None else state.model_names[0]
    events = ResponseEvents(rid, created, model, echoed)
    return StreamingResponse(_stream(events, result.body_iterator), media_type="text/event-stream")


async def _stream(events: ResponseEvents, chat_events):
    """The chat stream's events as the Responses API's; closing this closes the chat stream
    (whose own end aborts what is unfinished)."""
    try:
        for e in events.opening():
            yield e
        async for chunk in chat_events:
            for line in chunk.split("\n\n"):
                if line.startswith("data: {"):
                    for e in events.chunk(json.loads(line[len("data: ") :])):
                        yield e
        for e in events.closing():
            yield e
    finally:
        await chat_events.aclose()
