"""Serving (docs/http-api.md): the official `openai` client against a server started here on a tiny
run (completions, chat, streaming, n > 1, stop strings, seeds), greedy output against `nanoeuler-run
generate --temperature 0` and `chat`, log-probabilities (the prompt's against `eval`'s scoring, the
generated tokens' against the model's own logits), concurrent requests sharing the batch, the
bounded queue, clients that disconnect, bad requests (a 4xx with a message, and the server keeps
serving), operations (API key, body size, timeout, metrics, graceful shutdown), and the command's
own errors. tests/test_serve_browser.py drives the chat page in Chromium."""

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from cycle_model import cycle_trained
from finetune_helpers import make_base_run
from nanoeuler_core.cli import app as cli_app
from nanoeuler_core.cli.serve import listen
from nanoeuler_core.eval import hellaswag, text_loss
from nanoeuler_core.inference.chat import chat
from nanoeuler_core.inference.decoder import Decoder, Sampling
from nanoeuler_core.inference.generate import generate
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.serving.app import Operations, ServedModel, _Pending, create_app
from nanoeuler_core.serving.protocol import Responses
from nanoeuler_core.serving.scheduler import Done, Job, Text
from nanoeuler_core.serving.protocol import token_name
from nanoeuler_core.serving.server import DrainingServer
from nanoeuler_core.text.tokenizer import Tokenizer
from test_chat import CHATML
from test_generate import CYCLE_CFG, count_running_ahead

openai = pytest.importorskip("openai")

PROMPTS = ["It was", "Add 2 and 3.", ""]


@contextlib.contextmanager
def serving_with_server(run_dir, template="own", max_batch=4, max_queue=16, speculative=False,
                        operations=Operations(shutdown_grace=1.0)):
    """A server of the run in a background thread on a free port, as `serve` runs it: yields (base
    url, the app, the uvicorn server)."""
    model, tok = load_model(run_dir)
    template = ChatTemplate.for_run(run_dir) if template == "own" else template
    app = create_app(ServedModel(model, tok, run_dir.name, template), max_batch, max_queue, speculative,
                     operations=operations)
    sock = listen("127.0.0.1", 0)
    server = DrainingServer(app, uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app, server
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def serving(run_dir, **options):
    """A server of the run in a background thread on a free port: yields (base url, the app)."""
    with serving_with_server(run_dir, **options) as (url, app, _):
        yield url, app


@pytest.fixture(scope="module")
def alpaca_run(tmp_path_factory, tok):
    """A tiny run marked as fine-tuned in the Alpaca template (as `sft` leaves it)."""
    run = make_base_run(tmp_path_factory.mktemp("serve") / "tiny-sft", tok, seed=3)
    config = json.loads((run / "config.json").read_text())
    config["training"]["template"] = "alpaca"
    (run / "config.json").write_text(json.dumps(config))
    return run


@pytest.fixture(scope="module")
def server(alpaca_run):
    with serving(alpaca_run) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_tok(alpaca_run):
    return load_model(alpaca_run)


def user(text):
    return {"role": "user", "content": text}


def active_rows(url):
    return httpx.get(url + "/health").json()["active"]


def wait_until(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------
# the API through the openai client


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-sft"]
    assert client.models.retrieve("tiny-sft").id == "tiny-sft"
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["rows"] == 4
    page = httpx.get(server[0] + "/")   # the chat page: everything inline, nothing from elsewhere
    assert page.status_code == 200 and "/v1/chat/completions" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert not any(f"{attribute}=" in page.text for attribute in (" src", " href"))


def test_greedy_completion_equals_the_generate_command(alpaca_run, client):
    """Greedy output equals `nanoeuler-run generate --temperature 0`."""
    for prompt in PROMPTS:
        result = CliRunner().invoke(cli_app, ["generate", str(alpaca_run), prompt, "--temperature", "0",
                                              "--max-new-tokens", "24"])
        assert result.exit_code == 0, result.output
        completion = client.completions.create(model="tiny-sft", prompt=prompt, max_tokens=24, temperature=0)
        assert prompt + completion.choices[0].text + "\n" == result.stdout
        assert completion.usage.completion_tokens <= 24 and completion.usage.prompt_tokens > 0


def test_seeded_samples_equal_generate_and_n_choices_are_indexed(client, model_tok):
    model, tok = model_tok
    completion = client.completions.create(model="tiny-sft", prompt="It was", max_tokens=12, temperature=0.9,
                                           top_p=0.9, seed=5, n=3)
    texts = [c.text for c in completion.choices]
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert texts == [generate(model, tok, "It was", max_new_tokens=12, temperature=0.9, top_p=0.9, seed=5 + i)
                     for i in range(3)]
    assert len(set(texts)) > 1
    again = client.completions.create(model="tiny-sft", prompt="It was", max_tokens=12, temperature=0.9, top_p=0.9,
                                      seed=5, n=3)
    assert [c.text for c in again.choices] == texts
    batch = client.completions.create(model="tiny-sft", prompt=PROMPTS[:2], max_tokens=8, temperature=0.7, seed=1,
                                      n=2, extra_body={"top_k": 20})   # choice i: prompt i // n, seed 1 + i
    assert [c.text for c in batch.choices] == [generate(model, tok, PROMPTS[i // 2], max_new_tokens=8, temperature=0.7,
                                                        top_k=20, seed=1 + i) for i in range(4)]
    assert batch.usage.prompt_tokens == len(tok.encode(PROMPTS[0])) + len(tok.encode(PROMPTS[1]))


def test_chat_equals_chat_greedy(client, model_tok):
    model, tok = model_tok
    conversations = [[user("Add 2 and 3.")],
                     [user("Hi"), {"role": "assistant", "content": "Hello."}, user("Reverse the word: night")]]
    for messages in conversations:
        reply = client.chat.completions.create(model="tiny-sft", messages=messages, max_tokens=20, temperature=0)
        expected = chat(model, tok, messages, max_new_tokens=20, temperature=0.0)
        assert reply.choices[0].message.content == expected
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].finish_reason in ("stop", "length")
    # a conversation longer than the context keeps its latest turns, as `chat` does
    long = [user("word " * 30), {"role": "assistant", "content": "ok"}, user("Add 2 and 3.")]
    reply = client.chat.completions.create(model="tiny-sft", messages=long, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == chat(model, tok, long, max_new_tokens=10, temperature=0.0)


def test_streaming_gives_the_same_text_in_pieces(client):
    whole = client.completions.create(model="tiny-sft", prompt="It was", max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model="tiny-sft", prompt="It was", max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text and len([t for t in texts if t]) > 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    messages = [user("Add 2 and 3.")]
    whole = client.chat.completions.create(model="tiny-sft", messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-sft", messages=messages, max_tokens=20, temperature=0,
                                                 n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[0].message.content
        assert mine[-1].finish_reason == whole.choices[0].finish_reason


def test_events_waiting_together_go_out_as_one_write(server):
    # A stream that wakes to several events in its job's queue (a server behind its clients) writes
    # them as one body chunk, each still its own server-sent event.
    _, app = server
    api = next(route.endpoint.__self__ for route in app.routes if route.path == "/v1/completions")
    job = Job([[1, 2]], 1, 3, Sampling(0.0), 0, [], None, lambda event: None)
    responses = Responses("tiny-sft", False, 1, [], job.prompts, api.served.tok)

    async def body():
        pending = _Pending(job, asyncio.Queue(), False, True, True, [], float("inf"))
        for event in (Text(0, "a"), Text(0, "b"), Text(0, "c", "length"), Done(2, 3)):
            pending.events.put_nowait(event)
        return [chunk async for chunk in api._stream(pending, responses)]

    chunks = asyncio.run(body())
    assert len(chunks) == 1
    events = chunks[0].decode().split("\n\n")
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:3]] == ["a", "b", "c"]
    assert json.loads(events[3][6:])["usage"]["completion_tokens"] == 3
    assert events[4:] == ["data: [DONE]", ""]


def test_stop_strings_end_the_text_before_them(client):
    text = client.completions.create(model="tiny-sft", prompt="It was", max_tokens=40, temperature=0).choices[0].text
    stop = text[10:12]
    cut = text.index(stop)
    for stream in (False, True):
        args = dict(model="tiny-sft", prompt="It was", max_tokens=40, temperature=0, stop=[stop, "never seen §"])
        if stream:
            chunks = list(client.completions.create(**args, stream=True))
            got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**args).choices[0]
            got, reason = choice.text, choice.finish_reason
        assert (got, reason) == (text[:cut], "stop")
    assert client.completions.create(model="tiny-sft", prompt="It was", max_tokens=5, temperature=0,
                                     stop="never seen §").choices[0].finish_reason == "length"


def test_chatml_model_chats_in_its_own_template(tmp_path):
    """A run with a tokenizer_config.json chat_template (an imported instruct model): its template,
    its system role, and the reply ends at <|im_end|> (or its end-of-text token)."""
    specials = ["</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer.train("".join(f"<|im_start|>user\nSay {i}.<|im_end|>\n" for i in range(60)), 300,
                          special_tokens=specials)
    run = make_base_run(tmp_path / "chatml", tok, seed=4)
    ChatTemplate(CHATML, {"eos_token": "</s>"}).save(run)
    model, _ = load_model(run)
    messages = [{"role": "system", "content": "Be brief."}, user("Hi")]
    with serving(run) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="chatml", messages=messages, max_tokens=30, temperature=0)
    expected = chat(model, tok, messages, max_new_tokens=30, temperature=0.0, template=ChatTemplate.for_run(run))
    assert reply.choices[0].message.content == expected.split("</s>")[0]


# ------------------------------------------------------------------------------------------------
# continuous batching, the queue, disconnecting clients


def test_concurrent_requests_share_the_batch_and_each_equals_its_request_alone(server, client, model_tok):
    """10 requests with their own sampling at once on 4 rows: they join and leave the batch between
    steps, and each gets exactly what it gets alone (and what generate gives)."""
    model, tok = model_tok
    url, app = server
    decoder = app.state.scheduler.decoder
    requests = [dict(prompt=PROMPTS[i % 3], max_tokens=6 + 3 * i, temperature=[0, 0.8, 1.2][i % 3], seed=i,
                     top_p=[1, 0.9][i % 2]) for i in range(10)]
    alone = [client.completions.create(model="tiny-sft", **r).choices[0].text for r in requests]
    steps, row_steps = decoder.steps, decoder.row_steps

    async def all_at_once():
        async_client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        results = await asyncio.gather(*(async_client.completions.create(model="tiny-sft", **r) for r in requests))
        return [c.choices[0].text for c in results]

    assert asyncio.run(all_at_once()) == alone
    assert decoder.row_steps - row_steps > 2 * (decoder.steps - steps)   # most steps decoded several requests
    assert alone[1] == generate(model, tok, PROMPTS[1], max_new_tokens=9, temperature=0.8, top_p=0.9, seed=1)


def test_a_decoder_running_ahead_serves_each_request_as_alone(alpaca_run, client):
    """With the scheduler's decoder running ahead (as it does on a GPU: a step in flight while the
    scheduler admits rows, sends text and retires rows, some at a stop string), concurrent requests
    get what each gets alone from a server that does not run ahead."""
    requests = [dict(prompt=PROMPTS[i % 3], max_tokens=6 + 3 * i, temperature=[0, 0.8, 1.2][i % 3], seed=i,
                     stop=[" "] if i % 3 == 1 else None) for i in range(8)]
    alone = [client.completions.create(model="tiny-sft", **r).choices[0] for r in requests]
    assert any(choice.finish_reason == "stop" for choice in alone)
    with serving(alpaca_run) as (url, app):
        decoder = app.state.scheduler.decoder
        decoder.run_ahead = True
        ahead = count_running_ahead(decoder)

        async def all_at_once():
            async_client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            return await asyncio.gather(*(async_client.completions.create(model="tiny-sft", **r) for r in requests))

        results = [result.choices[0] for result in asyncio.run(all_at_once())]
    assert [(c.text, c.finish_reason) for c in results] == [(c.text, c.finish_reason) for c in alone]
    assert any(ahead)


def test_a_full_queue_answers_429_and_disconnected_clients_free_their_rows(alpaca_run):
    with serving(alpaca_run, max_batch=1, max_queue=1) as (url, _):
        body = {"prompt": "It was", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as first:       # takes the one row
                lines = first.iter_lines()
                assert next(lines).startswith("data: ")
                with http.stream("POST", "/v1/completions", json=body) as second:  # waits for it
                    assert second.status_code == 200
                    third = httpx.post(url + "/v1/completions", json=body)
                    assert third.status_code == 429 and "--max-queue 1" in third.json()["error"]["message"]
            # both clients went away: the row is free and nothing waits
            wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 0 and active_rows(url) == 0)
            # a client of a non-streamed request that goes away frees its row too
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as raw:
                payload = json.dumps({**body, "stream": False}).encode()
                raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
                wait_until(lambda: active_rows(url) == 1)
            wait_until(lambda: active_rows(url) == 0)
            assert http.post("/v1/completions", json={"prompt": "It", "max_tokens": 3}).status_code == 200


# ------------------------------------------------------------------------------------------------
# bad requests: a 4xx with OpenAI's error object, and the server goes on


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "It"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "It", "max_tokens": -1}, 400, "max_tokens", "at least 0"),
    ("/v1/completions", {"prompt": "word " * 200}, 400, "prompt", "longer than the model's context of 96 tokens"),
    ("/v1/completions", {"prompt": "It", "n": 9}, 400, "n", "n must be between 1 and 4"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, 400, "n", "asks for 6 choices"),
    ("/v1/completions", {"prompt": "It", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ("/v1/completions", {"prompt": "It", "temperature": 3}, 400, "temperature", "between 0 and 2"),
    ("/v1/completions", {"prompt": "It", "top_p": 1.5}, 400, "top_p", "between 0 and 1"),
    ("/v1/completions", {"prompt": "It", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("/v1/completions", {"prompt": "It", "stream": "yes"}, 400, "stream", "must be a boolean"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "it is required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty array"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages", "must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}, user("Hi")]}, 400, "messages",
     "Alpaca template has none"),
    ("/v1/chat/completions", {"messages": [user("word " * 200)]}, 400, "messages", "longer than the model's context"),
    ("/v1/completions", {"prompt": "It", "logprobs": 6}, 400, "logprobs", "between 0 and 5"),
    ("/v1/completions", {"prompt": "It", "logprobs": True}, 400, "logprobs", "must be an integer"),
    ("/v1/chat/completions", {"messages": [user("Hi")], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "between 0 and 20"),
    ("/v1/chat/completions", {"messages": [user("Hi")], "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs: true"),
])
def test_bad_requests_are_4xx_with_a_message(server, path, body, status, param, message):
    url = server[0]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"], error
    assert error["param"] == param
    assert httpx.post(url + "/v1/completions", json={"prompt": "It", "max_tokens": 2}).status_code == 200


def test_routes_and_errors_through_the_client(server, client):
    assert httpx.get(server[0] + "/v1/nothing").status_code == 404
    assert httpx.get(server[0] + "/v1/completions").status_code == 405
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="It")
    with pytest.raises(openai.BadRequestError, match="n must be between"):
        client.chat.completions.create(model="tiny-sft", messages=[user("Hi")], n=50)
    assert client.completions.create(model="tiny-sft", prompt="It", max_tokens=0).choices[0].text == ""


def test_a_pretrained_run_serves_completions_only(tmp_path, tok):
    run = make_base_run(tmp_path / "base", tok, seed=1)
    with serving(run) as (url, _):
        response = httpx.post(url + "/v1/chat/completions", json={"messages": [user("Hi")]})
        assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]
        assert httpx.get(url + "/v1/models").json()["data"][0]["chat"] is False
        assert httpx.post(url + "/v1/completions", json={"prompt": "It", "max_tokens": 2}).status_code == 200
    with serving(run, template=ChatTemplate.alpaca()) as (url, _):   # as `serve --template alpaca`
        assert httpx.post(url + "/v1/chat/completions", json={"messages": [user("Hi")], "max_tokens": 2}
                          ).status_code == 200


# ------------------------------------------------------------------------------------------------
# log-probabilities


def token_ids(tok, names):
    """Token ids of the token strings a completion's logprobs give."""
    ids = {token_name(tok, token): token for token in range(tok.vocab_size)}
    assert len(ids) == tok.vocab_size   # the names tell the tokens apart
    return [ids[n] for n in names]


def log_softmax(logits):
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_prompt_logprobs_through_echo_equal_evals_scoring(client, model_tok, tmp_path):
    """echo with max_tokens 0 gives the prompt's tokens and their log-probabilities as `eval`
    scores them (the first has none); lm-evaluation-harness's request (token ids, max_tokens 1)
    sums a continuation's to hellaswag's score of it."""
    model, tok = model_tok
    text = "Add 2 and 3. It was a day of"
    ids = tok.encode(text)
    choice = client.completions.create(model="tiny-sft", prompt=text, max_tokens=0, echo=True, logprobs=2).choices[0]
    lp = choice.logprobs
    assert choice.text == text and token_ids(tok, lp.tokens) == ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert [text[a:b] for a, b in zip(lp.text_offset, lp.text_offset[1:] + [len(text)])] == lp.tokens
    each = hellaswag.score(model, [(ids[:k + 1], 1) for k in range(1, len(ids))], tok.eos_id)   # eval's scoring
    np.testing.assert_allclose(lp.token_logprobs[1:], each, atol=1e-5, rtol=0)
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    loss = text_loss.evaluate(model, tok, tmp_path / "text.txt", window=96, batch_size=1)
    assert sum(lp.token_logprobs[1:]) == pytest.approx(-loss["loss"] * loss["tokens"], abs=1e-5)
    for name, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):   # the top 2, and the token itself
        assert 2 <= len(top) <= 3 and name in top and list(top.values())[:2] == sorted(top.values(), reverse=True)[:2]

    context, continuation = hellaswag.encode_pair(tok, "Add 2 and", " 3. It was")
    choice = client.completions.create(model="tiny-sft", prompt=context + continuation, max_tokens=1, echo=True,
                                       logprobs=1, temperature=0).choices[0]
    scored = choice.logprobs.token_logprobs[len(context):-1]   # as the harness slices them
    assert len(scored) == len(continuation)
    assert sum(scored) == pytest.approx(hellaswag.score(model, [(context + continuation, len(continuation))],
                                                        tok.eos_id)[0], abs=1e-5)
    greedy = [lp == max(top.values()) for lp, top in zip(scored, choice.logprobs.top_logprobs[len(context):-1])]
    expected = np.argmax(model.forward(np.array([context + continuation]))[0], axis=-1)[len(context) - 1:-1]
    assert greedy == [int(t) == c for t, c in zip(expected, continuation)]


@pytest.mark.parametrize("speculative", [False, True])
def test_generated_logprobs_are_the_models_log_softmax(alpaca_run, model_tok, speculative):
    """Each generated token's log-probability and top 5 are the log-softmax of the model's own logits
    at its position (the model's forward over prompt + completion), greedy or sampled (before
    temperature), plain or speculative (tokens from several positions of a step)."""
    model, tok = model_tok
    prompt = tok.encode("It was")
    with serving(alpaca_run, speculative=speculative) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for temperature in (0, 1.5):
            choice = client.completions.create(model="tiny-sft", prompt="It was", max_tokens=20, logprobs=5,
                                               temperature=temperature, seed=3, extra_body={"ignore_eos": True}).choices[0]
            lp = choice.logprobs
            new = token_ids(tok, lp.tokens)
            assert len(new) == 20 and tok.decode(new) == choice.text
            expected = log_softmax(model.forward(np.array([prompt + new[:-1]]))[0, len(prompt) - 1:])
            np.testing.assert_allclose(lp.token_logprobs, expected[np.arange(20), new], atol=1e-4, rtol=0)
            for j, top in enumerate(lp.top_logprobs):
                names = list(top)[:5]
                assert list(top.values())[:5] == sorted(top.values(), reverse=True)[:5]
                assert token_ids(tok, names) == list(np.argsort(-expected[j])[:5])
                if temperature == 0:
                    assert names[0] == lp.tokens[j]
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(choice.text)
        for before, name, offset in zip(["", *lp.tokens], lp.tokens, lp.text_offset):
            if not (before + name).startswith("bytes:") and "bytes:" not in name:   # whole characters
                assert choice.text[offset:offset + len(name)] == name
        if speculative:
            assert app.state.scheduler.decoder.speculative_steps > 0


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(0.9)])
def test_rows_keep_logprobs_through_accepted_proposals(sampling):
    """A row that asks keeps each token's log-probability under head 0 at its place, also where a
    speculative step keeps several tokens (the cycle-trained model's proposals are accepted): its
    logprobs and top tokens are the log-softmax of the model's forward; a row that does not ask
    keeps none."""
    model = cycle_trained(CYCLE_CFG)
    decoder = Decoder(model, 2, speculative=True)
    prompt = [1, 2, 3]
    row = decoder.admit(0, prompt, 5, sampling, 18, None, None, top_logprobs=4)
    other = decoder.admit(1, [4], 6, sampling, 18)
    while row.active or other.active:
        decoder.step()
    assert decoder.accepted > 0 and len(row.logprobs) == len(row.new) == 18 and other.logprobs == []
    expected = log_softmax(model.forward(np.array([prompt + row.new[:-1]]))[0, len(prompt) - 1:])
    np.testing.assert_allclose([e.logprob for e in row.logprobs], expected[np.arange(18), row.new], atol=1e-4)
    for entry, logp in zip(row.logprobs, expected):
        assert [k for k, _ in entry.top] == list(np.argsort(-logp, kind="stable")[:4])


def test_chat_and_streamed_logprobs(client):
    messages = [user("Add 2 and 3.")]
    reply = client.chat.completions.create(model="tiny-sft", messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(model="tiny-sft", messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [entry for c in chunks if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert sum(1 for c in chunks if c.choices[0].logprobs) > 3   # each chunk with its tokens
    assert client.chat.completions.create(model="tiny-sft", messages=messages, max_tokens=3).choices[0].logprobs is None

    whole = client.completions.create(model="tiny-sft", prompt="It was", max_tokens=15, temperature=0, logprobs=1,
                                      echo=True).choices[0].logprobs
    chunks = list(client.completions.create(model="tiny-sft", prompt="It was", max_tokens=15, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, field)] == \
            getattr(whole, field)


# ------------------------------------------------------------------------------------------------
# operations: the API key, the body's size, the timeout, metrics, shutting down


@pytest.fixture(scope="module")
def guarded(alpaca_run):
    with serving(alpaca_run, max_batch=2, operations=Operations(api_key="sesame", max_request_bytes=4000,
                                                               request_timeout=1.0)) as (url, _):
        yield url


def test_the_api_key_guards_v1_only(guarded):
    for key in ("wrong", ""):
        client = openai.OpenAI(base_url=guarded + "/v1", api_key=key or "x", max_retries=0,
                               default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError, match="--api-key"):
            client.completions.create(model="tiny-sft", prompt="It", max_tokens=2)
    refused = httpx.get(guarded + "/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=guarded + "/v1", api_key="sesame", max_retries=0)
    assert client.completions.create(model="tiny-sft", prompt="It", max_tokens=2).choices[0].finish_reason
    assert httpx.get(guarded + "/health").status_code == 200 and httpx.get(guarded + "/metrics").status_code == 200


def test_an_oversized_body_is_413_and_the_server_goes_on(guarded):
    headers = {"Authorization": "Bearer sesame", "Content-Type": "application/json"}
    body = json.dumps({"prompt": "It " * 3000, "max_tokens": 2}).encode()
    too_large = httpx.post(guarded + "/v1/completions", content=body, headers=headers)
    assert too_large.status_code == 413 and "--max-request-bytes" in too_large.json()["error"]["message"]
    chunked = httpx.post(guarded + "/v1/completions", content=iter([body[:3000], body[3000:]]), headers=headers)
    assert "content-length" not in chunked.request.headers and chunked.status_code == 413
    assert httpx.post(guarded + "/v1/completions", json={"prompt": "It", "max_tokens": 2},
                      headers=headers).status_code == 200


def test_a_request_past_its_timeout_ends(guarded):
    headers = {"Authorization": "Bearer sesame"}
    body = {"prompt": "It was", "max_tokens": 100_000, "ignore_eos": True}
    start = time.monotonic()
    slow = httpx.post(guarded + "/v1/completions", json=body, headers=headers, timeout=30)
    assert slow.status_code == 504 and slow.json()["error"]["code"] == "timeout" and time.monotonic() - start < 10
    with httpx.stream("POST", guarded + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=30) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "timeout"
    assert len(lines) >= 3   # text came before it
    wait_until(lambda: httpx.get(guarded + "/health").json()["active"] == 0)


def metric_samples(url):
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_and_tokens(server, client):
    url = server[0]
    before = metric_samples(url)
    completion = client.completions.create(model="tiny-sft", prompt="It was", max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    httpx.post(url + "/v1/completions", json={"prompt": "It", "temperature": 7})
    after = metric_samples(url)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("nanoeuler_requests_total", route="/v1/completions", status="200") == 1
    assert grew("nanoeuler_requests_total", route="/v1/completions", status="400") == 1
    assert grew("nanoeuler_completion_tokens_total") == completion.usage.completion_tokens == 8
    assert grew("nanoeuler_prompt_tokens_total") == completion.usage.prompt_tokens
    assert grew("nanoeuler_time_to_first_token_seconds_count") == 1
    assert grew("nanoeuler_inter_token_latency_seconds_count") >= 3
    assert after[("nanoeuler_rows", ())] == 4 and after[("nanoeuler_rows_busy", ())] == 0
    assert ("nanoeuler_queue_depth", ()) in after


def test_shutting_down_lets_a_running_stream_finish(alpaca_run):
    with serving_with_server(alpaca_run, operations=Operations(shutdown_grace=60)) as (url, app, server):
        body = {"prompt": "It was", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            server.handle_exit(signal.SIGTERM, None)   # as the signal does
            assert app.state.scheduler.load()["active"] == 1
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.TransportError):   # it listens no more
            httpx.get(url + "/health")


def test_shutting_down_refuses_new_requests_and_ends_streams_after_the_grace(alpaca_run):
    with serving(alpaca_run, operations=Operations(shutdown_grace=0.5)) as (url, app):
        body = {"prompt": "It was", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            app.state.drain()
            refused = http.post("/v1/completions", json={"prompt": "It", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert http.get("/health").status_code == 503
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"


# ------------------------------------------------------------------------------------------------
# the command


def test_serve_command_errors_are_one_line(tmp_path, alpaca_run):
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "nanoeuler_core.cli", "serve", *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    missing = serve(tmp_path / "nope")
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == \
        [f"error: run directory {tmp_path / 'nope'} does not exist"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = serve(alpaca_run, "--port", taken.getsockname()[1])
    lines = busy.stderr.strip().splitlines()
    assert busy.returncode == 1 and len(lines) == 1 and "cannot listen on 127.0.0.1" in lines[0], busy.stderr
    with listen("127.0.0.1", 0) as sock:   # a TCP socket, so that each connection streams without Nagle's delay
        assert sock.proto == socket.IPPROTO_TCP
    bad = serve(alpaca_run, "--request-timeout", 0)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == \
        ["error: --max-request-bytes and --request-timeout must be positive and --shutdown-grace at least 0, got "
         "1048576, 0.0 and 30.0"]
    assert "NANOEULER_API_KEY" in CliRunner().invoke(cli_app, ["serve", "--help"], terminal_width=200).output
