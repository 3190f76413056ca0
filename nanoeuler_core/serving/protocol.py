"""OpenAI's completion and chat-completion requests and responses (docs/http-api.md): a JSON body
checked into a typed request in one place (a fault is an `ApiError`, OpenAI's error object), the
prompt's token ids, and the response objects, whole or as stream chunks.

Fields read: model (optional; another id is a 404), max_tokens (completions: default 16; chat:
max_completion_tokens too, default until the end of the turn, at most one context), temperature
(0..2, default 1; 0 = greedy), top_p (0..1, default 1; 0 = greedy), n (each choice a row of its
own, seed + index), stop (up to 4 strings, not included in the text), seed (random if absent),
stream, stream_options, echo (completions), logprobs (completions: 0..5 most likely tokens; chat:
true, with top_logprobs 0..20), response_format (structured outputs: `_response_format`); and two
of vLLM's extensions: top_k (0 or -1 = off) and ignore_eos (decode past the end-of-text or
end-of-turn token, to max_tokens: load tests).
Other fields are ignored, as OpenAI does; a field of the wrong type or out of range is a 400.

A prompt longer than the model's context is a 400 (as `generate` refuses it). A conversation
keeps its latest turns that fit with room for the reply, as `chat` does (inference/chat.py), and
is a 400 only if its last message alone does not fit.
"""

from __future__ import annotations

import codecs
import functools
import secrets
import time
import uuid
from dataclasses import dataclass

import orjson

from nanoeuler_core.inference.chat import fit_context
from nanoeuler_core.inference.constraint import response_grammar
from nanoeuler_core.inference.decoder import MAX_SEED, Sampling
from nanoeuler_core.inference.generate import prompt_ids
from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.serving.scheduler import Done, Prompt, Text

MAX_STOP = 4                  # stop strings per request, as OpenAI allows
COMPLETION_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
MAX_LOGPROBS = {False: 5, True: 20}   # most likely tokens per token, as OpenAI allows: completions, chat


class ApiError(Exception):
    """A request the server refuses, as OpenAI's error object with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What requests are checked against."""

    model: str        # the served model's id
    ctx_len: int      # its context, in tokens
    max_batch: int    # the rows decoded at once: the most choices a request may ask for
    chat: bool        # whether it has a chat template


@dataclass(kw_only=True)
class GenerationRequest:
    """The fields both POST routes read, checked: OpenAI's, and vLLM's top_k and ignore_eos."""

    model: str | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int               # 0 or -1: no limit
    n: int
    stop: list[str]
    seed: int                # the request's modulo MAX_SEED, or a random one
    stream: bool
    include_usage: bool      # stream_options.include_usage
    ignore_eos: bool
    grammar: str | None      # response_format's (inference/constraint.py), None: free text
    top_logprobs: int | None   # log-probabilities with this many most likely tokens; None: none

    @property
    def sampling(self) -> Sampling:
        """Sampling as the scheduler takes it (greedy at temperature 0 or top_p 0)."""
        if self.temperature == 0 or self.top_p == 0:
            return Sampling(0.0)
        return Sampling(self.temperature, self.top_k if self.top_k > 0 else None,
                        self.top_p if self.top_p < 1 else None)


@dataclass(kw_only=True)
class CompletionRequest(GenerationRequest):
    """POST /v1/completions: each prompt as token ids (within the context) and as text."""

    prompt: list[list[int]]
    prompt_text: list[str]
    echo: bool

    @property
    def prompt_logprobs(self) -> int | None:
        """The prompt's log-probabilities are asked for with echo and logprobs."""
        return self.top_logprobs if self.echo else None


@dataclass(kw_only=True)
class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions: the messages as the templates take them ({"role", "content": str})."""

    messages: list[dict]


# ------------------------------------------------------------------------------------------------
# reading requests


def read_json(raw: bytes) -> dict:
    """A request body: a JSON object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"the request body is not valid JSON ({exc}): send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, not {_json_type(body)}")
    return body


def check_model(name: str | None, limits: Limits, param: str | None) -> None:
    """A 404 unless `name` is the served model's id (or None)."""
    if name is not None and name != limits.model:
        raise ApiError(f"the model {name!r} does not exist: this server serves {limits.model!r} "
                       f"(GET /v1/models)", 404, param=param, code="model_not_found")


def parse_completion(body: dict, limits: Limits, tok) -> CompletionRequest:
    """A /v1/completions body, checked; its prompts encoded by `tok`."""
    fields = _shared_fields(body, limits, chat=False)
    prompt, prompt_text = _prompts(body.get("prompt"), tok, limits.ctx_len)
    echo = _field(body, "echo", (bool,), False, "a boolean")
    choices = len(prompt) * fields["n"]
    _check(choices <= limits.max_batch,
           f"this request asks for {choices} choices ({len(prompt)} prompts, n = {fields['n']}); this server "
           f"decodes at most {limits.max_batch} at once (--max-batch)", "n")
    return CompletionRequest(**fields, prompt=prompt, prompt_text=prompt_text, echo=echo)


def parse_chat_completion(body: dict, limits: Limits) -> ChatCompletionRequest:
    """A /v1/chat/completions body, checked (a 400 where the model has no chat template)."""
    fields = _shared_fields(body, limits, chat=True)
    if not limits.chat:
        raise ApiError(f"the model {limits.model!r} has no chat template (a pretrained run): use "
                       f"/v1/completions, or start the server with --template", param="messages")
    return ChatCompletionRequest(**fields, messages=_messages(body.get("messages")))


def chat_prompt(template: ChatTemplate, chat_tok, messages: list[dict], max_tokens: int, ctx_len: int) -> list[int]:
    """The token ids of the conversation rendered in `template`: its latest turns that fit the
    context with room for the reply, as `chat` keeps them (inference/chat.py)."""
    try:
        template.check(messages)
        if messages[-1]["role"] != "user":
            raise ValueError("the last message must be the user's: the model replies to it")
        room = min(max_tokens, ctx_len // 4)   # as inference/chat.py's chat() keeps room
        prompt = template.render(fit_context(chat_tok, messages, ctx_len, room, template))
        return prompt_ids(chat_tok, prompt, ctx_len, "the conversation")
    except ValueError as exc:
        raise ApiError(str(exc), param="messages", code=_context_code(exc)) from None


def _shared_fields(body: dict, limits: Limits, chat: bool) -> dict:
    """The `GenerationRequest` fields of `body`, checked."""
    model = _field(body, "model", (str,), None, "a string")
    check_model(model, limits, "model")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, name, (int,), limits.ctx_len if chat else COMPLETION_MAX_TOKENS, "an integer")
    _check(max_tokens >= 0, f"{name} must be at least 0, got {max_tokens}", name)
    temperature = float(_field(body, "temperature", (int, float), 1.0, "a number"))
    _check(0 <= temperature <= 2, f"temperature must be between 0 and 2, got {temperature}", "temperature")
    top_p = float(_field(body, "top_p", (int, float), 1.0, "a number"))
    _check(0 <= top_p <= 1, f"top_p must be between 0 and 1, got {top_p}", "top_p")
    top_k = _field(body, "top_k", (int,), 0, "an integer")
    _check(top_k >= -1, f"top_k must be at least 1, or 0 or -1 for no limit; got {top_k}", "top_k")
    n = _field(body, "n", (int,), 1, "an integer")
    most = limits.max_batch
    _check(1 <= n <= most, f"n must be between 1 and {most} (the rows this server decodes at once, "
                           f"--max-batch), got {n}", "n")
    stop = _field(body, "stop", (str, list), [], "a string or an array of strings")
    stop = [stop] if isinstance(stop, str) else stop
    _check(len(stop) <= MAX_STOP and all(isinstance(s, str) and s for s in stop),
           f"stop must be a string or an array of at most {MAX_STOP} non-empty strings", "stop")
    seed = _field(body, "seed", (int,), None, "an integer")
    options = _field(body, "stream_options", (dict,), {}, "an object")
    return {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "top_logprobs": _logprobs(body, chat),
            "n": n, "stop": stop, "seed": secrets.randbelow(MAX_SEED) if seed is None else seed % MAX_SEED,
            "stream": _field(body, "stream", (bool,), False, "a boolean"),
            "ignore_eos": _field(body, "ignore_eos", (bool,), False, "a boolean"),
            "grammar": _response_format(body),
            "include_usage": _field(options, "include_usage", (bool,), False, "a boolean",
                                    "stream_options.include_usage")}


def _response_format(body: dict) -> str | None:
    """The grammar response_format asks for (None: free text); a 400 saying what cannot be used (a
    schema keyword llguidance does not support is named)."""
    try:
        return response_grammar(_field(body, "response_format", (dict,), None, "an object"))
    except ValueError as exc:
        raise ApiError(str(exc), param="response_format") from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many most likely tokens to give with each token's log-probability (None: no logprobs):
    completions' logprobs (an integer), chat's top_logprobs where logprobs is true."""
    most = MAX_LOGPROBS[chat]
    if chat:
        wanted = _field(body, "logprobs", (bool,), False, "a boolean")
        top = _field(body, "top_logprobs", (int,), None, "an integer")
        _check(top is None or wanted, "top_logprobs needs logprobs: true", "top_logprobs")
        name, top = "top_logprobs", (top or 0) if wanted else None
    else:
        name, top = "logprobs", _field(body, "logprobs", (int,), None, "an integer")
    _check(top is None or 0 <= top <= most, f"{name} must be between 0 and {most}, got {top}", name)
    return top


def _prompts(prompt, tok, ctx: int) -> tuple[list[list[int]], list[str]]:
    """A completion request's prompts as token ids (each checked against the context), and as text."""
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


# ------------------------------------------------------------------------------------------------
# responses


class Responses:
    """The response objects of one request: text completions or chat completions, whole or in
    chunks; `echo` holds each prompt's text where a completion request says echo, `prompts` its
    token ids, and `tok` names the tokens of the log-probabilities (where asked for).

    Log-probabilities go by entries (offset of the token's text in the choice's text, token id,
    TokenLogprob or None: a prompt's first token has none)."""

    def __init__(self, model: str, chat: bool, n: int, echo: list[str], prompts: list[list[int]], tok):
        self.model, self.chat, self.n, self.echo, self.prompt_ids, self.tok = model, chat, n, echo, prompts, tok
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.prompts: dict[int, list] = {}   # prompt index -> its tokens' entries (echo with logprobs)

    def _head(self, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def prompt(self, event: Prompt) -> None:
        """A prompt's log-probabilities, which its choices begin with (echo)."""
        ids = self.prompt_ids[event.index]
        self.prompts[event.index] = list(zip(_text_offsets(self.tok, ids), ids, event.logprobs))

    def entries(self, index: int, event: Text | None = None) -> list | None:
        """The entries a piece of choice `index` carries (`event`), or without an event, those of its
        echoed prompt; None where log-probabilities are not asked for."""
        if event is None:
            return self.prompts.get(index // self.n)
        if not event.logprobs:
            return None
        shift = len(self.echo[index // self.n]) if self.echo else 0
        return [(shift + offset, entry.token, entry) for offset, entry in event.logprobs]

    def opening(self, index: int) -> dict | None:
        """The first chunk of a choice: the assistant's role (chat), or the echoed prompt."""
        if self.chat:
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            return {**self._head(True), "choices": [choice]}
        if self.echo:
            return self.chunk(index, self.echo[index // self.n], None, self.entries(index))
        return None

    def chunk(self, index: int, text: str, finish_reason: str | None = None, entries: list | None = None) -> dict:
        logprobs = self.logprobs(entries) if entries else None
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, done: Done) -> dict:
        return {**self._head(True), "choices": [], "usage": _usage(done)}

    def whole(self, texts: dict[int, str], reasons: dict[int, str], entries: dict[int, list] | None,
              done: Done) -> dict:
        """The whole response; `entries`: each choice's (None: log-probabilities not asked for)."""
        logprobs = {i: None if entries is None else self.logprobs(entries[i]) for i in texts}
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": logprobs[i],
                        "finish_reason": reasons[i]} for i in sorted(texts)]
        else:
            choices = [{"index": i, "text": texts[i], "logprobs": logprobs[i], "finish_reason": reasons[i]}
                       for i in sorted(texts)]
        return {**self._head(False), "choices": choices, "usage": _usage(done)}

    def logprobs(self, entries: list) -> dict:
        """OpenAI's logprobs object of a choice's tokens: chat's {"content": [...]}, or completions'
        {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (each token's top_logprobs
        holding the token itself too, as OpenAI's do)."""
        if self.chat:
            return {"content": [{**self._token(token, entry.logprob),
                                 "top_logprobs": [self._token(k, lp) for k, lp in entry.top]}
                                for _, token, entry in entries]}
        name = functools.partial(token_name, self.tok)
        tops = [None if entry is None else {name(k): lp for k, lp in (*entry.top, (token, entry.logprob))}
                for _, token, entry in entries]
        return {"tokens": [name(token) for _, token, _ in entries],
                "token_logprobs": [None if entry is None else entry.logprob for _, _, entry in entries],
                "top_logprobs": tops, "text_offset": [offset for offset, _, _ in entries]}

    def _token(self, token: int, logprob: float) -> dict:
        """Chat's token object: its text, log-probability and bytes."""
        return {"token": token_name(self.tok, token), "logprob": logprob, "bytes": list(self.tok.token_bytes(token))}


def token_name(tok, token: int) -> str:
    """A token as text: its bytes decoded, or where they are not whole UTF-8 characters OpenAI's
    "bytes:\\xe2\\x80" form."""
    raw = tok.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _text_offsets(tok, ids: list[int]) -> list[int]:
    """Where each token's text begins in the text of `ids`, in characters (a token that ends inside a
    character, and the one that completes it, begin where that character does)."""
    decoder, offsets, length = codecs.getincrementaldecoder("utf-8")(errors="replace"), [], 0
    for token in ids:
        offsets.append(length)
        length += len(decoder.decode(tok.token_bytes(token)))
    return offsets


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}
