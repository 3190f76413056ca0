"""The OpenAI-compatible HTTP API and the chat page: an ASGI app (Starlette) over a Scheduler
(SPEC.md section 9; `nanoeuler-run serve` runs it under uvicorn).

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
with stream_options.include_usage, then `data: [DONE]`). Fields read: model (optional; another
id is a 404), max_tokens (completions: default 16; chat: max_completion_tokens too, default
until the end of the turn, at most one context), temperature (0..2, default 1; 0 = greedy),
top_p (0..1, default 1; 0 = greedy), n (each choice a row of its own, seed + index), stop (up to
4 strings, not included in the text), seed (random if absent), stream, stream_options, echo
(completions); and two of vLLM's extensions: top_k (0 or -1 = off) and ignore_eos (decode past the
end-of-text or end-of-turn token, to max_tokens: load tests). Other fields are ignored, as OpenAI does; a field of
the wrong type or out of range is a 400.

A prompt longer than the model's context is a 400 (as `generate` refuses it). A conversation
keeps its latest turns that fit with room for the reply, as `chat` does (inference/chat.py), and
is a 400 only if its last message alone does not fit. Greedy output equals `generate` (and
`chat`) at temperature 0, and a seeded sample equals generate(prompt, seed=seed + index).

Errors are OpenAI's error object {"error": {"message", "type", "param", "code"}}: 400 for a bad
request (malformed JSON included), 404 for an unknown model or route, 405, 429 when max_queue
requests wait already, 503 while shutting down, 500 for a failure of the server itself.
A client that disconnects frees its rows at once (streamed or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from dataclasses import dataclass
from importlib import resources

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from nanoeuler_core.inference.chat import fit_context
from nanoeuler_core.inference.decoder import MAX_SEED, Sampling
from nanoeuler_core.inference.generate import prompt_ids
from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.serving.scheduler import Done, Failed, Job, QueueFull, Scheduler, ShuttingDown, Text, emit_each

MAX_STOP = 4                  # stop strings per request, as OpenAI allows
COMPLETION_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
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


class ApiError(Exception):
    """A request the server refuses, as OpenAI's error object with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def response(self) -> Response:
        return _json({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}},
                     self.status)


def _json(content, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status, media_type="application/json")


def create_app(served: ServedModel, max_batch: int = 8, max_queue: int = 64, speculative: bool = False) -> Starlette:
    """The ASGI app serving `served` through a Scheduler of `max_batch` rows, at most `max_queue`
    requests waiting (the scheduler starts and stops with the app's lifespan)."""
    api = _Api(served, Scheduler(served.model, served.tok, max_batch, max_queue, speculative))

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


async def _api_error(request, exc: ApiError) -> Response:
    return exc.response()


async def _http_error(request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, wrong method) as OpenAI error objects."""
    what = {404: f"no route {request.url.path}: the API is under /v1 (GET /v1/models, POST /v1/completions, "
                 f"POST /v1/chat/completions)",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return ApiError(what, exc.status_code, code="not_found" if exc.status_code == 404 else None).response()


async def _server_error(request, exc: Exception) -> Response:
    return ApiError(f"the server failed: {type(exc).__name__}: {exc}", 500, kind="server_error").response()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """fn(*args) on the event loop, from another thread (nothing once the loop is closed: nobody listens)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


@dataclass
class _Request:
    """A validated request: the job for the scheduler and how to answer it."""

    job: Job
    events: asyncio.Queue    # the job's events, from the scheduler
    chat: bool
    stream: bool
    include_usage: bool
    echo: list[str]      # completions with echo: each prompt's text, put before its choices' text


class _Api:
    def __init__(self, served: ServedModel, scheduler: Scheduler):
        self.served, self.scheduler = served, scheduler
        self.ctx_len = served.model.cfg.ctx_len
        self.page_html = resources.files("nanoeuler_core.serving").joinpath("static/chat.html").read_text("utf-8")

    # ----------------------------------------------------------------------------------------
    # GET

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self.page_html, headers={"Content-Security-Policy": PAGE_POLICY})

    async def health(self, request: Request) -> Response:
        return _json({"status": "ok", "model": self.served.name, **self.scheduler.load()})

    def _model_card(self) -> dict:
        return {"id": self.served.name, "object": "model", "created": self.served.created, "owned_by": "nanoeuler",
                "max_model_len": self.ctx_len, "chat": self.served.template is not None}

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model_id"], None)
        return _json(self._model_card())

    # ----------------------------------------------------------------------------------------
    # POST

    async def completions(self, request: Request) -> Response:
        body = await _body(request)
        params = self._parse(body, chat=False)
        prompts, texts = self._prompts(body.get("prompt"))
        echo = texts if _field(body, "echo", (bool,), False, "a boolean") else []
        return await self._answer(request, self._request(params, prompts, [], self.served.tok.eos_id, False, echo))

    async def chat_completions(self, request: Request) -> Response:
        body = await _body(request)
        params = self._parse(body, chat=True)
        template = self.served.template
        if template is None:
            raise ApiError(f"the model {self.served.name!r} has no chat template (a pretrained run): use "
                           f"/v1/completions, or start the server with --template", param="messages")
        messages = _messages(body.get("messages"))
        chat_tok = template.tokenizer(self.served.tok)
        try:
            template.check(messages)
            if messages[-1]["role"] != "user":
                raise ValueError("the last message must be the user's: the model replies to it")
            room = min(params["max_tokens"], self.ctx_len // 4)   # as inference/chat.py's chat() keeps room
            prompt = template.render(fit_context(chat_tok, messages, self.ctx_len, room, template))
            ids = prompt_ids(chat_tok, prompt, self.ctx_len, "the conversation")
        except ValueError as exc:
            raise ApiError(str(exc), param="messages", code=_context_code(exc)) from None
        ends = template.stop_tokens(self.served.tok)[1:]   # the template's other end tokens, as text
        return await self._answer(request, self._request(params, [ids], ends, chat_tok.eos_id, True, []))

    # ----------------------------------------------------------------------------------------
    # reading requests

    def _check_model(self, name, param: str | None) -> None:
        if name is not None and name != self.served.name:
            raise ApiError(f"the model {name!r} does not exist: this server serves {self.served.name!r} "
                           f"(GET /v1/models)", 404, param=param, code="model_not_found")

    def _parse(self, body: dict, chat: bool) -> dict:
        """The fields both routes share, checked; sampling as the scheduler takes it."""
        self._check_model(_field(body, "model", (str,), None, "a string"), "model")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _field(body, name, (int,), self.ctx_len if chat else COMPLETION_MAX_TOKENS, "an integer")
        _check(max_tokens >= 0, f"{name} must be at least 0, got {max_tokens}", name)
        temperature = float(_field(body, "temperature", (int, float), 1.0, "a number"))
        _check(0 <= temperature <= 2, f"temperature must be between 0 and 2, got {temperature}", "temperature")
        top_p = float(_field(body, "top_p", (int, float), 1.0, "a number"))
        _check(0 <= top_p <= 1, f"top_p must be between 0 and 1, got {top_p}", "top_p")
        top_k = _field(body, "top_k", (int,), 0, "an integer")
        _check(top_k >= -1, f"top_k must be at least 1, or 0 or -1 for no limit; got {top_k}", "top_k")
        n = _field(body, "n", (int,), 1, "an integer")
        most = self.scheduler.max_batch
        _check(1 <= n <= most, f"n must be between 1 and {most} (the rows this server decodes at once, "
                               f"--max-batch), got {n}", "n")
        stop = _field(body, "stop", (str, list), [], "a string or an array of strings")
        stop = [stop] if isinstance(stop, str) else stop
        _check(len(stop) <= MAX_STOP and all(isinstance(s, str) and s for s in stop),
               f"stop must be a string or an array of at most {MAX_STOP} non-empty strings", "stop")
        seed = _field(body, "seed", (int,), None, "an integer")
        options = _field(body, "stream_options", (dict,), {}, "an object")
        greedy = temperature == 0 or top_p == 0
        return {"max_tokens": max_tokens, "n": n, "stop": stop,
                "sampling": Sampling(0.0) if greedy else Sampling(temperature, top_k if top_k > 0 else None,
                                                                  top_p if top_p < 1 else None),
                "seed": secrets.randbelow(MAX_SEED) if seed is None else seed % MAX_SEED,
                "stream": _field(body, "stream", (bool,), False, "a boolean"),
                "ignore_eos": _field(body, "ignore_eos", (bool,), False, "a boolean"),
                "include_usage": _field(options, "include_usage", (bool,), False, "a boolean",
                                        "stream_options.include_usage")}

    def _prompts(self, prompt) -> tuple[list[list[int]], list[str]]:
        """A completion request's prompts as token ids (each checked against the context), and as text."""
        tok, ctx = self.served.tok, self.ctx_len
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            prompt = [prompt]
        shapes = "a string, an array of strings, an array of token ids or an array of arrays of token ids"
        _check(isinstance(prompt, list) and prompt and
               (all(isinstance(p, str) for p in prompt) or
                all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)),
               f"prompt must be {shapes}" + (" (it is required)" if prompt is None else ""), "prompt")
        ids, texts = [], []
        for i, p in enumerate(prompt):
            what = "the prompt" if len(prompt) == 1 else f"prompt {i}"
            if isinstance(p, str):
                try:
                    ids.append(prompt_ids(tok, p, ctx, what))
                except ValueError as exc:
                    raise ApiError(str(exc), param="prompt", code="context_length_exceeded") from None
                texts.append(p)
            else:
                _check(all(0 <= t < tok.vocab_size for t in p),
                       f"{what} holds token ids outside the vocabulary (0 to {tok.vocab_size - 1})", "prompt")
                if len(p) > ctx:
                    raise ApiError(f"{what} is {len(p)} tokens, longer than the model's context of {ctx} tokens: "
                                   f"shorten it", param="prompt", code="context_length_exceeded")
                ids.append(list(p))
                texts.append(tok.decode(p))
        return ids, texts

    def _request(self, params: dict, prompts: list[list[int]], ends: list[str], eos_id: int, chat: bool,
                 echo: list[str]) -> _Request:
        """The scheduler's job for a request and how to answer it; a choice ends at `eos_id` or at one
        of `ends` (text), unless the request says ignore_eos."""
        most = self.scheduler.max_batch
        _check(len(prompts) * params["n"] <= most,
               f"this request asks for {len(prompts) * params['n']} choices ({len(prompts)} prompts, n = "
               f"{params['n']}); this server decodes at most {most} at once (--max-batch)", "n")
        if params["ignore_eos"]:
            ends, eos_id = [], None
        events = asyncio.Queue()   # the job's events, put there by the scheduler
        job = Job(prompts, params["n"], params["max_tokens"], params["sampling"], params["seed"],
                  params["stop"] + ends, eos_id, events.put_nowait)
        return _Request(job, events, chat, params["stream"], params["include_usage"], echo)

    # ----------------------------------------------------------------------------------------
    # answering

    async def _answer(self, request: Request, req: _Request) -> Response:
        try:
            self.scheduler.submit(req.job)
        except QueueFull as exc:
            raise ApiError(str(exc), 429, code="queue_full", kind="rate_limit_error") from None
        except ShuttingDown as exc:
            raise ApiError(str(exc), 503, code="shutting_down", kind="server_error") from None
        shape = _Shape(req, self.served.name)
        if req.stream:
            return StreamingResponse(self._stream(req, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = {i: req.echo[i // req.job.n] if req.echo else "" for i in range(req.job.choices)}
        reasons, checked = {}, time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(req.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:   # is anybody still waiting for the answer?
                checked = time.monotonic()
                if await request.is_disconnected():
                    self.scheduler.cancel(req.job)
                    return Response(status_code=499)   # nobody reads it
            if isinstance(event, Text):
                texts[event.index] += event.text
                reasons[event.index] = event.finish_reason
            elif isinstance(event, Failed):
                raise ApiError(event.message, 503 if "shutting down" in event.message else 500, kind="server_error")
            elif isinstance(event, Done):
                return _json(shape.whole(texts, reasons, event))

    async def _stream(self, req: _Request, shape: "_Shape"):
        """The SSE body; a client that goes away cancels the job (its rows are freed)."""
        finished = False
        try:
            for i in range(req.job.choices):
                first = shape.opening(i)
                if first is not None:
                    yield _event(first)
            while not finished:
                event = await req.events.get()
                if isinstance(event, Text):
                    yield _event(shape.chunk(event.index, event.text, event.finish_reason))
                elif isinstance(event, Failed):
                    finished = True
                    yield _event({"error": {"message": event.message, "type": "server_error", "param": None,
                                            "code": None}})
                elif isinstance(event, Done):
                    finished = True
                    if req.include_usage:
                        yield _event(shape.usage_chunk(event))
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.scheduler.cancel(req.job)


class _Shape:
    """The response objects of one request: text completions or chat completions, whole or in chunks."""

    def __init__(self, req: _Request, model: str):
        self.req, self.model = req, model
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if req.chat else "text_completion"

    def _head(self, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.req.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def opening(self, index: int) -> dict | None:
        """The first chunk of a choice: the assistant's role (chat), or the echoed prompt."""
        if self.req.chat:
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            return {**self._head(True), "choices": [choice]}
        if self.req.echo:
            return self.chunk(index, self.req.echo[index // self.req.job.n])
        return None

    def chunk(self, index: int, text: str, finish_reason: str | None = None) -> dict:
        if self.req.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, done: Done) -> dict:
        return {**self._head(True), "choices": [], "usage": _usage(done)}

    def whole(self, texts: dict[int, str], reasons: dict[int, str], done: Done) -> dict:
        if self.req.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": None,
                        "finish_reason": reasons[i]} for i in sorted(texts)]
        else:
            choices = [{"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]}
                       for i in sorted(texts)]
        return {**self._head(False), "choices": choices, "usage": _usage(done)}


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _event(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


# ------------------------------------------------------------------------------------------------
# checking fields


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"the request body is not valid JSON ({exc}): send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, not {_json_type(body)}")
    return body


def _field(body: dict, name: str, kinds: tuple, default, what: str, param: str | None = None):
    """body[name] if it is of one of `kinds` (null or absent: `default`); else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ApiError(f"{param or name} must be {what}, not {_json_type(value)}", param=param or name)
    return value


def _check(ok, message: str, param: str) -> None:
    if not ok:
        raise ApiError(message, param=param)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return f"{name} ({orjson.dumps(value).decode()[:40]})"
    return "null"


def _context_code(exc: ValueError) -> str | None:
    return "context_length_exceeded" if "longer than the model's context" in str(exc) else None


def _messages(value) -> list[dict]:
    """Chat messages as the templates take them: {"role", "content": str}, the content of text parts
    joined ("developer" is OpenAI's newer name for "system")."""
    _check(isinstance(value, list) and value, "messages must be a non-empty array of {role, content} objects "
                                              "(it is required)", "messages")
    messages = []
    for i, message in enumerate(value):
        _check(isinstance(message, dict) and isinstance(message.get("role"), str),
               f"messages[{i}] must be an object with a string role", "messages")
        content = message.get("content")
        if isinstance(content, list):
            _check(all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content), f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(part["text"] for part in content)
        _check(content is None or isinstance(content, str), f"messages[{i}].content must be a string or an array "
                                                            f"of text parts", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        messages.append({"role": role, "content": content or ""})
    return messages
