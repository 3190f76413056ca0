"""Structured outputs (docs/http-api.md, "Structured outputs"): the sample op's token mask, rows held
to a JSON schema beside free rows in one decoding step (plain and speculative decoders), and the
server's response_format through the official `openai` client on a tiny untrained model (whose
tokens are all but random, so the grammar alone makes them JSON), checked with `jsonschema`."""

import json
import threading

import numpy as np
import pytest

from nanoeuler_core import registry
from nanoeuler_core.inference.constraint import Constraint, response_grammar
from nanoeuler_core.inference.decoder import Decoder, Sampling
from nanoeuler_core.inference.generate import generate
from test_serve import alpaca_run, model_tok, serving  # noqa: F401 (alpaca_run, model_tok: the tiny chat run)

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

NESTED = {"type": "object", "additionalProperties": False, "required": ["name", "address"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 5},
                                                    "zip": {"type": "integer", "minimum": 0, "maximum": 999}}}}}
ENUMS = {"type": "object", "additionalProperties": False, "required": ["colour", "size", "ok"],
         "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]},
                        "ok": {"type": "boolean"}}}
ARRAYS = {"type": "object", "additionalProperties": False, "required": ["tags", "points"],
          "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
                         "points": {"type": "array", "minItems": 1, "maxItems": 2,
                                    "items": {"type": "array", "items": {"type": "integer", "minimum": -9,
                                                                         "maximum": 9},
                                              "minItems": 2, "maxItems": 2}}}}
SCHEMAS = {"nested": NESTED, "enums": ENUMS, "arrays": ARRAYS}


def json_schema_format(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def mask_of(allowed_ids, V):
    bits = np.zeros(32 * ((V + 31) // 32), dtype=bool)
    bits[list(allowed_ids)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


# ------------------------------------------------------------------------------------------------
# the sample op's mask


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_masked_tokens_are_never_drawn(backend):
    """Over 400 rows with a seed each, a row draws only tokens its mask allows, whatever the
    temperature, top-k and top-p; greedy takes the best allowed token. The likeliest tokens are
    the ones left out, so an op that ignores the mask fails."""
    op, be = registry.op("sample").impl(backend), registry.backend(backend)
    V, rows = 40, 400
    logits = np.linspace(3.0, -3.0, V)   # token 0 likeliest
    allowed = {3, 7, 33, 39}

    def drawn(temperature, top_k=0, top_p=1.0):
        state = [be.asarray(a) for a in (np.zeros((rows, 1), np.int64), np.zeros((rows, 0, V)), np.arange(rows),
                                          np.zeros(rows, np.int64), np.zeros(rows, np.int64))]
        settings = [be.asarray(np.full(rows, x)) for x in (float(temperature), top_k, float(top_p))]
        mask = be.asarray(np.tile(mask_of(allowed, V), (rows, 1)))
        op.forward(be.asarray(np.tile(logits, (rows, 1, 1, 1))), *state, *settings, mask, max_pos=100)
        return set(be.to_host(state[0])[:, 0].tolist())

    assert drawn(0.0) == {3}
    assert drawn(2.0) == allowed
    assert drawn(1.0, top_k=2) == {3, 7}        # top-k among the allowed tokens
    assert drawn(1.0, top_k=10) == allowed       # k past the allowed ones: all of them
    assert drawn(2.0, top_p=0.3) == {3}


# ------------------------------------------------------------------------------------------------
# response_format -> grammar


def test_response_format_errors_are_one_line_and_name_the_problem():
    assert response_grammar(None) is None and response_grammar({"type": "text"}) is None
    assert response_grammar({"type": "json_object"})
    for schema, named in (({"type": "array", "uniqueItems": True}, "uniqueItems"),
                          ({"not": {"type": "string"}}, "not"),
                          ({"type": "string", "pattern": "(?<=a)b"}, "look-around")):
        with pytest.raises(ValueError, match=named) as info:
            response_grammar(json_schema_format(schema))
        assert "\n" not in str(info.value)
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {}}}):
        with pytest.raises(ValueError, match="response_format"):
            response_grammar(bad)


# ------------------------------------------------------------------------------------------------
# rows held to a grammar in the decoder


@pytest.mark.parametrize("speculative, sampling", [(False, Sampling(1.0)), (True, Sampling(0.0))])
def test_constrained_and_free_rows_share_a_step(model_tok, speculative, sampling):  # noqa: F811
    """A row held to a schema and a free row decode in one batch, each exactly as alone (the free
    row as if no grammar were near it), the held one valid JSON; with speculative decoding on
    (greedy: the same tokens as plain), the held row decodes plain and the free row speculates
    once the held one has ended."""
    model, tok = model_tok
    grammar = response_grammar(json_schema_format(ENUMS))
    prompt = tok.encode("Pick one:")

    def decode(decoder, rows):   # rows: (row, seed, grammar or None)
        kept = {}
        for b, seed, held in rows:
            decoder.admit(b, prompt, seed, sampling, 80, tok.eos_id, None,
                          None if held is None else Constraint(held, tok, tok.eos_id))
        while decoder.active_rows():
            decoder.step()
        for b, _, _ in rows:
            row = decoder.retire(b)
            kept[b] = (row.new, row.finish_reason)
        return kept

    decoder = Decoder(model, 2, speculative=speculative)
    together = decode(decoder, [(0, 11, grammar), (1, 12, None)])
    assert together[0] == decode(decoder, [(0, 11, grammar)])[0]
    assert together[1] == decode(decoder, [(1, 12, None)])[1]
    held, reason = together[0]
    assert reason == "stop"
    jsonschema.validate(json.loads(tok.decode(held)), ENUMS)
    if speculative:
        assert decoder.speculative_steps > 0 and decoder.steps > decoder.speculative_steps


def test_generate_takes_response_format(model_tok):  # noqa: F811
    model, tok = model_tok
    for seed in range(3):
        text = generate(model, tok, "A point:", max_new_tokens=80, temperature=1.0, seed=seed,
                        response_format=json_schema_format(ARRAYS))
        jsonschema.validate(json.loads(text), ARRAYS)
    cut = generate(model, tok, "A point:", max_new_tokens=3, temperature=1.0, seed=0,
                   response_format=json_schema_format(ARRAYS))
    assert cut.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)


# ------------------------------------------------------------------------------------------------
# the server, through the openai client


@pytest.fixture(scope="module")
def served(alpaca_run):  # noqa: F811
    with serving(alpaca_run, max_batch=4) as (url, app):
        yield app, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_completions_and_chat_validate(served, name):
    """At temperature 1, several seeds: every choice parses and validates, completions and chat."""
    _, client = served
    schema = SCHEMAS[name]
    completion = client.completions.create(model="tiny-sft", prompt="Answer in JSON:", max_tokens=120,
                                           temperature=1.0, seed=1, n=3,
                                           extra_body={"response_format": json_schema_format(schema, name)})
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)
    assert len({choice.text for choice in completion.choices}) > 1   # the seeds differ: so do the answers
    for seed in (2, 3):
        reply = client.chat.completions.create(model="tiny-sft", messages=[{"role": "user", "content": "JSON?"}],
                                               max_tokens=120, temperature=1.0, seed=seed,
                                               response_format=json_schema_format(schema, name))
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_json_object_streamed_and_cut_by_max_tokens(served):
    """Any JSON object: a choice that ends ("stop") parses to an object; one that max_tokens cuts
    ("length") is the start of one (an untrained model's strings run long)."""
    _, client = served
    stream = client.chat.completions.create(model="tiny-sft", messages=[{"role": "user", "content": "An object"}],
                                            max_tokens=150, temperature=1.0, seed=0, n=4, stream=True,
                                            response_format={"type": "json_object"})
    texts, reasons = [""] * 4, [None] * 4
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert "stop" in reasons and set(reasons) <= {"stop", "length"}
    for text, reason in zip(texts, reasons):
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)
    cut = client.completions.create(model="tiny-sft", prompt="{", max_tokens=2, temperature=1.0, seed=0,
                                    extra_body={"response_format": json_schema_format(NESTED)})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].text.startswith("{")


def test_unsupported_schema_is_a_400_naming_it(served):
    _, client = served
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-sft", messages=[{"role": "user", "content": "x"}],
                                       response_format=json_schema_format({"type": "array", "uniqueItems": True}))
    assert "uniqueItems" in info.value.message and info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.completions.create(model="tiny-sft", prompt="x", extra_body={"response_format": {"type": "yaml"}})


def test_constrained_and_free_requests_at_once(served, model_tok):  # noqa: F811
    """Requests with and without a schema decoding in one batch: the free ones are what `generate`
    gives alone, the held ones valid and what `generate` gives with the same response_format."""
    app, client = served
    model, tok = model_tok
    results, steps = {}, []
    decoder = app.state.scheduler.decoder
    step = decoder.step

    def counted_step():   # (rows held to a grammar, free rows) of each step
        held = sum(row.constraint is not None for row in decoder.active_rows())
        steps.append((held, len(decoder.active_rows()) - held))
        step()

    def ask(key, seed, response_format):
        extra = {"ignore_eos": True} if response_format is None else {"response_format": response_format}
        results[key] = client.completions.create(model="tiny-sft", prompt="Go:", max_tokens=100, temperature=1.0,
                                                 seed=seed, extra_body=extra).choices[0]

    asks = [("free", 21, None), ("nested", 22, json_schema_format(NESTED)), ("enums", 23, json_schema_format(ENUMS)),
            ("free2", 24, None)]
    threads = [threading.Thread(target=ask, args=a) for a in asks]
    decoder.step = counted_step
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        del decoder.step
    assert any(held and free for held, free in steps)
    for key, seed, response_format in asks:
        alone = generate(model, tok, "Go:", max_new_tokens=100, temperature=1.0, seed=seed,
                         stop_at_eos=response_format is not None, response_format=response_format)
        assert results[key].text == alone, key
        if response_format is not None:
            jsonschema.validate(json.loads(results[key].text), SCHEMAS[key])
