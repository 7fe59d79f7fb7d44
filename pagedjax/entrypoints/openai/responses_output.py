"""What /v1/responses answers, made from the chat completion it ran as (responses_protocol.py):
the response object (an assistant ``message`` of ``output_text`` and a ``function_call`` item
per tool call; status ``incomplete`` when max_output_tokens cut it), or, streamed, the Responses
API's events: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (or ``response.incomplete``), each with
its ``sequence_number``; an error after the stream began is an ``error`` event.
"""

from __future__ import annotations

import json
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict | None) -> dict:
    u = chat_usage or {}
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(text: str, status: str, logprobs=None, item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def call_item(call_id: str, name: str, arguments: str, status: str, item_id=None) -> dict:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def skeleton(rid: str, created: int, model: str, echoed: dict, status: str) -> dict:
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "incomplete_details": None,
        "output": [],
        "usage": None,
        **echoed,
    }


def finish(response: dict, finish_reason: str | None) -> dict:
    """Set a response's status from its chat choice's finish reason."""
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    elif finish_reason == "abort":
        response["status"] = "failed"
        response["error"] = {"code": "server_error", "message": "the engine ended the request"}
    else:
        response["status"] = "completed"
    return response


def response_object(rid: str, created: int, echoed: dict, chat: dict) -> dict:
    """The response of a finished chat completion (its JSON, one choice)."""
    response = skeleton(rid, created, chat["model"], echoed, "completed")
    (choice,) = chat["choices"]
    message, reason = choice["message"], choice["finish_reason"]
    status = "incomplete" if reason == "length" else "completed"
    if message.get("content") or not message.get("tool_calls"):  # a message, if only empty
        lp = _logprobs((choice.get("logprobs") or {}).get("content"))
        response["output"].append(message_item(message.get("content") or "", status, lp))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        response["output"].append(call_item(call["id"], fn["name"], fn["arguments"], status))
    response["usage"] = usage(chat.get("usage"))
    return finish(response, reason)


def _logprobs(entries) -> list:
    """Chat's logprobs content as output_text's (the same fields)."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "bytes": e.get("bytes"),
            "top_logprobs": e.get("top_logprobs") or [],
        }
        for e in entries or []
    ]


class ResponseEvents:
    """Turns a chat completion's stream (its events' JSON) into the Responses API's events."""

    def __init__(self, rid: str, created: int, model: str, echoed: dict):
        self.response = skeleton(rid, created, model, echoed, "in_progress")
        self.seq = 0
        self.text: dict | None = None  # the open message item
        self.calls: dict[int, dict] = {}  # tool call index -> its open function_call item
        self.opened = 0  # output items opened so far: the next one's output_index
        self.done: list[tuple[int, dict]] = []  # (output_index, item) of the closed items
        self.finish_reason: str | None = None
        self.error: dict | None = None  # an error event of the chat stream

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        snapshot = json.loads(json.dumps(self.response))
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def chunk(self, data: dict) -> list[str]:
        """The events of one chat chunk."""
        if "error" in data:
            err = self.error = data["error"]
            fields = {k: err.get(k) for k in ("code", "message", "param")}
            return [self.event("error", **fields)]
        if data.get("usage") is not None and not data.get("choices"):
            self.response["usage"] = usage(data["usage"])
            return []
        out = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                lp = _logprobs((choice.get("logprobs") or {}).get("content"))
                out += self._text_delta(delta["content"], lp)
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _next_index(self) -> int:
        self.opened += 1
        return self.opened - 1

    def _text_delta(self, text: str, logprobs: list) -> list[str]:
        out = []
        if self.text is None:
            self.text = message_item("", "in_progress")
            self.text["output_index"] = self._next_index()
            added = dict(self.text, content=[])
            added.pop("output_index")
            out.append(
                self.event(
                    "response.output_item.added", output_index=self.text["output_index"], item=added
                )
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._part_event("response.content_part.added", part))
        self.text["content"][0]["text"] += text
        self.text["content"][0]["logprobs"] += logprobs
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.text["id"],
                output_index=self.text["output_index"],
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return out

    def _part_event(self, kind: str, part: dict) -> str:
        return self.event(
            kind,
            item_id=self.text["id"],
            output_index=self.text["output_index"],
            content_index=0,
            part=part,
        )

    def _call_delta(self, call: dict) -> list[str]:
        out = []
        index = call.get("index", 0)
        fn = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            out += self._close_text()
            item = call_item(
                call.get("id") or new_id("call"), fn.get("name") or "", "", "in_progress"
            )
            item["output_index"] = self._next_index()
            self.calls[index] = item
            added = {k: v for k, v in item.items() if k != "output_index"}
            out.append(
                self.event(
                    "response.output_item.added", output_index=item["output_index"], item=added
                )
            )
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=item["output_index"],
                    delta=fn["arguments"],
                )
            )
        return out

    def _close_text(self) -> list[str]:
        if self.text is None:
            return []
        item, self.text = self.text, None
        status = "incomplete" if self.finish_reason == "length" else "completed"
        index = item.pop("output_index")
        item["status"] = status
        part = item["content"][0]
        out = [
            self.event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            ),
            self.event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.done.append((index, item))
        return out

    def closing(self) -> list[str]:
        """The items still open, then the response's final event."""
        out = self._close_text()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        for index in sorted(self.calls):
            item = self.calls.pop(index)
            at = item.pop("output_index")
            item["status"] = status
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=at,
                    arguments=item["arguments"],
                )
            )
            out.append(self.event("response.output_item.done", output_index=at, item=item))
            self.done.append((at, item))
        self.response["output"] = [item for _, item in sorted(self.done, key=lambda d: d[0])]
        if self.response["usage"] is None:
            self.response["usage"] = usage(None)
        finish(self.response, self.finish_reason)
        if self.error is not None:
            self.response["status"] = "failed"
            self.response["error"] = {k: self.error.get(k) for k in ("code", "message")}
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
            self.response["status"], "response.completed"
        )
        return out + [self.event(kind, response=self.response)]
