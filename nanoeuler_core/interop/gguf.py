"""A Llama-architecture GGUF file (llama.cpp's format) as a run directory (docs/files.md).

    nanoeuler                 GGUF
    tok_emb                   token_embd.weight
    layers.{i}.attn_norm      blk.{i}.attn_norm.weight
    layers.{i}.wq/wk/wv/wo    blk.{i}.attn_q/attn_k/attn_v/attn_output.weight
    layers.{i}.ffn_norm       blk.{i}.ffn_norm.weight
    layers.{i}.w_gate/up/down blk.{i}.ffn_gate/ffn_up/ffn_down.weight
    norm                      output_norm.weight
    heads.0                   output.weight (none when the file ties them: the run ties them too)

F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors are read. Q8_0, Q4_0 and Q4_1 matrices are kept as
they are, bit for bit, in nanoeuler's int8 and int4 formats (nanoeuler_core/quantized.py: blocks
of 32 weights with a float16 scale, and for 4 bits a float16 offset: Q4_0's is -8 * scale), which
decoding reads; the float weights are their values. The others become float32. llama.cpp's
converter permutes the rows of Q and K for its interleaved RoPE; they are permuted back to the
Hugging Face layout the model's RoPE expects. The tokenizer (a byte-level BPE, "gpt2" in GGUF's
terms) becomes the equivalent tokenizer.json, the chat template goes into tokenizer_config.json.
The `gguf` package reads the file; nanoeuler needs it only here.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from nanoeuler_core import quantized
from nanoeuler_core.engine.checkpoint import CheckpointError
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.engine.model import QUANTIZED_PARTS
from nanoeuler_core.inference.template import ChatTemplate, TemplateError
from nanoeuler_core.interop.hf import check_import_options, model_config_from_hf, write_imported_run
from nanoeuler_core.text.base_tokenizer import TokenizerError
from nanoeuler_core.text.hf_json import byte_level_document
from nanoeuler_core.text.hf_tokenizer import HFTokenizer

_FIXED_NAMES = {"token_embd.weight": "tok_emb", "output_norm.weight": "norm", "output.weight": "heads.0"}
_LAYER_NAMES = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
                "ffn_norm": "ffn_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}
_GGUF_LAYER_NAME = {ours: theirs for theirs, ours in _LAYER_NAMES.items()}
_READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
_KEPT_TYPES = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}   # -> the format they are kept in

# tokenizer.ggml.pre -> the tokenizer.json pre_tokenizer that splits text as llama.cpp does for it.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _splits(*patterns: str) -> dict:
    """Split on each regex in turn, then byte-level (llama.cpp's unicode_regex_split)."""
    return {"type": "Sequence", "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False} for p in patterns),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


_PRE_TOKENIZERS = {
    "default": _splits(r"[\p{P}\$\+<=>\^~\|]+", _GPT2_PATTERN, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt-2": _splits(_GPT2_PATTERN),
    "smollm": _splits(r"\p{N}", _GPT2_PATTERN),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe"), _splits(_LLAMA3_PATTERN)),
}
_IGNORES_MERGES = {"llama3", "llama-v3", "llama-bpe"}  # a pretoken that is a vocabulary entry is that token


def gguf_name(name: str) -> str:
    """The GGUF name of nanoeuler parameter `name` (heads.0 for every head)."""
    if name.startswith("heads."):
        return "output.weight"
    fixed = {ours: theirs for theirs, ours in _FIXED_NAMES.items()}
    if name in fixed:
        return fixed[name]
    _, i, field = name.split(".")
    return f"blk.{i}.{_GGUF_LAYER_NAME[field]}.weight"


def nanoeuler_name(name: str) -> str | None:
    """The nanoeuler name of GGUF tensor `name`, or None if it has none."""
    if name in _FIXED_NAMES:
        return _FIXED_NAMES[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter (`LlamaModel.permute`): per head, its rows (2i, 2i + 1), the pairs
    its RoPE rotates, go back to rows (i, i + head_dim / 2), the pairs Hugging Face's rotates."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _metadata(reader, gguf) -> dict:
    """Every key-value pair of the file, as Python values."""
    def value(field, index: int, kind):
        part = field.parts[index]
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", "replace")
        if kind == gguf.GGUFValueType.FLOAT32:  # the shortest decimal of the float32: 1e-05, not 9.99999974e-06
            return float(str(part[0]))
        return part.tolist()[0]

    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            meta[name] = [value(field, i, field.types[-1]) for i in field.data]
        else:
            meta[name] = value(field, field.data[0], field.types[0])
    return meta


def _refuse(path: Path, key: str, value, why: str):
    raise CheckpointError(f"{path}: {key} = {value!r}: {why}; nanoeuler cannot represent it")


def model_config_from_gguf(meta: dict, path: Path, n_mtp: int, ctx_len: int | None) -> ModelConfig:
    """The ModelConfig of a Llama GGUF file's metadata (what `model_config_from_hf` takes, by GGUF's keys)."""
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        _refuse(path, "general.architecture", architecture, "only Llama-architecture files are supported")
    for key in ("embedding_length", "block_count", "attention.head_count", "feed_forward_length", "context_length"):
        if f"llama.{key}" not in meta:
            raise CheckpointError(f"{path} lacks the metadata key llama.{key}")
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{path} has no tokenizer (tokenizer.ggml.tokens): nanoeuler needs the model's own")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        _refuse(path, "llama.rope.scaling.type", scaling, "RoPE is unscaled")
    if meta.get("llama.rope.scale_linear", 1.0) != 1.0:
        _refuse(path, "llama.rope.scale_linear", meta["llama.rope.scale_linear"], "RoPE is unscaled")
    if meta.get("llama.expert_count", 0):
        _refuse(path, "llama.expert_count", meta["llama.expert_count"], "the feed-forward is dense")
    dim, n_heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    head_dim = dim // n_heads if isinstance(dim, int) and isinstance(n_heads, int) and n_heads > 0 else None
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = meta.get(f"llama.{key}", head_dim)
        if value != head_dim:
            _refuse(path, f"llama.{key}", value, f"every head has embedding_length / head_count = {head_dim} "
                                                 f"dims, all rotated")
    config = {
        "model_type": "llama", "vocab_size": len(meta["tokenizer.ggml.tokens"]), "hidden_size": dim,
        "num_hidden_layers": meta["llama.block_count"], "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", n_heads),
        "intermediate_size": meta["llama.feed_forward_length"],
        "max_position_embeddings": meta["llama.context_length"],
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        "rms_norm_eps": meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
    }
    return model_config_from_hf(config, path, n_mtp, ctx_len)


def quantized_matrix(kind: str, data: np.ndarray, shape: tuple[int, int]) -> tuple:
    """The Q8_0, Q4_0 or Q4_1 matrix `data` (its raw blocks) of shape (O, K) as (q, scale, zero) in
    nanoeuler's int8 or int4 format: the same nibbles, bytes and float16 scales and offsets (Q4_0's
    offset -8 * scale, exact in float16 but where it would pass 65504: ValueError, one line)."""
    O, K = shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(O, K // 32, -1)

    def half(at):   # a float16 of every block, at byte `at`
        return blocks[..., at:at + 2].copy().view(np.float16)[..., 0]

    d = half(0)
    if kind == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(O, K), d, np.zeros((O, 0), np.float16)
    if kind == "Q4_0":
        return quantized.half_scales(blocks[..., 2:].reshape(O, K // 2).copy(), d, -8.0 * d.astype(np.float32))
    return blocks[..., 4:].reshape(O, K // 2).copy(), d, half(2)


def _read_tensors(reader, gguf, cfg: ModelConfig, path: Path) -> tuple[dict, Counter, Counter]:
    """Every tensor in nanoeuler's layout: float32, or (q, scale, zero) for the quantized matrices
    kept as they are; and how many of each stored type were kept, and dequantized."""
    expected = cfg.param_shapes()
    params, kept, dequantized = {}, Counter(), Counter()
    for tensor in reader.tensors:
        ours = nanoeuler_name(tensor.name)
        if ours is None or ours not in expected:
            why = "RoPE is unscaled" if tensor.name == "rope_freqs.weight" else (
                "the model has no biases" if tensor.name.endswith(".bias") else "no such parameter in this Llama model")
            _refuse(path, "tensor", tensor.name, why)
        kind = tensor.tensor_type.name
        if kind not in _READ_TYPES:
            raise CheckpointError(f"{path}: tensor {tensor.name} is of type {kind}; nanoeuler reads "
                                  f"{', '.join(_READ_TYPES)}")
        ne = [int(n) for n in tensor.shape]  # GGML's order: the fastest-varying dimension first
        shape = expected[ours]
        if tuple(reversed(ne)) != shape:
            raise CheckpointError(f"{path}: tensor {tensor.name} has shape {ne} (GGML order), the metadata "
                                  f"implies {list(reversed(shape))}")
        if kind in _KEPT_TYPES and len(shape) == 2:
            try:
                arrays = quantized_matrix(kind, tensor.data, shape)
            except ValueError as exc:
                raise CheckpointError(f"{path}: tensor {tensor.name}: {exc}") from None
            kept[kind] += 1
        elif kind == "F32":
            arrays = (np.array(tensor.data, dtype=np.float32).reshape(shape),)
        else:
            arrays = (gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape),)
            dequantized[kind] += 1
        if ours.endswith(".wq") or ours.endswith(".wk"):   # the rows of each part
            heads = cfg.n_heads if ours.endswith(".wq") else cfg.n_kv_heads
            arrays = tuple(unpermute_rotary(a, heads) for a in arrays)
        params[ours] = arrays[0] if len(arrays) == 1 else arrays
    return params, kept, dequantized


def tokenizer_from_gguf(meta: dict, path: Path) -> HFTokenizer:
    """The byte-level BPE tokenizer a GGUF file describes, as the tokenizer.json it stands for."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        _refuse(path, "tokenizer.ggml.model", model, "only byte-level BPE tokenizers ('gpt2') are read")
    if pre not in _PRE_TOKENIZERS:
        _refuse(path, "tokenizer.ggml.pre", pre, f"the pre-tokenizers read are {', '.join(_PRE_TOKENIZERS)}")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    vocab = {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind not in (3, 4, 5)}
    added = [{"id": i, "content": token, "special": kind != 4, "normalized": False,
              "single_word": False, "lstrip": False, "rstrip": False}
             for i, (token, kind) in enumerate(zip(tokens, types)) if kind in (3, 4, 5)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    document = byte_level_document((), (), {})
    document["added_tokens"] = added
    document["pre_tokenizer"] = _PRE_TOKENIZERS[pre]
    document["model"] |= {"vocab": vocab, "merges": list(meta.get("tokenizer.ggml.merges") or []),
                          "ignore_merges": pre in _IGNORES_MERGES,
                          "unk_token": unk if unk in vocab else None}
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    if not isinstance(eos_id, int) or not 0 <= eos_id < len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.eos_token_id = {eos_id!r} names no token; nanoeuler needs "
                              f"an end-of-text token")
    try:
        tok = HFTokenizer(document, eos=tokens[eos_id], source=str(path))
        tok.eos_id
    except TokenizerError as exc:
        raise CheckpointError(str(exc)) from None
    return tok


def _chat_template(meta: dict, path: Path, log: Callable[[str], None]) -> ChatTemplate | None:
    """tokenizer.chat_template, rendered with the file's special tokens; None if it has none."""
    source = meta.get("tokenizer.chat_template")
    if source is None:
        return None
    tokens = meta["tokenizer.ggml.tokens"]
    names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    special = {ours: tokens[i] for key, ours in names.items()
               if isinstance(i := meta.get(f"tokenizer.ggml.{key}_token_id"), int) and 0 <= i < len(tokens)}
    try:
        return ChatTemplate(source, special, name=f"the chat template of {path}")
    except TemplateError as exc:
        log(f"warning: the chat template is not carried over ({exc}); chat with the run needs --template")
        return None


def import_gguf(path: Path, out_dir: Path, n_mtp: int | None = None, ctx_len: int | None = None,
                log: Callable[[str], None] = print) -> Path:
    """Write the Llama GGUF file `path` as a run directory `out_dir`; returns it.

    `n_mtp` heads (default 1; heads 1..K-1 start as copies of head 0); `ctx_len` caps the context
    (default: llama.context_length).
    """
    path, out_dir = Path(path), Path(out_dir)
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading .gguf files needs the gguf package: pip install 'nanoeuler[gguf]'") from None
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    check_import_options(out_dir, n_mtp, ctx_len)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError) as exc:
        raise CheckpointError(f"{path} is not a valid GGUF file ({exc})") from None
    meta = _metadata(reader, gguf)
    n_mtp = n_mtp or 1
    cfg = model_config_from_gguf(meta, path, n_mtp, ctx_len)
    tok = tokenizer_from_gguf(meta, path)
    template = _chat_template(meta, path, log)

    params, kept, dequantized = _read_tensors(reader, gguf, cfg, path)
    # no output.weight: head 0 is token_embd.weight (GGUF's metadata says nothing of it; the tensors do)
    tied = "heads.0" not in params and "tok_emb" in params
    if tied:
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    for j in range(1, n_mtp):
        params[f"heads.{j}"] = params.get(cfg.head_names()[0])
    missing = [gguf_name(n) for n in cfg.param_shapes() if params.get(n) is None]
    if missing:
        raise CheckpointError(f"{path}: the file lacks tensor {missing[0]}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))

    tensors = {}
    for name in cfg.param_shapes():
        value = params[name]
        tensors |= {f"{name}.{part}": a for part, a in zip(QUANTIZED_PARTS, value)} if isinstance(value, tuple) \
            else {name: value}
    write_imported_run(out_dir, cfg, tensors, tok, template, path)
    if kept:
        log("kept quantized, in the int8 and int4 formats decoding reads: "
            + ", ".join(f"{n} {kind} ({_KEPT_TYPES[kind]})" for kind, n in sorted(kept.items())) + " tensors")
    if dequantized:
        log("dequantized to float32: " + ", ".join(f"{n} {kind}" for kind, n in sorted(dequantized.items()))
            + " tensors")
    if tied:
        log("the file ties its embeddings and head (no output.weight): so does the run, head 0 reads tok_emb")
    log(f"imported {path} ({cfg.n_params():,} parameters, {cfg.n_layers} layers, vocab {cfg.vocab_size}, "
        f"context {cfg.ctx_len}, {n_mtp} head(s)" + (f", heads 1..{n_mtp - 1} copied from head 0" if n_mtp > 1 else "")
        + f") to {out_dir}" + (f"; chats in its own template ({template.name})" if template else ""))
    if tok.missing_bytes:
        log(f"its tokenizer has no token for {len(tok.missing_bytes)} bytes: text loses them when encoded")
    return out_dir
