"""GGUF import: small files written by gguf.GGUFWriter from a random nanoeuler model, laid out as
llama.cpp's converter lays out a Llama (Q and K rows permuted for its RoPE; F32, Q8_0, Q4_1 tensors;
a byte-level BPE tokenizer), import with the same weights, logits, tokenizer and chat template; what
cannot be read is refused in one line."""

import sys
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run_cli
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import Model
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.interop.gguf import gguf_name, import_gguf, quantized_matrix, unpermute_rotary
from nanoeuler_core.quantized import dequantize, weight_format
from nanoeuler_core.text.hf_json import byte_level_spelling
from nanoeuler_core.text.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

CORPUS = (Path(__file__).parents[1] / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"
QUANTIZED = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.Q4_1,
             "blk.1.attn_k.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q4_1, "output.weight": Q.Q4_1,
             "blk.1.attn_v.weight": Q.F16, "blk.0.ffn_up.weight": Q.BF16, "blk.1.attn_output.weight": Q.Q4_0}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.fixture(scope="module")
def original():
    tok = Tokenizer.train(CORPUS[:100_000], 384)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                      ctx_len=64, n_mtp=1, rope_theta=100000.0)
    model = Model(cfg, backend="cpu", seed=3)
    params = model.params
    for name in params:  # norms away from 1, so that a mixed-up norm weight shows
        if name.endswith("norm"):
            params[name] = np.random.default_rng(0).uniform(0.5, 1.5, params[name].shape).astype(np.float32)
    model.load_params(params)
    return model, tok


def gguf_tensors(model: Model, types: dict) -> dict[str, tuple[np.ndarray, int]]:
    """GGUF name -> (stored data, type) as llama.cpp's converter writes the model's weights."""
    cfg, tensors = model.cfg, {}
    for name, w in model.params.items():
        if name.endswith(".wq"):
            w = llama_cpp_permute(w, cfg.n_heads)
        elif name.endswith(".wk"):
            w = llama_cpp_permute(w, cfg.n_kv_heads)
        kind = types.get(gguf_name(name), Q.F32)
        tensors[gguf_name(name)] = (gguf.quants.quantize(w, kind) if kind != Q.F32 else w, kind)
    return tensors


def write_gguf(path: Path, model: Model, tok: Tokenizer, types: dict | None = None, arch: str = "llama",
               pre: str = "gpt-2", tied: bool = False, drop: str | None = None, reshape: str | None = None,
               **extra) -> Path:
    """A GGUF file of `model` and `tok` as llama.cpp's converter writes it; the other arguments spoil it."""
    cfg = model.cfg
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.ctx_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_feed_forward_length(cfg.hidden_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    for key, value in extra.items():
        writer.add_string(key, value)
    n_learned = tok.vocab_size - len(tok.special_tokens)
    spelling = [byte_level_spelling(tok.token_bytes(i)) for i in range(n_learned)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(spelling + list(tok.special_tokens))
    writer.add_token_types([gguf.TokenType.NORMAL] * n_learned + [gguf.TokenType.CONTROL] * len(tok.special_tokens))
    writer.add_token_merges([f"{spelling[a]} {spelling[b]}" for a, b in tok.merges])
    writer.add_eos_token_id(tok.eos_id)
    writer.add_bos_token_id(tok.eos_id)
    writer.add_chat_template(TEMPLATE)
    for name, (data, kind) in gguf_tensors(model, types or {}).items():
        if (tied and name == "output.weight") or name == drop:
            continue
        if name == reshape:
            data = data.reshape(data.shape[1], data.shape[0])
        writer.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_params(model: Model, types: dict) -> dict[str, np.ndarray]:
    """What the import must give: each stored tensor dequantized, Q and K rows put back by inverting
    llama.cpp's permutation as an index map."""
    cfg, params = model.cfg, {}
    for name, (data, kind) in gguf_tensors(model, types).items():
        w = gguf.quants.dequantize(data, kind) if kind != Q.F32 else data
        ours = next(n for n in model.params if gguf_name(n) == name)
        if ours.endswith((".wq", ".wk")):
            rows = w.shape[0]
            order = llama_cpp_permute(np.arange(rows)[:, None], cfg.n_heads if ours.endswith(".wq") else cfg.n_kv_heads)
            w, stored = np.empty_like(w), w
            w[order[:, 0]] = stored
        params[ours] = w.reshape(model.params[ours].shape)
    return params


def imported(tmp_path: Path, model, tok, **kwargs):
    messages = []
    run = import_gguf(write_gguf(tmp_path / "model.gguf", model, tok, **kwargs), tmp_path / "run", log=messages.append)
    return *load_model(run), messages


def test_f32_import_gives_the_original_weights_and_logits(original, tmp_path):
    model, tok = original
    ours, our_tok, messages = imported(tmp_path, model, tok)
    assert ours.cfg == model.cfg
    assert all(np.array_equal(ours.params[n], w) for n, w in model.params.items())
    ids = np.array([tok.encode(CORPUS[:1000])[:64], tok.encode(CORPUS[5000:6000])[:64]])
    logits = model.forward(ids)
    assert float(np.abs(ours.forward(ids) - logits).max()) <= 1e-6 * float(np.abs(logits).max())
    assert not any(m.startswith(("kept", "dequantized")) for m in messages) and not ours.quantized


def test_quantized_tensors_are_kept_or_dequantized_and_q_k_unpermuted(original, tmp_path):
    model, tok = original
    ours, _, messages = imported(tmp_path, model, tok, types=QUANTIZED)
    expected = expected_params(model, QUANTIZED)
    assert all(np.array_equal(ours.params[n], w) for n, w in expected.items())
    reference = Model(model.cfg, backend="cpu")
    reference.load_params(expected)
    ids = np.array([tok.encode(CORPUS[:1000])[:64]])
    assert np.array_equal(ours.forward(ids), reference.forward(ids))
    # quantization noise only: Q8_0 and Q4_1 weights stay near the originals
    assert np.abs(ours.params["layers.0.wq"] - model.params["layers.0.wq"]).max() < 0.01
    assert [m for m in messages if m.startswith(("kept", "dequantized"))] == [
        "kept quantized, in the int8 and int4 formats decoding reads: 1 Q4_0 (int4), 3 Q4_1 (int4), 3 Q8_0 (int8) tensors",
        "dequantized to float32: 1 BF16, 1 F16 tensors"]
    # the kept matrices are the file's own blocks, Q and K rows unpermuted like the float ones
    assert {n: weight_format(*w)[:2] for n, w in ours.quantized.items()} == {
        "tok_emb": ("int8", 32), "layers.0.wq": ("int8", 32), "layers.0.wk": ("int4", 32),
        "layers.1.wk": ("int8", 32), "layers.1.w_down": ("int4", 32), "heads.0": ("int4", 32),
        "layers.1.wo": ("int4", 32)}
    assert all(np.array_equal(dequantize(*w).astype(np.float32), expected[n]) for n, w in ours.quantized.items())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_import_bit_for_bit_with_their_float16_scales(kind):
    """A block's bytes, nibbles and float16 scale (and Q4_1's offset) are the matrix's own, not a
    float32 copy; Q4_0's offset is -8 * scale exactly; the matrix's bytes are the file's."""
    rng = np.random.default_rng(3)
    O, K = 3, 64
    w = rng.standard_normal((O, K)).astype(np.float32) * 0.05
    data = gguf.quants.quantize(w, Q[kind])
    q, scale, zero = quantized_matrix(kind, data, (O, K))
    blocks = data.reshape(O, K // 32, -1)
    halves = blocks[..., :4].copy().view(np.uint16)   # each block's first two float16s
    assert scale.dtype == zero.dtype == np.float16
    assert np.array_equal(scale.view(np.uint16), halves[..., 0])
    if kind == "Q4_1":
        assert np.array_equal(zero.view(np.uint16), halves[..., 1])
    if kind == "Q4_0":
        assert np.array_equal(zero, np.float16(-8) * scale)
    assert q.nbytes + scale.nbytes + zero.nbytes == data.nbytes + (scale.nbytes if kind == "Q4_0" else 0)
    assert np.array_equal(dequantize(q, scale, zero).astype(np.float32), gguf.quants.dequantize(data, Q[kind]))


def test_unpermuted_q_and_k_under_hf_rope_give_llama_cpp_attention_scores():
    """llama.cpp's RoPE rotates rows (2i, 2i + 1) of each head, Hugging Face's rows (i, i + d/2):
    scores from the GGUF rows under the first equal those from the unpermuted rows under the second."""
    rng = np.random.default_rng(1)
    n_head, d, cols = 3, 8, 5
    wq, wk, x = rng.normal(size=(n_head * d, cols)), rng.normal(size=(n_head * d, cols)), rng.normal(size=(2, cols))
    angles = lambda p: p * 10000.0 ** (-np.arange(d // 2) * 2 / d)  # noqa: E731

    def interleaved(v, p):
        a, b = v[..., 0::2], v[..., 1::2]
        c, s = np.cos(angles(p)), np.sin(angles(p))
        return np.stack([a * c - b * s, a * s + b * c], -1).reshape(v.shape)

    def half(v, p):
        a, b = v[..., : d // 2], v[..., d // 2 :]
        c, s = np.cos(angles(p)), np.sin(angles(p))
        return np.concatenate([a * c - b * s, a * s + b * c], -1)

    def scores(rope, wq, wk):
        q, k = (wq @ x[0]).reshape(n_head, d), (wk @ x[1]).reshape(n_head, d)
        return (rope(q, 7) * rope(k, 3)).sum(-1)

    gq, gk = llama_cpp_permute(wq, n_head), llama_cpp_permute(wk, n_head)
    assert np.allclose(scores(interleaved, gq, gk), scores(half, unpermute_rotary(gq, n_head),
                                                           unpermute_rotary(gk, n_head)))
    assert not np.allclose(scores(interleaved, gq, gk), scores(half, gq, gk))


def test_tokenizer_and_chat_template_come_along(original, tmp_path):
    model, tok = original
    _, ours, _ = imported(tmp_path, model, tok)
    text = CORPUS[20_000:24_000] + " 12345 héllo\n\n  x"
    assert ours.encode(text) == tok.encode(text) and ours.decode(tok.encode(text)) == text
    assert ours.eos_id == tok.eos_id
    template = ChatTemplate.for_run(tmp_path / "run")
    assert template.render([{"role": "user", "content": "Hi"}]) == "<|user|>Hi</s><|assistant|>"


def test_tied_embeddings_stay_tied(original, tmp_path):
    model, tok = original
    ours, _, messages = imported(tmp_path, model, tok, tied=True)
    assert ours.cfg.tie_embeddings and "heads.0" not in ours.params   # head 0 reads tok_emb: no copy
    assert np.array_equal(ours.params["tok_emb"], model.params["tok_emb"])
    assert any("ties its embeddings" in m for m in messages)


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["12345", " ab"]), ("smollm", ["1", "2", "3", "4", "5", " ab"]),
    ("llama-bpe", ["123", "45", " ab"]), ("default", ["123", "45", " ab"])])
def test_pre_tokenizers_split_as_llama_cpp_does(pre, pieces, original, tmp_path):
    model, tok = original
    _, ours, _ = imported(tmp_path, model, tok, pre=pre)
    assert ours._pretokenize("12345 ab") == pieces
    text = "It's 2024: 12345 apples!\n"
    assert ours.decode(ours.encode(text)) == text


BAD = {
    "architecture": (dict(arch="gpt2"), "general.architecture = 'gpt2'"),
    "tensor type": (dict(types={"blk.0.attn_v.weight": Q.Q5_0}), "tensor blk.0.attn_v.weight is of type Q5_0"),
    "missing tensor": (dict(drop="blk.1.ffn_up.weight"), "lacks tensor blk.1.ffn_up.weight"),
    "shape": (dict(reshape="blk.0.ffn_gate.weight"), "tensor blk.0.ffn_gate.weight has shape [96, 64]"),
    "rope scaling": ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.type = 'yarn': RoPE is unscaled"),
    "pre-tokenizer": (dict(pre="qwen2"), "tokenizer.ggml.pre = 'qwen2'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unreadable_files_are_one_line(case, original, tmp_path, monkeypatch, capsys):
    model, tok = original
    kwargs, message = BAD[case]
    path = write_gguf(tmp_path / "model.gguf", model, tok, **kwargs)
    code, _, err = run_cli(monkeypatch, capsys, "import", path, tmp_path / "run")
    assert code == 1 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_cli_imports_a_gguf_file_and_refuses_a_missing_one(original, tmp_path, monkeypatch, capsys):
    model, tok = original
    code, _, err = run_cli(monkeypatch, capsys, "import", tmp_path / "absent.gguf", tmp_path / "run")
    assert code == 1 and err == f"error: {tmp_path / 'absent.gguf'} not found\n"
    (tmp_path / "text.gguf").write_text(CORPUS[:1000])
    code, _, err = run_cli(monkeypatch, capsys, "import", tmp_path / "text.gguf", tmp_path / "run")
    assert code == 1 and err.count("\n") == 1 and "is not a valid GGUF file (GGUF magic invalid)" in err
    path = write_gguf(tmp_path / "model.gguf", model, tok, types=QUANTIZED)
    code, out, err = run_cli(monkeypatch, capsys, "import", path, tmp_path / "run", "--n-mtp", "2", "--ctx-len", "32")
    assert code == 0 and "nanoeuler-run generate" in out and "dequantized" in err
    ours, _ = load_model(tmp_path / "run")
    assert ours.cfg.n_mtp == 2 and ours.cfg.ctx_len == 32
    assert np.array_equal(ours.params["heads.1"], ours.params["heads.0"])
    with pytest.raises(ValueError, match="already holds a run"):
        import_gguf(path, tmp_path / "run", log=lambda m: None)


def test_without_the_gguf_package_the_error_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    code, _, err = run_cli(monkeypatch, capsys, "import", tmp_path / "model.gguf", tmp_path / "run")
    assert code == 1 and err == "error: reading .gguf files needs the gguf package: pip install 'nanoeuler[gguf]'\n"
