"""Hugging Face interoperability: exported runs load in transformers with the same logits, greedy
tokens and chat prompts; tiny random Llama checkpoints made by transformers import with the same
logits, export back to the same tensors, and fine-tune; what cannot be represented is refused in
one line."""

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from cli_helpers import run_cli
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.inference.chat import chat, render
from nanoeuler_core.inference.generate import generate
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.template import ChatTemplate, TemplateError
from nanoeuler_core.interop import hf
from nanoeuler_core.interop.hf import read_safetensors
from nanoeuler_core.text.tokenizer import Tokenizer
from nanoeuler_core.training import pretrain, sft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = (Path(__file__).parents[1] / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
GPU_SHAPED = dict(dim=768, n_layers=2, n_heads=12, n_kv_heads=4, hidden_dim=2048, ctx_len=512, n_mtp=4)
CONVERSATIONS = [
    [{"role": "user", "content": "Add 2 and 3."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Reverse the word \"stone\".\nThen stop."}],
]


def close(ours: np.ndarray, theirs: np.ndarray, rtol: float = 1e-4) -> bool:
    """Equal within `rtol` of the largest magnitude (logits near 0 make elementwise ratios meaningless)."""
    return float(np.abs(ours - theirs).max()) <= rtol * float(np.abs(theirs).max())


def load_transformers(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


# ------------------------------------------------------------------------------------------------
# export


@pytest.fixture(scope="module")
def shakespeare_tokenizers():
    return {512: Tokenizer.train(CORPUS[:300_000], 512), 4096: Tokenizer.train(CORPUS, 4096)}


def make_run(path: Path, cfg: ModelConfig, tok: Tokenizer, training: dict) -> Model:
    """A run directory of a seeded model whose head is scaled up, so that greedy choices are clear-cut
    (untrained logits are nearly equal, and argmax would hinge on rounding)."""
    model = Model(cfg, backend="cpu", seed=3)
    params = model.params
    head = cfg.head_names()[0]   # tok_emb where the model ties them
    params[head] = params[head] * 40.0
    model.load_params(params)
    model.save(path, training=training)
    tok.save(path / "tokenizer.json")
    return model


@pytest.fixture(scope="module", params=["small", "small-tied", "gpu-shaped"])
def exported(request, shakespeare_tokenizers, tmp_path_factory):
    """(our model, tokenizer, export directory, transformers model) for a fine-tuned run of each shape."""
    if request.param.startswith("small"):
        cfg = ModelConfig.preset("small", rope_theta=20000.0, tie_embeddings=request.param == "small-tied")
        tok = shakespeare_tokenizers[512]
    else:
        cfg, tok = ModelConfig(vocab_size=4096, **GPU_SHAPED), shakespeare_tokenizers[4096]
    folder = tmp_path_factory.mktemp(request.param)
    model = make_run(folder / "run", cfg, tok, {"preset": "small", "stage": "sft", "template": "alpaca"})
    hf.export_run(folder / "run", folder / "hf", log=lambda msg: None)
    return model, tok, folder / "hf", load_transformers(folder / "hf")


def test_exported_config_is_spec_layout(exported):
    model, tok, out, _ = exported
    config = json.loads((out / "config.json").read_text())
    cfg = model.cfg
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"], config["max_position_embeddings"],
            config["vocab_size"], config["rope_theta"], config["rms_norm_eps"]) == \
        (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ctx_len, cfg.vocab_size,
         cfg.rope_theta, cfg.norm_eps)
    assert config["tie_word_embeddings"] is cfg.tie_embeddings and config["hidden_act"] == "silu"
    # tied, as transformers saves a tied Llama: no lm_head.weight
    assert ("lm_head.weight" in read_safetensors(out / "model.safetensors")) is not cfg.tie_embeddings
    assert sorted(read_safetensors(out / hf.MTP_FILE)) == ["heads.1", "heads.2", "heads.3"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_id and generation["max_length"] == cfg.ctx_len


def test_exported_logits_equal_ours(exported):
    model, tok, _, theirs = exported
    ids = np.array([tok.encode(CORPUS[5000:15000])[: model.cfg.ctx_len]])
    assert ids.shape[1] == model.cfg.ctx_len
    assert close(model.forward(ids), hf_logits(theirs, ids))


def our_greedy_tokens(model, ids: list[int], n: int, eos: int) -> tuple[list[int], float]:
    """Greedy continuation by our forward pass over the growing sequence, and the smallest top-2
    logit gap met on the way."""
    sequence, tokens, gap = list(ids), [], np.inf
    for _ in range(n):
        logits = model.forward(np.array([sequence[-model.cfg.ctx_len:]]))[0, -1]
        top2 = np.sort(logits)[-2:]
        gap = min(gap, top2[1] - top2[0])
        token = int(np.argmax(logits))
        tokens.append(token)
        if token == eos:
            break
        sequence.append(token)
    return tokens, gap


def test_transformers_greedy_generation_produces_our_tokens(exported):
    model, tok, _, theirs = exported
    prompt = "KING RICHARD III:\nNow is the winter"
    ids = tok.encode(prompt)
    ours, gap = our_greedy_tokens(model, ids, 40, tok.eos_id)
    assert gap > 1e-3  # no near-tie: the comparison tests the arithmetic, not rounding luck
    with torch.no_grad():
        generated = theirs.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, top_k=None,
                                    temperature=None, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
    assert generated[0, len(ids):].tolist() == ours
    text = generate(model, tok, prompt, max_new_tokens=40, temperature=0.0)
    assert text == tok.decode([t for t in ours if t != tok.eos_id])


def test_transformers_tokenizer_and_chat_template_render_our_prompt(exported):
    _, tok, out, _ = exported
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token == "</s>" and theirs.eos_token_id == tok.eos_id
    sample = CORPUS[20_000:22_000] + "</s>"
    assert theirs(sample)["input_ids"] == tok.encode(sample, allowed_special="all")
    for messages in CONVERSATIONS:
        rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == render(messages)
    with pytest.raises(Exception, match="alternate"):
        theirs.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)


def test_pretrained_runs_export_without_chat_template(shakespeare_tokenizers, tmp_path):
    make_run(tmp_path / "run", ModelConfig.preset("small"), shakespeare_tokenizers[512], {"preset": "small"})
    hf.export_run(tmp_path / "run", tmp_path / "hf", log=lambda msg: None)
    assert "chat_template" not in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())


def test_export_then_import_restores_every_head(exported, tmp_path):
    model, _, out, _ = exported
    hf.import_checkpoint(out, tmp_path / "back", log=lambda msg: None)
    back, _ = load_model(tmp_path / "back")
    assert back.cfg == model.cfg
    assert all(np.array_equal(back.params[name], value) for name, value in model.params.items())


# ------------------------------------------------------------------------------------------------
# import


def train_smol_tokenizer(missing: tuple[int, ...] = ()) -> "tokenizers.Tokenizer":
    """A SmolLM2-like tokenizer (digits split, specials first) trained by `tokenizers`, without
    vocabulary entries for the bytes in `missing`."""
    from tokenizers import decoders, models, trainers
    from tokenizers import pre_tokenizers as pre

    from nanoeuler_core.text.hf_json import CHAR_TO_BYTE

    hf_tok = tokenizers.Tokenizer(models.BPE())
    hf_tok.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)])
    hf_tok.decoder = decoders.ByteLevel()
    alphabet = [char for char in pre.ByteLevel.alphabet() if CHAR_TO_BYTE[char] not in missing]
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=alphabet, show_progress=False)
    hf_tok.train_from_iterator([CORPUS[:200_000]], trainer)
    return hf_tok


@pytest.fixture(scope="module")
def smol_tokenizer():
    return train_smol_tokenizer()


def tiny_llama(folder: Path, hf_tok, tied: bool, positions: int = 64) -> Path:
    """A random Llama checkpoint directory written by transformers itself, with a tokenizer. The
    tied one is laid out like SmolLM2 (tied embeddings, rope_theta 100000, bfloat16 weights, its
    extra config keys) and sharded; the untied one is float32 in one file."""
    torch.manual_seed(0)
    settings = dict(vocab_size=hf_tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    if tied:
        settings |= dict(is_llama_config=True, rope_interleaved=False, pretraining_tp=1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    with torch.no_grad():  # norms away from 1, so that a mixed-up norm weight shows
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
    if tied:
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    else:
        model.save_pretrained(folder)
    hf_tok.save(str(folder / "tokenizer.json"))
    if not tied:  # the other finds its end-of-text token through config.json's eos_token_id
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


@pytest.fixture(scope="module", params=["tied", "untied"])
def imported(request, smol_tokenizer, tmp_path_factory):
    """(transformers directory, its model, our run directory)."""
    folder = tmp_path_factory.mktemp(request.param)
    source = tiny_llama(folder / "hf", smol_tokenizer, tied=request.param == "tied")
    hf.import_checkpoint(source, folder / "run", log=lambda msg: None)
    return source, load_transformers(source), folder / "run"


def test_import_reads_shards_and_ties(imported):
    source, _, run = imported
    config = json.loads((run / "config.json").read_text())
    assert config["n_mtp"] == 1 and config["ctx_len"] == 64 and config["rope_theta"] == 100000.0
    tied = json.loads((source / "config.json").read_text())["tie_word_embeddings"]
    assert (source / hf.INDEX_FILE).exists() == tied
    assert (json.loads((source / "config.json").read_text()).get("dtype") == "bfloat16") == tied
    model, tok = load_model(run)
    assert tok.eos_id == 0 and tok.vocab_size == 384
    assert model.cfg.tie_embeddings == tied and ("heads.0" in model.params) is not tied   # tied: no copy


def test_imported_logits_equal_transformers(imported, smol_tokenizer):
    _, theirs, run = imported
    model, tok = load_model(run)
    ids = np.array([tok.encode(CORPUS[:2000])[:64], tok.encode(CORPUS[3000:5000])[:64]])
    assert ids.shape == (2, 64) and tok.encode(CORPUS[:2000]) == smol_tokenizer.encode(CORPUS[:2000]).ids
    assert close(model.forward(ids), hf_logits(theirs, ids))


def test_export_of_import_gives_back_the_same_tensors(imported, tmp_path):
    source, _, run = imported
    hf.export_run(run, tmp_path / "again", log=lambda msg: None)
    original = hf.read_hf_weights(source)
    again = read_safetensors(tmp_path / "again" / "model.safetensors")
    assert set(original) == set(again)   # tied: no lm_head.weight, in either
    assert all(np.array_equal(again[name], tensor) for name, tensor in original.items())
    assert json.loads((tmp_path / "again" / "config.json").read_text())["tie_word_embeddings"] == \
        json.loads((source / "config.json").read_text())["tie_word_embeddings"]
    assert not (tmp_path / "again" / hf.MTP_FILE).exists()


def test_import_with_more_heads_copies_head_zero(imported, tmp_path):
    source, _, _ = imported
    hf.import_checkpoint(source, tmp_path / "run", n_mtp=3, ctx_len=32, log=lambda msg: None)
    model, _ = load_model(tmp_path / "run")
    assert model.cfg.n_mtp == 3 and model.cfg.ctx_len == 32
    assert np.array_equal(model.params["heads.2"], model.params[model.cfg.head_names()[0]])


def test_sft_and_continued_pretraining_run_on_an_imported_model(imported, tmp_path):
    _, _, run = imported
    examples = tmp_path / "tasks.jsonl"
    examples.write_text("".join(json.dumps({"instruction": f"Add {a} and {a + 1}.", "output": str(2 * a + 1)}) + "\n"
                                for a in range(20)))
    tc = sft.fine_tune_config(run, steps=3, batch_size=4, lr=1e-3, eval_every=3, val_fraction=0.2)
    fine, _ = sft.start_sft(run, examples, tmp_path / "sft", tc, lambda msg: None)
    row, _ = pretrain.train(fine, lambda msg: None)
    assert row["step"] == 3 and np.isfinite(row["loss"]) and np.isfinite(row["val_loss"])
    model, tok = load_model(tmp_path / "sft")
    generate(model, tok, "Add 1 and 2.", max_new_tokens=5, temperature=0.0)
    with pytest.raises(ValueError, match="longer than the model's context of 64 tokens"):   # the template alone is longer
        chat(model, tok, [{"role": "user", "content": "Add 1 and 2."}], max_new_tokens=5, temperature=0.0)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS[:30_000])
    resumed = pretrain.resume_run(run, {"steps": 2, "batch_size": 2, "corpus": str(corpus)}, lambda msg: None)
    assert resumed.optimizer.step_count == 0
    row, _ = pretrain.train(resumed, lambda msg: None)
    assert row["step"] == 2 and (run / "optimizer.safetensors").exists()


# ------------------------------------------------------------------------------------------------
# bad input


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


BAD_CHECKPOINTS = {
    "attention_bias": (lambda d: _edit_config(d, attention_bias=True), "attention_bias = True"),
    "mlp_bias": (lambda d: _edit_config(d, mlp_bias=True), "mlp_bias = True"),
    "hidden_act": (lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act = 'gelu'"),
    "rope_scaling": (lambda d: _edit_config(d, rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    "rope_type": (lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
    "vocab": (lambda d: _edit_config(d, vocab_size=70_000), "vocab_size = 70000"),
    "head_dim": (lambda d: _edit_config(d, head_dim=8), "head_dim = 8"),
    "model_type": (lambda d: _edit_config(d, model_type="mistral"), "model_type = 'mistral'"),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
    "no config": (lambda d: (d / "config.json").unlink(), "config.json not found"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "neither model.safetensors"),
    "corrupt": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
                "not a valid safetensors file"),
    "bias tensor": (lambda d: _add_tensor(d, "model.layers.0.self_attn.q_proj.bias"), "the model has no biases"),
    "vocab mismatch": (lambda d: _edit_config(d, vocab_size=400), "vocab_size 400 but tokenizer.json has 384"),
}


def _add_tensor(folder: Path, name: str) -> None:
    from safetensors.numpy import save_file

    tensors = read_safetensors(folder / "model.safetensors")
    save_file({**tensors, name: np.zeros(64, np.float32)}, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def good_checkpoint(smol_tokenizer, tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("good") / "hf", smol_tokenizer, tied=False)


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_unrepresentable_or_broken_checkpoints_are_one_line(case, good_checkpoint, tmp_path, monkeypatch, capsys):
    spoil, message = BAD_CHECKPOINTS[case]
    source = Path(shutil.copytree(good_checkpoint, tmp_path / "hf"))
    spoil(source)
    code, _, err = run_cli(monkeypatch, capsys, "import", source, tmp_path / "run")
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "run" / "config.json").exists()


def test_export_errors_are_one_line(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "export", tmp_path / "missing", tmp_path / "out")
    assert code == 1 and err.count("\n") == 1 and "does not exist" in err


def test_cli_export_and_import(exported, tmp_path, monkeypatch, capsys):
    _, _, out, _ = exported
    code, stdout, _ = run_cli(monkeypatch, capsys, "import", out, tmp_path / "run", "--ctx-len", 64)
    assert code == 0 and "nanoeuler-run generate" in stdout
    code, stdout, _ = run_cli(monkeypatch, capsys, "export", tmp_path / "run", tmp_path / "hf")
    assert code == 0 and "from_pretrained" in stdout
    assert orjson.loads((tmp_path / "hf" / "config.json").read_bytes())["max_position_embeddings"] == 64
    code, _, err = run_cli(monkeypatch, capsys, "export", tmp_path / "run", tmp_path / "hf")
    assert code == 1 and "already holds a model" in err


# ------------------------------------------------------------------------------------------------
# an instruct model made elsewhere: a tokenizer without some byte tokens, its own chat template

# The bytes a real 135M instruct model's tokenizer has no token for (never or hardly ever in UTF-8 text).
MISSING = (4, 6, 19, 20, 22, 29, 192, 193, *range(241, 256))
# SmolLM2-Instruct's template (ChatML, a default system message).
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# What transformers' renderer adds to plain Jinja: trim_blocks, lstrip_blocks, loop controls, the
# namespace, raise_exception, strftime_now, tojson without HTML escaping, `tools` set to None, the
# {% generation %} tag.
KITCHEN_SINK_TEMPLATE = """{{- bos_token }}
{%- if tools is not none %}{{ raise_exception('tools are not supported') }}{% endif %}
{%- set ns = namespace(system='You are terse. Year ' + strftime_now('%Y') + '.') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = message['content'] %}
        {%- continue %}
    {%- endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {%- if loop.index0 <= 1 and not ns.done %}
<|im_start|>system
{{ ns.system }} {{ {'turns': messages | length, 'last': messages[-1]['content']} | tojson }}<|im_end|>
        {%- set ns.done = true %}
    {%- endif %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}<|im_end|>{% endgeneration %}
    {% else %}
{{ message['content'] | trim }}<|im_end|>
    {% endif %}

{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
CHATS = CONVERSATIONS + [
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "naïve <b> & 'quotes' \"too\""}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "  Hello.  "}, {"role": "user", "content": "Sum 2 and 3\x04."}],
]
INSTRUCT_CONFIG = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                   "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "model_max_length": 8192,
                   "chat_template": SMOL_TEMPLATE}


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """(transformers directory, our run imported from it): an instruct model whose tokenizer has no
    token for the bytes in MISSING, chatting in ChatML."""
    folder = tmp_path_factory.mktemp("instruct")
    source = tiny_llama(folder / "hf", train_smol_tokenizer(MISSING), tied=True, positions=256)
    (source / "tokenizer_config.json").write_text(json.dumps(INSTRUCT_CONFIG))
    hf.import_checkpoint(source, folder / "run", log=lambda msg: None)
    return source, folder / "run"


def test_an_instruct_model_without_some_byte_tokens_imports(instruct, tmp_path, monkeypatch, capsys):
    source, run = instruct
    code, _, err = run_cli(monkeypatch, capsys, "import", source, tmp_path / "run")
    assert code == 0 and "no token for 23 bytes (0x04, 0x06, 0x13," in err and "chats in its own template" in err
    model, tok = load_model(run)
    assert tok.missing_bytes == MISSING and tok.eos_id == tok.token_id("<|im_end|>")
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    text = CORPUS[:3000] + "a\x04b \x06\x13\x14\x16\x1d naïve \U000e0001\U000f0000\U00100000 end"
    ids = tok.encode(text)
    assert ids == theirs(text, add_special_tokens=False)["input_ids"] == \
        tokenizers.Tokenizer.from_file(str(source / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert tok.encode("a\x04b") == tok.encode("a") + tok.encode("b")  # the byte is dropped, as tokenizers does
    kept = bytes(b for b in text.encode() if b not in MISSING)
    assert b"".join(map(tok.token_bytes, ids)) == kept
    assert tok.decode(ids) == theirs.decode(ids) == kept.decode("utf-8", "replace")
    assert generate(model, tok, "Hi\x04 there", max_new_tokens=4, temperature=0.0) is not None


def test_imported_chat_template_renders_as_transformers_does(instruct):
    source, run = instruct
    template = ChatTemplate.for_run(run)
    assert template.source == SMOL_TEMPLATE and template.special_tokens["bos_token"] == "<|im_start|>"
    _, tok = load_model(run)
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    chat_tok = template.tokenizer(tok)
    for messages in CHATS:
        assert template.render(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True)
        for source_text in (SMOL_TEMPLATE, KITCHEN_SINK_TEMPLATE):
            ours = ChatTemplate(source_text, template.special_tokens)
            for generation_prompt in (True, False):
                rendered = theirs.apply_chat_template(messages, chat_template=source_text, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
                assert ours.render(messages, add_generation_prompt=generation_prompt) == rendered
            assert chat_tok.encode(rendered) == theirs(rendered, add_special_tokens=False)["input_ids"]
    with pytest.raises(TemplateError, match="refused the conversation: Unknown role: tool"):
        ChatTemplate(KITCHEN_SINK_TEMPLATE).render([{"role": "tool", "content": "x"}])
    with pytest.raises(Exception, match="Unknown role: tool"):
        theirs.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=KITCHEN_SINK_TEMPLATE,
                                   tokenize=False)


def test_an_imported_instruct_model_chats_in_its_template_up_to_its_end_of_turn(instruct, monkeypatch, capsys):
    _, run = instruct
    model, tok = load_model(run)
    template = ChatTemplate.for_run(run)
    assert template.stop_tokens(tok) == ["<|im_end|>"] and template.tokenizer(tok).eos_id == tok.token_id("<|im_end|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = chat(model, tok, messages, max_new_tokens=6, temperature=0.0, template=template)
    prompt = template.render(messages)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and prompt.endswith("<|im_start|>assistant\n")
    assert reply == generate(model, template.tokenizer(tok), prompt, max_new_tokens=6, temperature=0.0)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    code, stdout, err = run_cli(monkeypatch, capsys, "chat", run, "--temperature", "0", "--max-new-tokens", "6",
                                "--system", "Be brief.")
    assert code == 0 and stdout == reply + "\n" and "chat template of" in err


def test_an_imported_instruct_model_exports_and_fine_tunes_in_its_template(instruct, tmp_path):
    source, run = instruct
    hf.export_run(run, tmp_path / "hf", log=lambda msg: None)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.bos_token == "<|im_start|>" and exported.eos_token == "<|im_end|>"
    for messages in CHATS:
        assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            ChatTemplate.for_run(run).render(messages)

    examples = tmp_path / "tasks.jsonl"
    examples.write_text("".join(json.dumps({"instruction": f"Add {a} and {a + 1}.", "output": str(2 * a + 1)}) + "\n"
                                for a in range(10)))
    tc = sft.fine_tune_config(run, steps=1, batch_size=2, val_fraction=0.0)
    fine, _ = sft.start_sft(run, examples, tmp_path / "sft", tc, lambda msg: None)
    _, tok = load_model(run)
    template = ChatTemplate.for_run(run)
    first = sft.load_examples(examples)[0]
    prompt = exported.apply_chat_template([{"role": "user", "content": first.instruction}], tokenize=False,
                                          add_generation_prompt=True)
    sequence = fine.train_loader.sequences[0]
    expected = exported(prompt, add_special_tokens=False)["input_ids"] + tok.encode(first.output) + \
        [tok.token_id("<|im_end|>")]
    assert sequence.ids.tolist() == expected and sequence.n_prompt == len(expected) - len(tok.encode(first.output)) - 1
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["training"]["template"] == "chat_template"
    assert ChatTemplate.for_run(tmp_path / "sft").source == template.source == SMOL_TEMPLATE


def test_a_broken_chat_template_does_not_stop_the_import(good_checkpoint, tmp_path, monkeypatch, capsys):
    source = Path(shutil.copytree(good_checkpoint, tmp_path / "hf"))
    # chat_template.jinja comes before tokenizer_config.json's, as in transformers
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    code, _, err = run_cli(monkeypatch, capsys, "import", source, tmp_path / "run")
    assert code == 0 and "warning: the chat template is not carried over" in err
    assert "chat_template.jinja is not a valid Jinja template (line 1" in err
    assert ChatTemplate.for_run(tmp_path / "run") is None
