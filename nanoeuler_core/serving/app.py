"""The OpenAI-compatible HTTP API and the chat page: an ASGI app (Starlette) over a Scheduler
(docs/http-api.md; `nanoeuler-run serve` runs it under uvicorn). Requests are checked, and
answers shaped, by `protocol`; here are the routes, the scheduler's jobs and the streaming.

    served = ServedModel(model, tok, name="sft", template=ChatTemplate.for_run("runs/sft"))
    app = create_app(served, max_batch=8, max_queue=64)

Routes:
    GET  /                      the chat page (static/chat.html: plain HTML and JavaScript)
    GET  /health                {"status": "ok", ...} while the scheduler runs
    GET  /v1/models             the one model served, its id the run directory's name
    POST /v1/completions        prompt: a string, strings, token ids, or arrays of token ids
    POST /v1/chat/completions   messages, rendered in the run's chat template

Both POST routes answer one JSON object, or with "stream": true server-sent events (one chunk per
decoding step and choice with new text, a last chunk per choice with its finish_reason, usage
with stream_options.include_usage, then `data: [DONE]`). Greedy output equals `generate` (and
`chat`) at temperature 0, and a seeded sample equals generate(prompt, seed=seed + index).

Errors are OpenAI's error object {"error": {"message", "type", "param", "code"}}: 400 for a bad
request (malformed JSON included), 404 for an unknown model or route, 405, 429 when max_queue
requests wait already, 503 while shutting down, 500 for a failure of the server itself.
A client that disconnects frees its rows at once (streamed or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from importlib import resources

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.serving.protocol import (ApiError, GenerationRequest, Limits, Responses, chat_prompt, check_model,
                                             parse_chat_completion, parse_completion, read_json)
from nanoeuler_core.serving.scheduler import Done, Failed, Job, QueueFull, Scheduler, ShuttingDown, Text, emit_each

DISCONNECT_POLL_S = 0.5       # how often a request answered as a whole checks that its client is still there
# The page's scripts and styles are inline and it talks to this server only; nothing else may load.
PAGE_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
               "img-src data:; base-uri 'none'; form-action 'none'")


@dataclass
class ServedModel:
    """What the server serves: the model, its tokenizer, its id, and its chat template (None: a
    pretrained run, which has only /v1/completions)."""

    model: object
    tok: object
    name: str
    template: ChatTemplate | None = None
    created: int = 0


def _json(content, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status, media_type="application/json")


def create_app(served: ServedModel, max_batch: int = 8, max_queue: int = 64, speculative: bool = False,
               weights: str | None = None) -> Starlette:
    """The ASGI app serving `served` through a Scheduler of `max_batch` rows, at most `max_queue`
    requests waiting (the scheduler starts and stops with the app's lifespan)."""
    api = _Api(served, Scheduler(served.model, served.tok, max_batch, max_queue, speculative, weights))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()   # each step's events cross from the scheduler's thread at once
        api.scheduler.deliver = lambda events: _call_soon(loop, emit_each, events)
        await asyncio.to_thread(api.scheduler.start)   # compiles the decoding steps: off the event loop
        try:
            yield
        finally:
            await asyncio.to_thread(api.scheduler.close)

    routes = [Route("/", api.page, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"])]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.scheduler = api.scheduler
    return app


def _error_response(exc: ApiError) -> Response:
    return _json(exc.body(), exc.status)


async def _api_error(request, exc: ApiError) -> Response:
    return _error_response(exc)


async def _http_error(request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, wrong method) as OpenAI error objects."""
    what = {404: f"no route {request.url.path}: the API is under /v1 (GET /v1/models, POST /v1/completions, "
                 f"POST /v1/chat/completions)",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return _error_response(ApiError(what, exc.status_code, code="not_found" if exc.status_code == 404 else None))


async def _server_error(request, exc: Exception) -> Response:
    return _error_response(ApiError(f"the server failed: {type(exc).__name__}: {exc}", 500, kind="server_error"))


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """fn(*args) on the event loop, from another thread (nothing once the loop is closed: nobody listens)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


@dataclass
class _Pending:
    """A checked request as the scheduler runs it: its job, the job's events, and how to answer."""

    job: Job
    events: asyncio.Queue    # the job's events, from the scheduler
    chat: bool
    stream: bool
    include_usage: bool
    echo: list[str]      # completions with echo: each prompt's text, put before its choices' text


class _Api:
    def __init__(self, served: ServedModel, scheduler: Scheduler):
        self.served, self.scheduler = served, scheduler
        self.limits = Limits(served.name, served.model.cfg.ctx_len, scheduler.max_batch, served.template is not None)
        self.page_html = resources.files("nanoeuler_core.serving").joinpath("static/chat.html").read_text("utf-8")

    # ----------------------------------------------------------------------------------------
    # GET

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self.page_html, headers={"Content-Security-Policy": PAGE_POLICY})

    async def health(self, request: Request) -> Response:
        return _json({"status": "ok", "model": self.served.name, **self.scheduler.load()})

    def _model_card(self) -> dict:
        return {"id": self.served.name, "object": "model", "created": self.served.created, "owned_by": "nanoeuler",
                "max_model_len": self.limits.ctx_len, "chat": self.limits.chat}

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        check_model(request.path_params["model_id"], self.limits, None)
        return _json(self._model_card())

    # ----------------------------------------------------------------------------------------
    # POST

    async def completions(self, request: Request) -> Response:
        req = parse_completion(read_json(await request.body()), self.limits, self.served.tok)
        echo = req.prompt_text if req.echo else []
        return await self._answer(request, self._pending(req, req.prompt, [], self.served.tok.eos_id, False, echo))

    async def chat_completions(self, request: Request) -> Response:
        req = parse_chat_completion(read_json(await request.body()), self.limits)
        template = self.served.template
        chat_tok = template.tokenizer(self.served.tok)
        ids = chat_prompt(template, chat_tok, req.messages, req.max_tokens, self.limits.ctx_len)
        ends = template.stop_tokens(self.served.tok)[1:]   # the template's other end tokens, as text
        return await self._answer(request, self._pending(req, [ids], ends, chat_tok.eos_id, True, []))

    def _pending(self, req: GenerationRequest, prompts: list[list[int]], ends: list[str], eos_id: int, chat: bool,
                 echo: list[str]) -> _Pending:
        """The scheduler's job for a request and how to answer it; a choice ends at `eos_id` or at one
        of `ends` (text), unless the request says ignore_eos."""
        if req.ignore_eos:
            ends, eos_id = [], None
        events = asyncio.Queue()   # the job's events, put there by the scheduler
        job = Job(prompts, req.n, req.max_tokens, req.sampling, req.seed, req.stop + ends, eos_id, events.put_nowait,
                  req.grammar)
        return _Pending(job, events, chat, req.stream, req.include_usage, echo)

    # ----------------------------------------------------------------------------------------
    # answering

    async def _answer(self, request: Request, pending: _Pending) -> Response:
        try:
            self.scheduler.submit(pending.job)
        except QueueFull as exc:
            raise ApiError(str(exc), 429, code="queue_full", kind="rate_limit_error") from None
        except ShuttingDown as exc:
            raise ApiError(str(exc), 503, code="shutting_down", kind="server_error") from None
        responses = Responses(self.served.name, pending.chat, pending.job.n, pending.echo)
        if pending.stream:
            return StreamingResponse(self._stream(pending, responses), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = {i: pending.echo[i // pending.job.n] if pending.echo else "" for i in range(pending.job.choices)}
        reasons, checked = {}, time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(pending.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:   # is anybody still waiting for the answer?
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.scheduler.cancel(pending.job)
                    return Response(status_code=499)   # nobody reads it
            if isinstance(event, Text):
                texts[event.index] += event.text
                reasons[event.index] = event.finish_reason
            elif isinstance(event, Failed):
                raise ApiError(event.message, 503 if "shutting down" in event.message else 500, kind="server_error")
            elif isinstance(event, Done):
                return _json(responses.whole(texts, reasons, event))

    async def _stream(self, pending: _Pending, responses: Responses):
        """The SSE body; a client that goes away cancels the job (its rows are freed)."""
        finished = False
        try:
            for i in range(pending.job.choices):
                first = responses.opening(i)
                if first is not None:
                    yield _event(first)
            while not finished:
                event = await pending.events.get()
                if isinstance(event, Text):
                    yield _event(responses.chunk(event.index, event.text, event.finish_reason))
                elif isinstance(event, Failed):
                    finished = True
                    yield _event(ApiError(event.message, kind="server_error").body())
                elif isinstance(event, Done):
                    finished = True
                    if pending.include_usage:
                        yield _event(responses.usage_chunk(event))
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.scheduler.cancel(pending.job)


def _event(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
