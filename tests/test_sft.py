"""Supervised fine-tuning: the Alpaca template, data loading and its errors, prompt masking and
truncation, the batch loader, the bundled tasks, and `sft` end to end on a tiny base run."""

import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from nanoeuler_core.training import sft
from nanoeuler_core.engine.checkpoint import read_json
from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.text.tokenizer import Tokenizer
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.training.sft import Example, collate, encode_example, load_examples, render_prompt
from nanoeuler_core.inference.generate import generate
from nanoeuler_core.inference.loading import load_model
from nanoeuler_data import make_tasks

from finetune_helpers import TINY, cli, make_base_run, write_jsonl

TASKS = [{"instruction": f"Reverse the word: {w}", "output": w[::-1]} for w in ("night", "sword", "crown", "blood", "heart")]


# ------------------------------------------------------------------------------------------------
# template and files


def test_alpaca_template():
    assert render_prompt("Add the numbers.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Response:\n")
    assert render_prompt("Add the numbers.", "2 and 3") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n")


def test_load_json_list_and_jsonl(tmp_path):
    rows = [{"instruction": "Say hi.", "output": "hi"}, {"instruction": "Add.", "input": "2 3", "output": "5", "extra": 1}]
    (tmp_path / "a.json").write_text(json.dumps(rows), encoding="utf-8")
    write_jsonl(tmp_path / "a.jsonl", rows)
    expected = [Example("Say hi.", "", "hi"), Example("Add.", "2 3", "5")]
    assert load_examples(tmp_path / "a.json") == expected
    assert load_examples(tmp_path / "a.jsonl") == expected


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ("", "holds no examples"),
    ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "outp', "line 2: not valid JSON"),
    ('[{"instruction": "a", "output": "b"},', "not valid JSON"),
    ('{"instruction": "a"}\n', "line 1: missing field 'output'"),
    ('{"instruction": "a", "output": 5}\n', "field 'output' must be a string"),
    ('{"instruction": " ", "output": "b"}\n', "field 'instruction' is empty"),
    ('["a"]', "expected a JSON object"),
])
def test_bad_data_files_raise_one_line(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        load_examples(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_bundled_tasks_are_reproducible_and_held_out_disjoint():
    sft_rows, pair_rows = make_tasks.generate()
    assert make_tasks.jsonl(sft_rows) == sft.bundled_tasks().read_text(encoding="utf-8")
    assert make_tasks.jsonl(pair_rows) == (sft.bundled_tasks().parent / "dpo_pairs.jsonl").read_text(encoding="utf-8")
    examples = load_examples(sft.bundled_tasks())
    train, heldout = sft.split_heldout(examples, 0.1)
    assert {e.task for e in heldout} == {"reverse", "upper", "count", "sum", "complete"}
    # the held-out words, sums and lines never occur in training, in SFT or DPO
    subject = lambda instruction: instruction.split(":")[-1].strip() if ":" in instruction else instruction  # noqa: E731
    trained = {subject(e.instruction) for e in train} | {subject(p["instruction"]) for p in pair_rows[:1350]}
    assert not trained & {subject(e.instruction) for e in heldout}
    for row in sft_rows:
        if row["task"] == "reverse":
            assert row["output"] == subject(row["instruction"])[::-1]
        elif row["task"] == "sum":
            a, b = row["instruction"].removeprefix("What is ").removesuffix("?").split(" + ")
            assert row["output"] == str(int(a) + int(b))


# ------------------------------------------------------------------------------------------------
# sequences, masking, truncation, batches


def test_targets_are_masked_to_the_response(tok):
    prompt, response = render_prompt("Reverse the word: night"), "thgin"
    seq = encode_example(tok, prompt, response, ctx_len=96)
    prompt_ids, response_ids = tok.encode(prompt), tok.encode(response) + [tok.eos_id]
    assert seq.ids.tolist() == prompt_ids + response_ids and seq.n_prompt == len(prompt_ids) and not seq.truncated
    short = encode_example(tok, render_prompt("Say hi."), "hi", ctx_len=96)
    inputs, targets = collate([seq, short], pad_id=tok.eos_id)
    assert inputs.shape == targets.shape == (2, len(seq.ids) - 1)
    assert inputs[0].tolist() == seq.ids[:-1].tolist()
    # exactly the response tokens and </s> are targets; prompt and padding targets are -1
    assert targets[0].tolist() == [-1] * (len(prompt_ids) - 1) + response_ids
    n_short = len(short.ids) - 1
    assert targets[1, :short.n_prompt - 1].tolist() == [-1] * (short.n_prompt - 1)
    assert targets[1, short.n_prompt - 1:n_short].tolist() == short.ids[short.n_prompt:].tolist()
    assert (targets[1, n_short:] == -1).all()


def test_truncation_keeps_the_end_of_the_prompt(tok):
    prompt, response = render_prompt("Reverse the word: night"), "thgin"
    prompt_ids, response_ids = tok.encode(prompt), tok.encode(response) + [tok.eos_id]
    ctx_len = len(prompt_ids) // 2
    seq = encode_example(tok, prompt, response, ctx_len)
    assert seq.truncated and len(seq.ids) == ctx_len + 1
    assert seq.ids.tolist() == prompt_ids[-(ctx_len + 1 - len(response_ids)):] + response_ids
    # a response longer than the context keeps one prompt token and the start of the response
    seq = encode_example(tok, prompt, "night " * 40, ctx_len)
    assert seq.n_prompt == 1 and seq.ids[0] == prompt_ids[-1] and len(seq.ids) == ctx_len + 1
    # the count covers exactly the examples that did not fit
    short, long = Example("Hi", "", "hi"), Example("Reverse the word: night", "", "thgin")
    fits = len(tok.encode(short.prompt)) + len(tok.encode("hi"))  # + </s> = ctx_len + 1 tokens
    _, n_truncated = sft.encode_examples(tok, [short, long, long], fits)
    assert n_truncated == 2


def test_prompt_tokens_get_no_gradient(tok):
    """The SFT gradient equals the gradient of the mean log-likelihood of the response tokens alone:
    predicting prompt tokens contributes nothing (n_mtp=1, so the loss is exactly that mean)."""
    cfg = ModelConfig(vocab_size=tok.vocab_size, **{**TINY, "n_mtp": 1})
    model = Model(cfg, backend="reference", seed=1)
    seqs = [encode_example(tok, render_prompt(t["instruction"]), t["output"], cfg.ctx_len) for t in TASKS[:3]]
    inputs, targets = collate(seqs, pad_id=tok.eos_id)
    _, grads = model.loss_and_grad(inputs, targets)

    unmasked = np.full_like(targets, -1)
    for b, s in enumerate(seqs):
        unmasked[b, :len(s.ids) - 1] = s.ids[1:]  # every next token a target, prompt included
    response = np.zeros(targets.shape)
    for b, s in enumerate(seqs):
        response[b, s.n_prompt - 1:len(s.ids) - 1] = 1.0
    model.logprob_backward(inputs, unmasked, -response / response.sum())
    for name, g in grads.items():
        np.testing.assert_allclose(model.grads[name], g, rtol=1e-9, atol=1e-12, err_msg=name)
    # and the unmasked loss would have trained on the prompt: a different gradient
    _, leaky = model.loss_and_grad(inputs, unmasked)
    assert not np.allclose(leaky["tok_emb"], grads["tok_emb"])


def test_loader_is_deterministic_and_visits_every_example(tok):
    seqs = [encode_example(tok, render_prompt(f"Say {i}."), str(i), 96) for i in range(10)]
    loader = sft.SFTLoader(seqs, batch_size=4, ctx_len=96, seed=3, pad_id=tok.eos_id)
    again = sft.SFTLoader(seqs, batch_size=4, ctx_len=96, seed=3, pad_id=tok.eos_id)
    for step in (0, 1, 7):
        np.testing.assert_array_equal(loader.batch(step)[0], again.batch(step)[0])
    assert not np.array_equal(loader.batch(1)[0], loader.batch(2)[0])
    first_epoch = np.concatenate([sft.epoch_indices(10, 3, 5 * step, 5) for step in (0, 1)])  # 2 batches of 5
    assert sorted(first_epoch.tolist()) == list(range(10))
    assert {b.shape for step in range(5) for b in loader.batch(step)} == {(4, loader.length)}  # one shape


# ------------------------------------------------------------------------------------------------
# the command


def test_sft_writes_a_run_that_loads_and_learns(tmp_path, tok):
    base = make_base_run(tmp_path / "base", tok)
    data = write_jsonl(tmp_path / "tasks.jsonl", TASKS * 4)
    out = tmp_path / "sft"
    result = CliRunner().invoke(cli(), ["sft", "--base", str(base), "--data", str(data), "--out", str(out),
                                        "--steps", "30", "--batch-size", "4", "--lr", "3e-3", "--eval-every", "10"])
    assert result.exit_code == 0, result.output
    assert "exact match" in result.output
    for name in ("config.json", "tokenizer.json", "model.safetensors", "optimizer.safetensors", "metrics.jsonl"):
        assert (out / name).is_file(), name
    training = read_json(out / "config.json")["training"]
    assert training["template"] == "alpaca" and training["stage"] == "sft" and training["base"] == str(base)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert rows[-1]["loss"] < 0.75 * rows[0]["loss"]
    model, loaded_tok = load_model(out)
    assert isinstance(generate(model, loaded_tok, render_prompt("Reverse the word: night"), max_new_tokens=5), str)


def test_sft_runs_on_the_bundled_tasks_by_default(tmp_path, tok):
    base = make_base_run(tmp_path / "base", tok, ctx_len=128)
    result = CliRunner().invoke(cli(), ["sft", "--base", str(base), "--out", str(tmp_path / "sft"), "--steps", "2",
                                        "--batch-size", "2", "--val-fraction", "0.01"])
    assert result.exit_code == 0, result.output
    assert "2970 training and 30 held-out examples" in result.output
    assert read_json(tmp_path / "sft" / "config.json")["training"]["data"] == str(sft.bundled_tasks())


def test_sft_bad_input(tmp_path, tok):
    base = make_base_run(tmp_path / "base", tok)
    data = write_jsonl(tmp_path / "tasks.jsonl", TASKS)
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"instruction": "a", "output": "b"}\nnot json\n')
    app = cli()
    cases = [
        (["--base", str(tmp_path / "nowhere"), "--data", str(data)], "base run .* not found"),
        (["--base", str(base), "--data", str(tmp_path / "missing.jsonl")], "not found"),
        (["--base", str(base), "--data", str(corrupt)], "line 2: not valid JSON"),
        (["--base", str(base), "--data", str(data), "--out", str(base)], "already holds a run"),
        (["--base", str(base), "--data", str(data), "--steps", "0"], "--steps must be at least 1"),
    ]
    for args, message in cases:
        out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
        result = CliRunner().invoke(app, ["sft", *args, *out])
        assert result.exit_code != 0
        assert isinstance(result.exception, ValueError), result.output
        assert "\n" not in str(result.exception)
        assert re.search(message, str(result.exception)), str(result.exception)
    assert not (tmp_path / "out" / "config.json").exists()


# ------------------------------------------------------------------------------------------------
# other chat templates

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_examples_in_a_jinja_template_end_with_its_end_of_turn_token():
    specials = ["</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer.train("".join(render_prompt(t["instruction"]) + t["output"] for t in TASKS * 20), 300,
                          special_tokens=specials)
    template = ChatTemplate(CHATML)
    examples = [Example(t["instruction"], "", t["output"]) for t in TASKS] + [Example("Add.", "2 3", "5")]
    sequences, _ = sft.encode_examples(tok, examples, 96, template)
    for e, seq in zip(examples, sequences):
        prompt = template.render([{"role": "user", "content": e.instruction + (f"\n\n{e.input}" if e.input else "")}])
        prompt_ids = tok.encode(prompt, allowed_special="all")  # <|im_start|> and <|im_end|> as their tokens
        assert prompt_ids[0] == tok.token_id("<|im_start|>")
        assert seq.ids.tolist() == prompt_ids + tok.encode(e.output) + [tok.token_id("<|im_end|>")]
        assert seq.n_prompt == len(prompt_ids)
    alpaca, _ = sft.encode_examples(tok, examples, 96)  # the default stays Alpaca, ending with </s>
    assert alpaca[0].ids.tolist() == tok.encode(examples[0].prompt) + tok.encode(examples[0].output) + [tok.eos_id]


def test_sft_with_a_template_file_writes_a_run_that_chats_in_it(tmp_path, tok):
    base = make_base_run(tmp_path / "base", tok)
    data = write_jsonl(tmp_path / "tasks.jsonl", TASKS * 2)
    (tmp_path / "chatml.jinja").write_text(CHATML)
    out = tmp_path / "sft"
    result = CliRunner().invoke(cli(), ["sft", "--base", str(base), "--data", str(data), "--out", str(out), "--steps",
                                        "2", "--batch-size", "2", "--template", str(tmp_path / "chatml.jinja")])
    assert result.exit_code == 0, result.output
    assert f"examples rendered in {tmp_path / 'chatml.jinja'}" in result.output and "exact match" in result.output
    assert read_json(out / "config.json")["training"]["template"] == "chat_template"
    assert read_json(out / "tokenizer_config.json") == {"eos_token": "</s>", "chat_template": CHATML}
    template = ChatTemplate.for_run(out)
    assert template.source == CHATML and "tokenizer_config.json" in template.name
    # and a fine-tuning of that run keeps it, unless told otherwise
    assert sft.sft_template(out).source == CHATML and sft.sft_template(out, "alpaca").training_name == "alpaca"
