"""Hugging Face interoperability (docs/files.md): a run directory as a `transformers` Llama
directory, and a local Llama checkpoint directory as a run directory.

A nanoeuler model is a Llama model plus K - 1 extra multi-token-prediction heads:

    nanoeuler                 transformers
    tok_emb                   model.embed_tokens.weight
    layers.{i}.attn_norm      model.layers.{i}.input_layernorm.weight
    layers.{i}.wq/wk/wv/wo    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.ffn_norm       model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.w_gate/up/down model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm                      model.norm.weight
    heads.0                   lm_head.weight (none in a tied model: head 0 reads tok_emb, and
                              config.json says tie_word_embeddings, as transformers writes it)
    heads.{j}, j >= 1         mtp_heads.safetensors, under their own names, beside the model

An export holds config.json, model.safetensors, mtp_heads.safetensors, generation_config.json,
tokenizer.json and tokenizer_config.json (end-of-text token, and for runs with a chat template a
Jinja `chat_template` rendering exactly the prompt `chat` builds: Alpaca for runs fine-tuned by
nanoeuler with it, else the run's own). `transformers` loads it with AutoModelForCausalLM /
AutoTokenizer; importing it back restores every head.

An import reads config.json, model.safetensors or the shards named by
model.safetensors.index.json (float32, float16 or bfloat16; stored as float32), tokenizer.json
and tokenizer_config.json, whose `chat_template` (or a chat_template.jinja) and special tokens
come along into the run's tokenizer_config.json, so that `chat` talks in the model's own template.
What the engine cannot represent (biases, another activation, RoPE scaling, a vocabulary above
65,536, ...) is refused in one line naming the field. A checkpoint
without MTP heads gets n_mtp = 1 unless asked for more; heads 1..K-1 then start as copies of
head 0, so every head starts from the model's own next-token prediction instead of noise.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import orjson

from nanoeuler_core.corpus.tokens import MAX_VOCAB
from nanoeuler_core.engine import checkpoint
from nanoeuler_core.engine.checkpoint import FORMAT, CheckpointError
from nanoeuler_core.engine.config import ModelConfig
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.template import ChatTemplate
from nanoeuler_core.text.hf_json import configured_eos
from nanoeuler_core.text.hf_tokenizer import HFTokenizer
from nanoeuler_core.text.tokenizer import Tokenizer
from nanoeuler_core.training.pretrain import TrainConfig

MTP_FILE = "mtp_heads.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
_LAYER_NAME_OF = {hf: ours for ours, hf in _LAYER_NAMES.items()}


def hf_name(name: str) -> str | None:
    """The transformers name of parameter `name` (docs/model.md); None for heads 1..K-1."""
    if name == "tok_emb":
        return "model.embed_tokens.weight"
    if name == "norm":
        return "model.norm.weight"
    if name == "heads.0":
        return "lm_head.weight"
    if name.startswith("heads."):
        return None
    _, i, field = name.split(".")
    return f"model.layers.{i}.{_LAYER_NAMES[field]}.weight"


def nanoeuler_name(hf: str) -> str | None:
    """The nanoeuler name of transformers tensor `hf`, or None if it has none."""
    fixed = {"model.embed_tokens.weight": "tok_emb", "model.norm.weight": "norm", "lm_head.weight": "heads.0"}
    if hf in fixed:
        return fixed[hf]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf)
    if match and match.group(2) in _LAYER_NAME_OF:
        return f"layers.{match.group(1)}.{_LAYER_NAME_OF[match.group(2)]}"
    return None


# ------------------------------------------------------------------------------------------------
# export


def export_run(run_dir: Path, out_dir: Path, log: Callable[[str], None] = print) -> Path:
    """Write the run in `run_dir` as a Hugging Face Llama directory `out_dir`; returns it."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if (out_dir / "config.json").exists():
        raise ValueError(f"{out_dir} already holds a model: choose another output directory")
    model, tok = load_model(run_dir)
    cfg = model.cfg
    training = checkpoint.read_json(run_dir / "config.json").get("training", {})
    eos_id = tok.eos_id
    eos = tok.token_bytes(eos_id).decode("utf-8", "replace")
    params = model.params

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.ctx_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        # No beginning-of-text token: generation from nothing starts at the end-of-text one, as `generate` does.
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "nanoeuler": {"format": FORMAT, "n_mtp": cfg.n_mtp, "mtp_heads": MTP_FILE if cfg.n_mtp > 1 else None,
                      "training": training},
    }
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": True,
                  "temperature": 0.8, "top_k": 40, "max_length": cfg.ctx_len}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": eos,
        "pad_token": eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.ctx_len,
    }
    template = ChatTemplate.for_run(run_dir)
    if template is not None:  # the special tokens it renders with, and itself
        tokenizer_config |= {**template.special_tokens, "chat_template": template.source}

    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.save_tensors(out_dir / "model.safetensors",
                            {hf_name(n): t for n, t in params.items() if hf_name(n) is not None}, {"format": "pt"})
    if cfg.n_mtp > 1:
        checkpoint.save_tensors(out_dir / MTP_FILE, {f"heads.{j}": params[f"heads.{j}"] for j in range(1, cfg.n_mtp)})
    tok.save(out_dir / "tokenizer.json")
    checkpoint.write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    checkpoint.write_json(out_dir / "generation_config.json", generation)
    checkpoint.write_json(out_dir / "config.json", config)  # last: its presence marks a complete export
    log(f"exported {run_dir} ({cfg.n_params():,} parameters, {cfg.n_mtp} head(s)) to {out_dir}"
        + (f"; chat template: {template.name}" if template else "; no chat template (a pretrained run)"))
    return out_dir


# ------------------------------------------------------------------------------------------------
# import


def _refuse(path: Path, field: str, value, why: str):
    raise CheckpointError(f"{path}: {field} = {value!r}: {why}; nanoeuler cannot represent it")


def model_config_from_hf(config: dict, path: Path, n_mtp: int, ctx_len: int | None) -> ModelConfig:
    """The ModelConfig of a transformers Llama config.json (tied embeddings stay tied)."""
    def get(field, default=None):
        return config.get(field, default)

    if get("model_type") != "llama":
        _refuse(path, "model_type", get("model_type"), "only Llama-architecture checkpoints are supported")
    if get("hidden_act", "silu") != "silu":
        _refuse(path, "hidden_act", get("hidden_act"), "the feed-forward is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if get(field):
            _refuse(path, field, get(field), "the model has no biases")
    for field in ("quantization_config", "sliding_window"):
        if get(field) is not None:
            _refuse(path, field, get(field), "not supported")
    if get("rope_scaling") is not None:
        _refuse(path, "rope_scaling", get("rope_scaling"), "RoPE is unscaled")
    rope = get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        _refuse(path, "rope_parameters.rope_type", rope.get("rope_type"), "RoPE is unscaled")
    vocab_size = get("vocab_size")
    if isinstance(vocab_size, int) and vocab_size > MAX_VOCAB:
        _refuse(path, "vocab_size", vocab_size, f"token ids are 16-bit (at most {MAX_VOCAB:,})")
    dim, n_heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim")
    if head_dim is not None and isinstance(dim, int) and isinstance(n_heads, int) and head_dim * n_heads != dim:
        _refuse(path, "head_dim", head_dim, f"a head has hidden_size / num_attention_heads = {dim // n_heads} dims")
    positions = get("max_position_embeddings")
    try:
        cfg = ModelConfig(
            vocab_size=vocab_size, dim=dim, n_layers=get("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=get("num_key_value_heads", n_heads), hidden_dim=get("intermediate_size"),
            ctx_len=min(positions, ctx_len) if ctx_len and isinstance(positions, int) else positions,
            n_mtp=n_mtp, tie_embeddings=bool(get("tie_word_embeddings", False)),
            rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
            norm_eps=float(get("rms_norm_eps", 1e-6)))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return cfg


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (F32, F16, BF16 and F64 are read)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        header_size = int(data[:8].view("<u8")[0])
        header = orjson.loads(bytes(data[8 : 8 + header_size]))
        body = data[8 + header_size :]
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            shape, dtype = tuple(info["shape"]), info["dtype"]
            if not 0 <= start <= end <= body.size:
                raise ValueError(f"tensor {name} lies past the end of the file")
            raw = body[start:end]
            if dtype == "BF16":
                array = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
            elif dtype in ("F32", "F16", "F64"):
                array = raw.view({"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype]).astype(np.float32)
            else:
                raise ValueError(f"tensor {name} has dtype {dtype}, not a float type")
            tensors[name] = array.reshape(shape)
        return tensors
    except (ValueError, KeyError, TypeError, IndexError, orjson.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not a valid safetensors file ({exc})") from None


def read_hf_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    """The tensors of a transformers checkpoint: model.safetensors, or the shards its index names."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map = checkpoint.read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            tensors |= read_safetensors(hf_dir / shard)
        return tensors
    if not (hf_dir / "model.safetensors").is_file():
        raise CheckpointError(f"{hf_dir} has neither model.safetensors nor {INDEX_FILE} "
                              f"(PyTorch .bin checkpoints are not read: save with safetensors)")
    return read_safetensors(hf_dir / "model.safetensors")


def _params_from_hf(tensors: dict[str, np.ndarray], source: Path) -> dict[str, np.ndarray]:
    params = {}
    for name, tensor in tensors.items():
        ours = nanoeuler_name(name)
        if ours is None:
            if name.endswith("rotary_emb.inv_freq"):  # older checkpoints store RoPE's frequencies; recomputed
                continue
            why = "the model has no biases" if name.endswith(".bias") else "no such parameter in a Llama model"
            _refuse(source, "tensor", name, why)
        params[ours] = tensor
    return params


def import_checkpoint(hf_dir: Path, out_dir: Path, n_mtp: int | None = None, ctx_len: int | None = None,
                      log: Callable[[str], None] = print) -> Path:
    """Write the Llama checkpoint directory `hf_dir` as a run directory `out_dir`; returns it.

    `n_mtp` heads (default: those the checkpoint holds, 1 for a plain Llama; missing heads start as
    copies of head 0); `ctx_len` caps the context (default: max_position_embeddings).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} is not a directory")
    check_import_options(out_dir, n_mtp, ctx_len)
    config = checkpoint.read_json(hf_dir / "config.json")
    saved = config.get("nanoeuler") or {}
    mtp_file = hf_dir / MTP_FILE
    extra_heads = checkpoint.load_tensors(mtp_file)[0] if mtp_file.is_file() else {}
    n_mtp = n_mtp or max(1, int(saved.get("n_mtp") or 1), len(extra_heads) + 1)
    cfg = model_config_from_hf(config, hf_dir / "config.json", n_mtp, ctx_len)

    tok = _import_tokenizer(hf_dir, config)
    if tok.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{hf_dir}: config.json has vocab_size {cfg.vocab_size} but tokenizer.json has "
                              f"{tok.vocab_size} entries; nanoeuler needs them equal")

    # a tied checkpoint's lm_head.weight, where one is stored, is embed_tokens again: transformers ignores it too
    params = _params_from_hf(read_hf_weights(hf_dir), hf_dir)
    for j in range(1, n_mtp):
        params[f"heads.{j}"] = extra_heads.get(f"heads.{j}", params.get(cfg.head_names()[0]))
    expected = cfg.param_shapes()
    missing = [hf_name(n) or n for n in expected if params.get(n) is None]
    if missing:
        raise CheckpointError(f"{hf_dir}: the checkpoint lacks {missing[0]}"
                              + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""))
    for name, shape in expected.items():
        if params[name].shape != shape:
            raise CheckpointError(f"{hf_dir}: {hf_name(name) or name} has shape {params[name].shape}, "
                                  f"config.json implies {shape}")

    try:
        template = ChatTemplate.from_folder(hf_dir)
    except ValueError as exc:  # transformers, too, loads such a tokenizer, and fails only when it chats
        log(f"warning: the chat template is not carried over ({exc}); chat with the run needs --template")
        template = None

    write_imported_run(out_dir, cfg, {name: params[name] for name in expected}, tok, template, hf_dir)
    log(f"imported {hf_dir} ({cfg.n_params():,} parameters, {cfg.n_layers} layers, vocab {cfg.vocab_size}, "
        f"context {cfg.ctx_len}, {n_mtp} head(s)"
        + (f", heads 1..{n_mtp - 1} copied from head 0" if n_mtp > len(extra_heads) + 1 else "")
        + f") to {out_dir}" + (f"; chats in its own template ({template.name})" if template else ""))
    if tok.missing_bytes:
        log(f"its tokenizer has no token for {len(tok.missing_bytes)} bytes "
            f"({', '.join(f'0x{b:02x}' for b in tok.missing_bytes)}): text loses them when encoded, as in "
            f"Hugging Face tokenizers")
    return out_dir


def check_import_options(out_dir: Path, n_mtp: int | None, ctx_len: int | None) -> None:
    """Refuse an output directory that already holds a run, and fewer than one head or position."""
    if (out_dir / "config.json").exists():
        raise ValueError(f"{out_dir} already holds a run: choose another output directory")
    if n_mtp is not None and n_mtp < 1:
        raise ValueError(f"--n-mtp must be at least 1, got {n_mtp}")
    if ctx_len is not None and ctx_len < 1:
        raise ValueError(f"--ctx-len must be at least 1, got {ctx_len}")


def write_imported_run(out_dir: Path, cfg: ModelConfig, params: dict[str, np.ndarray], tok, template,
                       source: Path) -> None:
    """The run directory of an imported model: tokenizer (and chat template), the tensors of
    model.safetensors (`params`: each parameter, or a quantized matrix's parts), config.json last."""
    # Continued pretraining (`pretrain --resume`) starts at step 0 with fresh AdamW moments and the
    # settings of the larger preset (peak lr 3e-4); sft and dpo take their own.
    training = {**asdict(TrainConfig(preset="gpu", steps=1000)), "imported_from": str(source)}
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(out_dir / "tokenizer.json")  # with tokenizer_config.json naming its end-of-text token
    if template is not None:
        template.save(out_dir)
    checkpoint.save_tensors(out_dir / "model.safetensors", params)
    checkpoint.write_json(out_dir / "config.json", {"format": FORMAT, **cfg.to_dict(), "training": training})


def _import_tokenizer(hf_dir: Path, config: dict) -> Tokenizer | HFTokenizer:
    """tokenizer.json with its end-of-text token: tokenizer_config.json's eos_token, else config.json's eos_token_id."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{hf_dir} has no tokenizer.json (nanoeuler needs the tokenizer in the Hugging Face "
                              f"tokenizers format)")
    tok = Tokenizer.load(path)
    eos_id = config.get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    if configured_eos(hf_dir) is None and isinstance(eos_id, int) and 0 <= eos_id < tok.vocab_size:
        tok = Tokenizer.load(path, eos=tok.token_bytes(eos_id).decode("utf-8", "replace"))
    try:
        tok.eos_id
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return tok
