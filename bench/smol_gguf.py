"""Llama GGUF files of SmolLM2-135M's shape with random weights, for timing decoding where the real
file is not at hand (the speed of a step does not depend on the weights' values):

    OUT_DIR/smol-q4_1.gguf   Q4_1 block matrices, a Q8_0 token_embd (SmolLM2-135M-Instruct's Q4_1 layout)
    OUT_DIR/smol-q8_0.gguf   Q8_0 matrices

with F32 norms, tied embeddings (no output.weight) and a byte-level BPE tokenizer that llama.cpp and
`nanoeuler-run import` both read: the 256 byte tokens, then the merges of byte pairs (printable
ASCII pairs first) up to the vocabulary's size, then three control tokens. Seeded: the same bytes
every time.

    python bench/smol_gguf.py OUT_DIR [--shape tiny]   # tiny: a few-layer model for a quick check
"""

import argparse
from pathlib import Path

import gguf
import numpy as np

from nanoeuler_core.text.hf_json import byte_level_spelling

Q = gguf.GGMLQuantizationType
SHAPES = {   # SmolLM2-135M's, and a small one
    "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab=49152, ctx=8192,
                         rope_theta=100000.0),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab=1024, ctx=512,
                 rope_theta=100000.0),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# file name -> (the blocks' matrices, token_embd, GGUF's file type)
VARIANTS = {"smol-q4_1.gguf": (Q.Q4_1, Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q4_1),
            "smol-q8_0.gguf": (Q.Q8_0, Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}


def byte_pair_vocabulary(size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges): the byte-level spellings of the 256 bytes, then of byte pairs, printable
    ASCII pairs first, each made by its merge, up to `size` - len(SPECIALS) tokens."""
    spell = [byte_level_spelling(bytes([b])) for b in range(256)]
    n_pairs = size - 256 - len(SPECIALS)
    printable = range(32, 127)
    pairs = sorted(((a, b) for a in range(256) for b in range(256)),
                   key=lambda p: (not (p[0] in printable and p[1] in printable), p))[:n_pairs]
    return spell + [spell[a] + spell[b] for a, b in pairs], [f"{spell[a]} {spell[b]}" for a, b in pairs]


def random_tensors(shape: dict, seed: int):
    """(GGUF name, float32 weights) of a Llama of `shape`, norms at 1, matrices N(0, 0.02)."""
    rng = np.random.default_rng(seed)
    C, H, D = shape["dim"], shape["hidden_dim"], shape["dim"] // shape["n_heads"]
    kv = shape["n_kv_heads"] * D

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02))

    yield "token_embd.weight", matrix(shape["vocab"], C)
    for i in range(shape["n_layers"]):
        yield f"blk.{i}.attn_norm.weight", np.ones(C, np.float32)
        for name, rows, cols in (("attn_q", C, C), ("attn_k", kv, C), ("attn_v", kv, C), ("attn_output", C, C),
                                 ("ffn_gate", H, C), ("ffn_up", H, C), ("ffn_down", C, H)):
            yield f"blk.{i}.{name}.weight", matrix(rows, cols)
        yield f"blk.{i}.ffn_norm.weight", np.ones(C, np.float32)
    yield "output_norm.weight", np.ones(C, np.float32)


def open_writer(path: Path, shape: dict, file_type, tokens: list[str], merges: list[str]) -> gguf.GGUFWriter:
    """A writer for `path` with the Llama metadata of `shape` and the tokenizer, as llama.cpp's
    converter writes them."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random weights, SmolLM2-135M's layout ({file_type.name})")
    writer.add_file_type(file_type)
    writer.add_block_count(shape["n_layers"])
    writer.add_context_length(shape["ctx"])
    writer.add_embedding_length(shape["dim"])
    writer.add_feed_forward_length(shape["hidden_dim"])
    writer.add_head_count(shape["n_heads"])
    writer.add_head_count_kv(shape["n_kv_heads"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape["dim"] // shape["n_heads"])
    writer.add_vocab_size(shape["vocab"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens + SPECIALS)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(SPECIALS))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens))
    writer.add_eos_token_id(len(tokens))
    writer.add_add_bos_token(False)
    return writer


def write_variants(out_dir: Path, shape: dict, seed: int = 0) -> list[Path]:
    """Every file of VARIANTS in `out_dir`, from the same random weights."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens, merges = byte_pair_vocabulary(shape["vocab"])
    paths = [out_dir / name for name in VARIANTS]
    writers = [open_writer(path, shape, file_type, tokens, merges)
               for path, (_, _, file_type) in zip(paths, VARIANTS.values())]
    for name, w in random_tensors(shape, seed):
        for writer, (matrices, embedding, _) in zip(writers, VARIANTS.values()):
            kind = Q.F32 if w.ndim == 1 else embedding if name == "token_embd.weight" else matrices
            data = w if kind == Q.F32 else gguf.quants.quantize(w, kind)
            writer.add_tensor(name, data, raw_dtype=None if kind == Q.F32 else kind)
    for writer in writers:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write_variants(args.out_dir, SHAPES[args.shape], args.seed):
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
