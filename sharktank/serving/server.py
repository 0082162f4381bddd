"""The HTTP layer of ``sharktank serve``: OpenAI-compatible endpoints over an :class:`Engine`.

The engine batches requests on its own thread and calls each request's ``on_event`` there;
every request gets an :class:`asyncio.Queue` that those events are put on with
``loop.call_soon_threadsafe``, so the event loop never blocks on the engine. Text comes out
of a :class:`~sharktank.text.stream.DetokenizeStream`: when it meets a stop string the engine
request is cancelled (its row is freed) and the answer ends with finish reason ``"stop"``.
A client that goes away (mid-stream or while waiting for a whole answer) cancels its request.

Errors are OpenAI error objects: 400 ``invalid_request_error`` for bad input (FastAPI's 422
validation errors included), 404 for an unknown model, 429 when the engine's queue is full,
503 while the model loads, 500 when the engine reports an error. Once the engine has ended
for good (its model was lost: a host of a multi-host artifact failed), the requests it held
get 500 with that error, new ones and ``/health`` 503 with it (:attr:`ServerState.failure`:
``sharktank serve`` then stops the server).

``GET /metrics`` answers Prometheus text (:mod:`~sharktank.serving.metrics`, a registry per
app). With ``api_key``, every ``/v1`` route wants ``Authorization: Bearer KEY`` (401
otherwise, :mod:`~sharktank.serving.auth`); ``/health`` and ``/metrics`` stay open.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ..runtime.compiled import InputError
from ..text.sampling import SamplingParams
from ..text.stream import DetokenizeStream
from .auth import BearerAuth
from .events import FinishReason, QueueFull
from .metrics import CONTENT_TYPE, ServingMetrics
from .protocol import ApiError, ChatBody, CompletionBody, chunk_object, completion_object, new_id, usage

__all__ = ["create_app", "ServerState"]

# How often a request waiting for its next token checks that its client is still there.
_DISCONNECT_POLL_S = 0.25


class ServerState:
    """The engine and tokenizer an app serves, and whether they are ready.

    Given an engine, the app starts it at startup; given ``load`` (a callable returning
    ``(engine, tokenizer)``), the app starts, answers ``/health`` with 503 while ``load`` runs
    on a background thread, then starts the engine. The app stops the engine at shutdown."""

    def __init__(self, model_name: str, engine=None, tokenizer=None, load: Callable[[], tuple[Any, Any]] | None = None):
        if (engine is None) == (load is None):
            raise ValueError("give either an engine (and tokenizer) or a load callable")
        self.model_name = model_name
        self.engine, self.tokenizer, self._load = engine, tokenizer, load
        self.error: str | None = None
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self.running = 0  # requests between submit and their last event (read by /health)
        self.metrics = ServingMetrics(self._engine_stats)

    def _engine_stats(self):
        return self.engine.stats() if self.ready.is_set() else None

    def start(self) -> None:
        if self._load is None:
            self._start_engine()
        else:
            threading.Thread(target=self._load_and_start, name="sharktank-load", daemon=True).start()

    def _load_and_start(self) -> None:
        try:
            engine, tokenizer = self._load()
        except Exception as e:  # reported by /health; the server stays up to say so
            self.error = f"{type(e).__name__}: {e}"
            return
        self.engine, self.tokenizer = engine, tokenizer
        self._start_engine()

    def _start_engine(self) -> None:
        with self._lock:
            if self._closing:
                return
            self.engine.start()
            self.ready.set()

    def stop(self) -> None:
        with self._lock:
            self._closing = True
            if self.ready.is_set():
                self.engine.stop()

    @property
    def failure(self) -> str | None:
        """Why the engine ended for good (its model was lost), or None."""
        return self.engine.failure if self.ready.is_set() else None

    def status(self) -> tuple[int, dict[str, Any]]:
        if self.failure:
            return 503, {"status": "failed", "error": self.failure}
        if self.ready.is_set():
            return 200, {"status": "ok", "model": self.model_name, "running": self.running}
        if self.error:
            return 503, {"status": "failed", "error": self.error}
        return 503, {"status": "loading"}

    def require_ready(self, model: str) -> None:
        if not self.ready.is_set():
            message = f"the model failed to load: {self.error}" if self.error else "the model is still loading; retry when /health answers 200"
            raise ApiError(503, message, type="server_error", code="model_not_ready")
        if self.failure:
            raise ApiError(503, f"the server cannot serve: {self.failure}", type="server_error", code="model_lost")
        if model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", param="model", code="model_not_found")


class _Generation:
    """One engine request as the event loop sees it: its events on an asyncio queue, its text
    through a DetokenizeStream, cancelled unless the engine finished it."""

    def __init__(self, state: ServerState, prompt: list[int], params: SamplingParams, stop: list[str]):
        self.state = state
        self.prompt_tokens = len(prompt)
        self.completion_tokens = 0
        self.eos = set(params.stop_token_ids)
        try:
            self.detok = DetokenizeStream(state.tokenizer, stop)
        except ValueError as e:
            raise ApiError(400, str(e), param="stop") from None
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        self.finish_reason: FinishReason | None = None  # as the client sees it, once known
        self._timer = state.metrics.timer(len(prompt))
        self.request = _submit(state, prompt, params, self._on_event)
        state.running += 1

    def _on_event(self, event) -> None:  # on the engine's thread
        if event.token is not None:
            self._timer.token()
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    async def pieces(self, client: HttpRequest | None) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """``(text, token ids, finish_reason)`` as tokens arrive (the ids generated since the
        previous piece; ``finish_reason`` set on the last). Tokens that queued up while the
        event loop was busy make one piece: under load each stream sends fewer, longer chunks
        instead of falling further behind. With ``client``, polls it and stops (cancelling)
        when it has disconnected."""
        ids: list[int] = []
        text = ""
        try:
            while True:
                first = await self._next(client)
                if first is None:
                    return
                for event in self._with_queued(first):
                    if event.finish_reason in (FinishReason.CANCELLED, FinishReason.ERROR):
                        reason = FinishReason(event.finish_reason)
                        self._finished(reason)
                        why = str(event.error or ("the request was cancelled (the server is stopping)" if reason is FinishReason.CANCELLED else "engine error"))
                        raise ApiError(500, why, type="server_error", code=reason.value)
                    stopped = False
                    if event.token is not None:
                        self.completion_tokens += 1
                        ids.append(event.token)
                        if event.token not in self.eos:  # an EOS token ends the text, it is not part of it
                            piece, stopped = self.detok.push(event.token)
                            text += piece
                    if stopped:
                        self.finish_reason = FinishReason.STOP
                        yield text, ids, FinishReason.STOP.value
                        return  # the finally cancels the engine request
                    if event.finish_reason is not None:
                        self._finished(FinishReason(event.finish_reason))
                        yield text + self.detok.finish(), ids, FinishReason(event.finish_reason).value
                        return
                if text:
                    yield text, ids, None
                    ids, text = [], ""
        finally:
            self.close()

    def _with_queued(self, first):
        """``first``, then the events already waiting on the queue (taken without waiting)."""
        yield first
        while not self._queue.empty():
            yield self._queue.get_nowait()

    async def _next(self, client: HttpRequest | None):
        if client is None:
            return await self._queue.get()
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await client.is_disconnected():
                    return None

    def close(self) -> None:
        """Cancel the engine request unless the engine has finished it (idempotent)."""
        if not self._done:
            self.request.cancel()
            self._finished(self.finish_reason or FinishReason.CANCELLED)

    def _finished(self, reason: FinishReason) -> None:
        if not self._done:
            self._done = True
            self.state.running -= 1
            self.finish_reason = reason
            self.state.metrics.finished(reason)

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens)


def _submit(state: ServerState, prompt: list[int], params: SamplingParams, on_event):
    engine = state.engine
    try:
        return engine.submit(prompt, params, on_event)
    except RuntimeError:  # the engine ended between require_ready and here
        if state.failure is None:
            raise
        raise ApiError(503, f"the server cannot serve: {state.failure}", type="server_error", code="model_lost") from None
    except QueueFull as e:
        raise ApiError(429, f"the server is at capacity ({e or 'request queue full'}); retry later", type="rate_limit_error", code="queue_full") from None
    except InputError as e:
        too_long = len(prompt) + params.max_tokens > engine.max_seq_len
        param = ("prompt" if len(prompt) >= engine.max_seq_len else "max_tokens") if too_long else "prompt"
        raise ApiError(400, str(e), param=param, code="context_length_exceeded" if too_long else None) from None


def _params(body, prompt: list[int], max_tokens: int | None, state: ServerState) -> SamplingParams:
    if max_tokens is None:
        max_tokens = 16 if isinstance(body, CompletionBody) else max(1, state.engine.max_seq_len - len(prompt))
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
            stop_token_ids=tuple(state.tokenizer.eos_token_ids),
        )
    except ValueError as e:
        name = str(e).split()[0]
        raise ApiError(400, str(e), param=name if name in SamplingParams.__dataclass_fields__ else None) from None


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _answer(gen: _Generation, client: HttpRequest, model: str, chat: bool, body):
    """The whole answer, or a server-sent event stream of chunks ending in ``[DONE]``."""
    rid, created = new_id(chat), int(time.time())
    with_ids = body.return_token_ids
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if not body.stream:
        parts, all_ids, finish = [], [], None
        async for text, ids, finish in gen.pieces(client):
            parts.append(text)
            all_ids += ids
        if finish is None:  # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        answer = completion_object(rid, model, "".join(parts), finish, gen.usage(), chat=chat, created=created)
        if with_ids:
            answer["choices"][0]["token_ids"] = all_ids
        return JSONResponse(answer)

    async def events() -> AsyncIterator[str]:
        if chat:
            yield _sse(chunk_object(rid, model, created, chat=True, role=True))
        try:
            async for text, ids, finish in gen.pieces(None):  # starlette cancels this on disconnect
                chunk = chunk_object(rid, model, created, chat=chat, text=text, finish_reason=finish)
                if with_ids:
                    chunk["choices"][0]["token_ids"] = ids
                yield _sse(chunk)
        except ApiError as e:
            yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        else:
            if include_usage:
                yield _sse(chunk_object(rid, model, created, chat=chat, usage=gen.usage()))
        yield "data: [DONE]\n\n"

    # The background task also runs when the client left before the first chunk was pulled.
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}, background=BackgroundTask(gen.close))


def _encode(state: ServerState, prompt: str | list[int]) -> list[int]:
    return state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def _chat_prompt(state: ServerState, body: ChatBody) -> list[int]:
    if not state.tokenizer.chat_template:
        raise ApiError(400, f"model {state.model_name!r} has no chat template; use /v1/completions with a prompt", param="messages", code="no_chat_template")
    try:
        text = state.tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
    except Exception as e:  # a template error (jinja) names what the messages lacked
        raise ApiError(400, f"the chat template failed on these messages: {e}", param="messages") from None
    # The template writes the special tokens (BOS) itself.
    return state.tokenizer.encode(text, add_special_tokens=False)


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", code="invalid_json")
    # param: the top-level field (a union's member names, e.g. prompt.str, are pydantic's, not the client's)
    where = ".".join(loc) or "body"
    return ApiError(400, f"{where}: {first.get('msg', 'invalid')}", param=loc[0] if loc else None)


def create_app(engine, tokenizer, model_name: str, *, load: Callable[[], tuple[Any, Any]] | None = None, api_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over ``engine`` and ``tokenizer`` (both None with ``load``:
    see :class:`ServerState`). The app starts the engine at startup and stops it at shutdown.
    ``api_key``: the bearer key every ``/v1`` route then requires (None: no authentication)."""
    state = ServerState(model_name, engine, tokenizer, load)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="sharktank", lifespan=lifespan)
    app.state.serving = state
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.get("/health")
    async def health():
        code, body = state.status()
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "sharktank"}
        if state.ready.is_set():
            card["max_model_len"] = state.engine.max_seq_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HttpRequest):
        state.require_ready(body.model)
        body.check_supported()
        prompt = _encode(state, body.prompt)
        gen = _Generation(state, prompt, _params(body, prompt, body.max_tokens, state), body.stops())
        return await _answer(gen, request, model_name, False, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: HttpRequest):
        state.require_ready(body.model)
        body.check_supported()
        prompt = _chat_prompt(state, body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        gen = _Generation(state, prompt, _params(body, prompt, max_tokens, state), body.stops())
        return await _answer(gen, request, model_name, True, body)

    return app
