"""The OpenAI-compatible wire format: request bodies (validated strictly: no string-to-number
coercion) and the completion, chunk, usage and error objects.

Defaults follow OpenAI's: ``temperature`` 1.0, ``max_tokens`` 16 for completions and the rest
of the context for chat. ``top_k`` is an extension (0: no limit). Options this server does not
implement are refused when set to anything but their no-op value (``n`` other than 1,
``logprobs``, ``echo``, ``best_of``, ``suffix``, penalties, ``logit_bias``); unknown fields are
ignored, as OpenAI-style servers do. Extension: ``return_token_ids`` adds the generated ids
to each choice (``token_ids``; in a stream, the ids since the previous chunk), since text
cannot always carry them (a byte tokenizer's invalid UTF-8 decodes to U+FFFD).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ApiError", "CompletionBody", "ChatBody", "usage", "completion_object", "chunk_object"]


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status in (429, 503) else {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False

    # Options this server does not implement, with the values that mean "off".
    NO_OPS: ClassVar[tuple[tuple[str, tuple], ...]] = (("n", (1,)), ("presence_penalty", (0,)), ("frequency_penalty", (0,)), ("logit_bias", (None, {})))

    def check_supported(self) -> None:
        for name, allowed in self.NO_OPS:
            value = getattr(self, name)
            if value not in allowed:
                raise ApiError(400, f"{name}={value!r} is not supported by this server (only {allowed[0]!r})", param=name, code="unsupported_parameter")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())


class CompletionBody(_Body):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    NO_OPS = _Body.NO_OPS + (("echo", (False,)), ("logprobs", (None,)), ("best_of", (None, 1)), ("suffix", (None, "")))


class ChatMessage(_Strict):
    role: str
    content: str


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name for max_tokens
    logprobs: bool = False
    NO_OPS = _Body.NO_OPS + (("logprobs", (False,)),)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def _head(id: str, object: str, model: str, created: int | None) -> dict[str, Any]:
    return {"id": id, "object": object, "created": created or int(time.time()), "model": model}


def completion_object(id: str, model: str, text: str, finish_reason: str, usage: dict, *, chat: bool, created: int | None = None) -> dict[str, Any]:
    """The whole answer of a non-streamed request (``text_completion`` or ``chat.completion``)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice.update(text=text, logprobs=None)
    return {**_head(id, "chat.completion" if chat else "text_completion", model, created), "choices": [choice], "usage": usage}


def chunk_object(id: str, model: str, created: int, *, chat: bool, text: str | None = None, finish_reason: str | None = None,
                 role: bool = False, usage: dict | None = None) -> dict[str, Any]:
    """One server-sent chunk; with ``usage`` it is the final, choice-less usage chunk."""
    head = _head(id, "chat.completion.chunk" if chat else "text_completion", model, created)
    if usage is not None:
        return {**head, "choices": [], "usage": usage}
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice.update(text=text or "", logprobs=None)
    return {**head, "choices": [choice]}
