"""The OpenAI-compatible HTTP API and the chat page: an ASGI app (Starlette) over a Scheduler
(docs/http-api.md; `nanoeuler-run serve` runs it under uvicorn). Requests are checked, and
answers shaped, by `protocol`; here are the routes, the scheduler's jobs and the streaming.

    served = ServedModel(model, tok, name="sft", template=ChatTemplate.for_run("runs/sft"))
    app = create_app(served, max_batch=8, max_queue=64, operations=Operations(api_key="..."))

Routes:
    GET  /                      the chat page (static/chat.html: plain HTML and JavaScript)
    GET  /health                {"status": "ok", ...} while the scheduler runs
    GET  /metrics               Prometheus's text format (metrics.py)
    GET  /v1/models             the one model served, its id the run directory's name
    POST /v1/completions        prompt: a string, strings, token ids, or arrays of token ids
    POST /v1/chat/completions   messages, rendered in the run's chat template

Both POST routes answer one JSON object, or with "stream": true server-sent events (one chunk per
decoding step and choice with new text, a last chunk per choice with its finish_reason, usage
with stream_options.include_usage, then `data: [DONE]`). Greedy output equals `generate` (and
`chat`) at temperature 0, and a seeded sample equals generate(prompt, seed=seed + index).

Errors are OpenAI's error object {"error": {"message", "type", "param", "code"}}: 400 for a bad
request (malformed JSON included), 401 without the API key (where one is set: /v1/* only), 404
for an unknown model or route, 405, 413 for a body over max_request_bytes, 429 when max_queue
requests wait already, 503 while shutting down, 504 past the request timeout (a stream ends with
an error event instead), 500 for a failure of the server itself. A client that disconnects frees
its rows at once (streamed or not).

Shutting down (`drain`, which `nanoeuler-run serve` calls on SIGTERM or SIGINT): new requests get
503, those running go on for the grace period, then end (a stream with an error event and
`data: [DONE]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from importlib import resources

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.serving.metrics import CONTENT_TYPE, Metrics
from nanoeuler_core.serving.protocol import (ApiError, GenerationRequest, Limits, Responses, chat_prompt, check_model,
                                             parse_chat_completion, parse_completion, read_json)
from nanoeuler_core.serving.scheduler import (Done, Failed, Job, Prompt, QueueFull, Scheduler, ShuttingDown, Text,
                                              emit_each)

DISCONNECT_POLL_S = 0.5       # how often a request answered as a whole checks that its client is still there
# The page's scripts and styles are inline and it talks to this server only; nothing else may load.
PAGE_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
               "img-src data:; base-uri 'none'; form-action 'none'")


@dataclass(frozen=True)
class Operations:
    """How the server guards and ends its requests: the API key /v1/* requires (None: none), the
    largest request body, the seconds a request may take from its arrival (None: no limit), and the
    seconds running requests get to finish once the server shuts down."""

    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    request_timeout: float | None = None
    shutdown_grace: float = 30.0


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
               weights: str | None = None, operations: Operations = Operations(),
               prefix_cache_tokens: int | None = None) -> Starlette:
    """The ASGI app serving `served` through a Scheduler of `max_batch` rows, at most `max_queue`
    requests waiting, a prefix cache of `prefix_cache_tokens` (None: the decoder's default; the
    scheduler starts and stops with the app's lifespan), guarded as `operations` says.
    `app.state.drain()` begins shutting down (thread-safe)."""
    api = _Api(served, Scheduler(served.model, served.tok, max_batch, max_queue, speculative, weights,
                                 prefix_cache_tokens), operations)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()   # each step's events cross from the scheduler's thread at once
        api.scheduler.deliver = lambda events: _call_soon(loop, emit_each, events)
        await asyncio.to_thread(api.scheduler.start)   # compiles the decoding steps: off the event loop
        try:
            yield
        finally:
            api.stop_grace()
            await asyncio.to_thread(api.scheduler.close)

    routes = [Route("/", api.page, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.metrics_page, methods=["GET"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"])]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                    middleware=[Middleware(_Guard, api=api)])
    app.state.scheduler, app.state.metrics, app.state.operations = api.scheduler, api.metrics, operations
    app.state.drain = api.drain
    return app


class _Guard:
    """ASGI middleware before the routes: counts each answer's status (metrics), requires the API
    key on /v1/*, and refuses a body over max_request_bytes with 413, by its Content-Length before
    reading it, or once the bytes read pass the bound."""

    def __init__(self, app, api: "_Api"):
        self.app, self.api = app, api
        key = api.operations.api_key
        self.authorization = None if key is None else f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, metrics, status = scope["path"], self.api.metrics, 500

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await _error_response(refusal)(scope, receive, counted_send)
            await self.app(scope, self._bounded(receive), counted_send)
        finally:
            metrics.request(path, status)

    def _refusal(self, scope) -> ApiError | None:
        headers = dict(scope["headers"])
        if self.authorization is not None and scope["path"].startswith("/v1/") and \
                not secrets.compare_digest(headers.get(b"authorization", b""), self.authorization):
            return ApiError("a valid API key is required: send the header \"Authorization: Bearer KEY\" (the key "
                            "the server was started with, --api-key)", 401, code="invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.api.operations.max_request_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        most = self.api.operations.max_request_bytes
        return ApiError(f"the request body is larger than this server takes ({most} bytes, --max-request-bytes)",
                        413, code="request_too_large")

    def _bounded(self, receive):
        """`receive`, raising the 413 once the body's bytes pass the bound (a body sent in chunks)."""
        most, read = self.api.operations.max_request_bytes, 0

        async def bounded():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > most:
                raise self._too_large()
            return message

        return bounded


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
    deadline: float      # time.monotonic() past which it times out (inf: never)
    started: float = field(default_factory=time.monotonic)
    texts_at: dict = field(default_factory=dict)   # choice -> when its latest text came (metrics)

    def seconds_left(self) -> float | None:
        return None if self.deadline == float("inf") else max(0.0, self.deadline - time.monotonic())


class _Api:
    def __init__(self, served: ServedModel, scheduler: Scheduler, operations: Operations):
        self.served, self.scheduler, self.operations = served, scheduler, operations
        self.limits = Limits(served.name, served.model.cfg.ctx_len, scheduler.max_batch, served.template is not None)
        self.page_html = resources.files("nanoeuler_core.serving").joinpath("static/chat.html").read_text("utf-8")
        self.metrics = Metrics(scheduler)
        self.draining = False
        self._grace: threading.Timer | None = None

    # ----------------------------------------------------------------------------------------
    # shutting down

    def drain(self) -> None:
        """Take no new requests (503); those running end within the grace period, or are ended then
        (the scheduler fails them: a stream ends with an error event)."""
        if self.draining:
            return
        self.draining = True
        self.scheduler.drain()
        self._grace = threading.Timer(self.operations.shutdown_grace, self.scheduler.close, kwargs={"timeout": 0})
        self._grace.daemon = True
        self._grace.start()

    def stop_grace(self) -> None:
        if self._grace is not None:
            self._grace.cancel()

    # ----------------------------------------------------------------------------------------
    # GET

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self.page_html, headers={"Content-Security-Policy": PAGE_POLICY})

    async def health(self, request: Request) -> Response:
        status = "shutting_down" if self.draining else "ok"
        return _json({"status": status, "model": self.served.name, **self.scheduler.load()}, 503 if self.draining else 200)

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

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
        pending = self._pending(req, req.prompt, [], self.served.tok.eos_id, False, echo)
        pending.job.prompt_logprobs = req.prompt_logprobs
        return await self._answer(request, pending)

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
                  logprobs=req.top_logprobs, grammar=req.grammar)
        timeout = self.operations.request_timeout
        return _Pending(job, events, chat, req.stream, req.include_usage, echo,
                        float("inf") if timeout is None else time.monotonic() + timeout)

    # ----------------------------------------------------------------------------------------
    # answering

    async def _answer(self, request: Request, pending: _Pending) -> Response:
        try:
            self.scheduler.submit(pending.job)
        except QueueFull as exc:
            raise ApiError(str(exc), 429, code="queue_full", kind="rate_limit_error") from None
        except ShuttingDown as exc:
            raise ApiError(str(exc), 503, code="shutting_down", kind="server_error") from None
        job = pending.job
        responses = Responses(self.served.name, pending.chat, job.n, pending.echo, job.prompts, self.served.tok)
        if pending.stream:
            return StreamingResponse(self._stream(pending, responses), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = {i: pending.echo[i // job.n] if pending.echo else "" for i in range(job.choices)}
        entries = None if job.logprobs is None else {i: [] for i in range(job.choices)}
        reasons, checked = {}, time.monotonic()
        while True:
            try:
                event = await self._next_event(pending, DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:   # is anybody still waiting for the answer?
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.scheduler.cancel(job)
                    return Response(status_code=499)   # nobody reads it
            if isinstance(event, Prompt):
                responses.prompt(event)
                for i in range(event.index * job.n, (event.index + 1) * job.n):
                    entries[i] += responses.entries(i)
            elif isinstance(event, Text):
                texts[event.index] += event.text
                reasons[event.index] = event.finish_reason
                if entries is not None:
                    entries[event.index] += responses.entries(event.index, event) or []
            elif isinstance(event, Failed):
                status, code, kind = _failure(event)
                raise ApiError(event.message, status, code=code, kind=kind)
            elif isinstance(event, Done):
                self._count(event)
                return _json(responses.whole(texts, reasons, entries, event))

    async def _stream(self, pending: _Pending, responses: Responses):
        """The SSE body; a client that goes away cancels the job (its rows are freed). Where the
        prompts' log-probabilities come first (echo), the choices open once they are in. The events
        that wait in the job's queue when it wakes go out as one write: a server that falls behind
        its clients then writes less often, not less."""
        job, finished = pending.job, False
        prompts_left = len(job.prompts) if job.prompt_logprobs is not None else 0
        try:
            openings = [] if prompts_left else list(self._openings(pending, responses))
            if openings:
                yield b"".join(openings)
            while not finished:
                out = []
                event = await self._next_event(pending, None)
                while True:
                    if isinstance(event, Prompt):
                        responses.prompt(event)
                        prompts_left -= 1
                        if not prompts_left:
                            out += self._openings(pending, responses)
                    elif isinstance(event, Text):
                        entries = responses.entries(event.index, event)
                        out.append(_event(responses.chunk(event.index, event.text, event.finish_reason, entries)))
                    elif isinstance(event, Failed):
                        finished = True
                        status, code, kind = _failure(event)
                        out.append(_event(ApiError(event.message, status, code=code, kind=kind).body()))
                    elif isinstance(event, Done):
                        finished = True
                        self._count(event)
                        if pending.include_usage:
                            out.append(_event(responses.usage_chunk(event)))
                    if finished or pending.events.empty():
                        break
                    event = self._ready_event(pending)
                if finished:
                    out.append(b"data: [DONE]\n\n")
                yield b"".join(out)
        finally:
            if not finished:
                self.scheduler.cancel(job)

    def _openings(self, pending: _Pending, responses: Responses):
        for i in range(pending.job.choices):
            first = responses.opening(i)
            if first is not None:
                yield _event(first)

    async def _next_event(self, pending: _Pending, wait: float | None):
        """The job's next event, waiting at most `wait` seconds (asyncio.TimeoutError past it); past
        the request's deadline the job is cancelled and the event is a Failed saying so."""
        left = pending.seconds_left()
        try:
            event = await asyncio.wait_for(pending.events.get(), wait if left is None else min(left, wait or left))
        except asyncio.TimeoutError:
            if pending.seconds_left() != 0.0:
                raise
            self.scheduler.cancel(pending.job)
            return Failed(f"the request took longer than this server allows ({self.operations.request_timeout:g} s, "
                          f"--request-timeout)")
        return self._timed(pending, event)

    def _ready_event(self, pending: _Pending):
        """The job's next event, already in its queue."""
        return self._timed(pending, pending.events.get_nowait())

    def _timed(self, pending: _Pending, event):
        """`event`, a Text's time to first text or since the choice's last piece into the metrics."""
        if not isinstance(event, Text):
            return event
        now = time.monotonic()
        if not pending.texts_at:
            self.metrics.first_token.observe(now - pending.started)
        elif event.index in pending.texts_at:
            self.metrics.between_tokens.observe(now - pending.texts_at[event.index])
        pending.texts_at[event.index] = now
        return event

    def _count(self, done: Done) -> None:
        self.metrics.prompt_tokens.inc(done.prompt_tokens)
        self.metrics.completion_tokens.inc(done.completion_tokens)


def _failure(event: Failed) -> tuple[int, str | None, str]:
    """The status, code and type of a failed job's error: 504 past the request timeout, 503 while
    shutting down, else 500."""
    if "--request-timeout" in event.message:
        return 504, "timeout", "server_error"
    if "shutting down" in event.message:
        return 503, "shutting_down", "server_error"
    return 500, None, "server_error"


def _event(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
