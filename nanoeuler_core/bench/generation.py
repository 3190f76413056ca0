"""Decoding speed: nanoeuler's plain, self-speculative and default (the policy that chooses per
step, docs/decoding.md) decoding against PyTorch and Hugging Face transformers on the same weights,
each with a KV cache, in one run.

nanoeuler's three modes share one process, a decoder each on the same weights, and take turns: a
round times one generation of each, so that the machine's drift (clocks, other work) falls on every
mode alike and their ratios compare like with like, and each round starts one mode further on, so
that no mode always runs right after the same other one (a heavy forced-speculative run may leave
the clocks lower for whichever comes next); a mode's memory is the model's plus what its decoder
added (on a CPU, the growth of the peak resident set: the first mode's includes compiling). Each
peer runs in its own process (separate thread pools, compilation caches and peak memory): PyTorch
eager with a static KV cache, and on a GPU PyTorch with torch.compile(mode="reduce-overhead"): the
static cache and one decoding step captured as a CUDA graph, as gpt-fast does; and for a run
directory, transformers' own `generate` (its dynamic KV cache) on the run exported to a temporary
transformers directory, as its users decode. nanoeuler reads bf16 or float32 weights (`weights`;
default bf16 where the backend runs it), accumulating in float32; PyTorch is float32 (TF32 off),
transformers too except where nanoeuler decodes bf16 by default (a GPU): there it runs bf16 unless
nanoeuler reads float32. Greedy by default (the peers run only then), on one CPU thread for every
engine on a CPU, the same prompt for every row; the ratio line compares nanoeuler's best mode with
the strongest peer. A run is a full generation (prefill + new tokens) of `tokens` new tokens per
row; tokens/s is rows x tokens over its wall time, the median of `repeats` runs (rounds, for
nanoeuler) after one warm-up (compilation, graph capture, and the policy's step timings). Prefill is
timed apart, on a longer prompt of `prefill` tokens per row: a generation of one token (nanoeuler
plain) and the prefill call (the peers), rows x prompt tokens over the median time. The speculative
speed-up needs trained weights (a random model's heads agree with nothing): pass a run directory;
its prompts come from the corpus it trained on. The memory bandwidth plain decoding achieves is the
bytes a step reads (`plain_step_bytes`) over its time, against the card's where it is known.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from nanoeuler_core.bench.measure import memory_mb, run_worker

MODULE = "nanoeuler_core.bench.generation"
PEAK_GB_PER_S = {"H100": 3350.0, "H200": 4800.0}   # the cards' memory bandwidth (H100 SXM HBM3, H200 HBM3e)


def plain_step_bytes(cfg, weights: str, matrix_bytes: int, batch_size: int, position: float) -> float:
    """Bytes a plain decoding step of `batch_size` rows at `position` reads from memory: the blocks'
    matrices and head 0 (`matrix_bytes`, as the decoder stores them), the blocks' norm scales (bf16
    with "bf16" weights, else float32), the final norm and the rows' embeddings in float32, and each
    row's cached keys and values up to `position` (float32)."""
    C, L, D, KV = cfg.dim, cfg.n_layers, cfg.head_dim, cfg.n_kv_heads
    norm_bytes = (2 if weights == "bf16" else 4) * L * 2 * C + 4 * C * (1 + batch_size)
    return matrix_bytes + norm_bytes + 4 * batch_size * L * 2 * KV * D * (position + 1)


def load_weights(preset: str, run: str | None, backend: str):
    """The model (from the run directory, else the preset with seed 0) and a tokenizer or None."""
    from nanoeuler_core import Model, ModelConfig

    if run is None:
        return Model(ModelConfig.preset(preset), backend=backend, seed=0), None
    from nanoeuler_core.inference.loading import load_model

    return load_model(run, backend)


PROMPT_SOURCES = ("held-out", "training")


def run_corpus(run: str | None) -> Path:
    """The corpus a run trained on, as its config records it; the bundled one where it records none
    (or for no run)."""
    from nanoeuler_core.corpus.tokens import default_corpus
    from nanoeuler_core.engine.checkpoint import read_json

    recorded = read_json(Path(run) / "config.json").get("training", {}).get("corpus") if run else None
    return Path(recorded) if recorded else default_corpus()


def bench_prompt(cfg, tok, length: int, source: str = "held-out", run: str | None = None) -> list[int]:
    """`length` tokens of the run's corpus (run_corpus) when there is a tokenizer, else random ids: from
    its end ("held-out": the validation split, text a run does not train on) or from its first
    paragraph ("training": text a run has seen, which a model that fits its corpus predicts well)."""
    if tok is None:
        return np.random.default_rng(0).integers(0, cfg.vocab_size, length).tolist()
    text = run_corpus(run).read_text(encoding="utf-8")
    start = text.index("\n\n", int(len(text) * 0.95)) + 2 if source == "held-out" else 0
    return tok.encode(text[start:start + 40 * length])[:length]


def worker_nanoeuler(preset, run, backend, batch_size, prompt, tokens, repeats, temperature, modes,
                     weights, prefill=0, prompt_from="held-out") -> list[dict]:
    """nanoeuler's decoding in each of `modes` (False plain, True speculative, None the policy), a decoder
    each, warmed up, then `repeats` rounds that each time one generation of every mode in turn (round r
    starting at mode r mod the modes); the first mode's decoder also times the prefill of `prefill`
    tokens (if any). A dict per mode."""
    from nanoeuler_core.inference.decoder import DecodeStats, Sampling, decoder_for

    model, tok = load_weights(preset, run, backend)
    ids = bench_prompt(model.cfg, tok, prompt, prompt_from, run)
    seeds = list(range(batch_size))
    base_mb = memory_mb(model.backend)
    engines = []
    for speculative in modes:
        before_mb = memory_mb(model.backend)
        decoder = decoder_for(model, batch_size, speculative, Sampling(temperature), weights)
        out = decoder.generate([ids] * batch_size, tokens, seeds)   # warm-up: compilation, graph capture
        engines.append(SimpleNamespace(decoder=decoder, tokens=out[0], stats=DecodeStats(), times=[],
                                       memory_mb=base_mb + memory_mb(model.backend) - before_mb))
    for r in range(repeats):
        for e in engines[r % len(engines):] + engines[:r % len(engines)]:
            e.times += _timed(lambda: e.decoder.generate([ids] * batch_size, tokens, seeds, stats=e.stats), 1)
    prefill_s = None
    if prefill:   # one new token: the prefill and the first token
        long = [bench_prompt(model.cfg, tok, prefill, run=run)] * batch_size
        first = engines[0].decoder
        first.generate(long, 1, seeds)
        prefill_s = statistics.median(_timed(lambda: first.generate(long, 1, seeds), repeats))
    return [{"median_s": statistics.median(e.times), "memory_mb": e.memory_mb, "tokens": e.tokens,
             "acceptance": e.stats.acceptance, "per_step": e.stats.tokens_per_step, "mode": e.stats.mode,
             "kept_where_reached": [k / o if o else None
                                    for k, o in zip(e.decoder.policy.kept.tolist(), e.decoder.policy.offered.tolist())],
             "speculative_steps": e.stats.speculative_steps / e.stats.steps if e.stats.steps else 0.0,
             "weights": e.stats.weights, "matrix_bytes": e.decoder.forward.w.nbytes(),
             "prefill_s": prefill_s if i == 0 else None}
            for i, e in enumerate(engines)]


def _kept_line(rates: list) -> str:
    """Proposal j's rate of being kept where proposals 1..j-1 were (over the decoder's life, warm-up
    included): where a model's extra heads stop agreeing with head 0."""
    shown = [f"{rate:.0%}" if rate is not None else "-" for rate in rates]
    return f"; proposals 1..{len(rates)} kept where reached: {', '.join(shown)}" if any(r is not None for r in rates) \
        else ""


def _timed(fn, repeats: int, sync=lambda: None) -> list[float]:
    """Wall seconds of each of `repeats` calls of fn."""
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return times


def _peer_device(backend: str) -> str:
    """The device a PyTorch peer runs on, with torch set as every peer runs: float32 products
    without TF32, and one thread on a CPU."""
    import torch

    from nanoeuler_core import registry

    device = registry.backend(backend).peer_device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)   # as nanoeuler's decoding: one token's ops are too small to share out
    return device


def _peer_figures(generate, prefill_once, repeats: int, device: str, warm_ups: int = 1) -> dict:
    """A peer's row: its greedy tokens (row 0 of the last of `warm_ups` calls of generate), the
    median of `repeats` timed generations, the median of `repeats` timed prefill_once calls after
    one warm-up (if prefill_once), and its memory."""
    from nanoeuler_core.bench import torch_peer

    def sync():
        torch_peer.synchronize(device)

    for _ in range(warm_ups):
        tokens = generate()
    times = _timed(generate, repeats, sync)
    prefill_s = None
    if prefill_once is not None:
        prefill_once()
        prefill_s = statistics.median(_timed(prefill_once, repeats, sync))
    return {"median_s": statistics.median(times), "memory_mb": torch_peer.peer_memory_mb(device),
            "tokens": tokens[0].tolist(), "prefill_s": prefill_s}


def worker_torch(preset, run, backend, batch_size, prompt, tokens, repeats, compile, prefill=0,
                 prompt_from="held-out") -> dict:
    import torch

    from nanoeuler_core.bench.torch_peer import TorchModel

    device = _peer_device(backend)
    model, tok = load_weights(preset, run, "cpu")
    ids = bench_prompt(model.cfg, tok, prompt, prompt_from, run)
    peer = TorchModel(model.cfg, device=device).load(model.params).to(device)
    long = bench_prompt(model.cfg, tok, prefill, run=run) if prefill else []
    peer.setup_cache(batch_size, max(len(ids) + tokens, len(long)))
    step = torch.compile(peer.next_token, mode="reduce-overhead", fullgraph=True) if compile else peer.next_token

    @torch.no_grad()
    def generate_greedy():
        start = torch.tensor([ids] * batch_size, device=device)
        token = peer.next_token(start, torch.arange(len(ids), device=device))   # the prefill, eager
        out = [token]
        position = torch.tensor([len(ids)], device=device)
        for _ in range(tokens - 1):   # as gpt-fast: tokens and position stay on the device
            token = step(token, position).clone()
            position += 1
            out.append(token)
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def prefill_once():
        peer.next_token(torch.tensor([long] * batch_size, device=device), torch.arange(len(long), device=device))

    # a second warm-up: CUDA graphs are recorded on a later call
    return _peer_figures(generate_greedy, prefill_once if long else None, repeats, device, warm_ups=2) \
        | {"torch": torch.__version__}


def worker_export(run, hf_dir) -> dict:
    """The run written as a transformers directory `hf_dir` (nanoeuler_core.interop.hf)."""
    from nanoeuler_core.interop.hf import export_run

    export_run(Path(run), Path(hf_dir), log=lambda line: None)
    return {"hf_dir": hf_dir}


def worker_transformers(run, backend, batch_size, prompt, tokens, repeats, hf_dir, dtype, prefill=0,
                        prompt_from="held-out") -> dict:
    """Hugging Face transformers' `generate` on the run exported to `hf_dir`, in `dtype` (a torch
    dtype's name), greedy with its default (dynamic) KV cache, as its users decode."""
    import torch
    import transformers

    from nanoeuler_core.text.tokenizer import Tokenizer

    device = _peer_device(backend)
    tok = Tokenizer.load(Path(run) / "tokenizer.json")
    ids = bench_prompt(None, tok, prompt, prompt_from, run)
    long = bench_prompt(None, tok, prefill, run=run) if prefill else []
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
    # greedy, with no end-of-text token to stop at: exactly `tokens` new tokens, as every engine here decodes
    model.generation_config = transformers.GenerationConfig(do_sample=False)
    start = torch.tensor([ids] * batch_size, device=device)

    def generate_greedy():
        return model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=tokens)[:, len(ids):]

    @torch.no_grad()
    def prefill_once():   # as generate's first step: the prompt into a fresh cache, the last position's logits
        model(torch.tensor([long] * batch_size, device=device), logits_to_keep=1)

    return _peer_figures(generate_greedy, prefill_once if long else None, repeats, device) \
        | {"transformers": transformers.__version__}


def transformers_rows(common: dict, weights: str | None, prefill: int, echo) -> dict:
    """The transformers peer's row, {name: its figures}, on the run exported to a temporary
    transformers directory; none, with a line saying so, where transformers is not installed.

    It runs for every run, whatever its heads: the export holds head 0, so transformers decodes
    as nanoeuler's plain mode does, and for an imported model (one head, plain decoding only) it
    is the tool its users run today."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("transformers") is None:
        echo("transformers is not installed: no transformers peer (pip install 'nanoeuler[hf]')")
        return {}
    from nanoeuler_core.inference.decoder.weights import weights_on

    # bf16 where nanoeuler decodes bf16 by default (a GPU) unless it was asked for float32, as users run it there
    dtype = "bfloat16" if weights_on(common["backend"]) == "bf16" and weights != "fp32" else "float32"
    args = {k: v for k, v in common.items() if k != "preset"}
    with tempfile.TemporaryDirectory() as folder:
        # in a process of its own: on Linux a process starts with its parent's peak resident set, so
        # a run loaded here would count in the peer's memory
        exported = run_worker({"engine": "export", "run": common["run"], "hf_dir": str(Path(folder) / "hf")}, MODULE)
        row = exported and run_worker({**args, "engine": "transformers", "hf_dir": exported["hf_dir"], "dtype": dtype,
                                       "prefill": prefill}, MODULE)
    return {f"transformers generate, {dtype}": row}


def _agreement(tokens: list[int], reference: list[int]) -> str:
    """How many leading tokens two greedy decodings share (float32 sums in other orders may part on near-ties)."""
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return f"{same}/{len(reference)}"


def run(preset: str = "small", backend: str = "cpu", run_dir: str | None = None, batch_size: int = 1,
        prompt: int = 16, tokens: int = 256, repeats: int = 3, temperature: float = 0.0, peers: bool = True,
        weights: str | None = None, prefill: int = 512, prompt_from: str = "held-out", echo=print) -> dict:
    """Measure every engine, print a table, return the numbers."""
    from nanoeuler_core import ModelConfig, registry

    be = registry.backend(backend)
    cfg = ModelConfig.preset(preset) if run_dir is None else None
    if cfg is None:
        from nanoeuler_core.engine.checkpoint import read_json

        config = read_json(Path(run_dir) / "config.json")
        cfg = ModelConfig.from_dict({k: v for k, v in config.items() if k not in ("format", "training")})
    if prompt + tokens > cfg.ctx_len:
        tokens = cfg.ctx_len - prompt
        echo(f"(new tokens capped at {tokens}: the prompt and the new tokens fit the context of {cfg.ctx_len})")
    if prefill > cfg.ctx_len - 1:
        prefill = cfg.ctx_len - 1
        echo(f"(prefill prompt capped at {prefill} tokens: it and one new token fit the context of {cfg.ctx_len})")
    machine = be.device_name()
    source = f"weights of {run_dir}" if run_dir else "random weights (seed 0)"
    mode = "greedy" if temperature == 0 else f"temperature {temperature}"
    echo(f"decoding, {cfg.n_params():,} parameters ({source}), {machine}, batch {batch_size}, prompt {prompt} "
         f"({prompt_from} text), "
         f"{tokens} new tokens, {mode}; median of {repeats} after a warm-up")
    common = dict(preset=preset, run=run_dir, backend=backend, batch_size=batch_size, prompt=prompt, tokens=tokens,
                  repeats=repeats, prompt_from=prompt_from)
    modes = {"nanoeuler plain": False, "nanoeuler speculative": True, "nanoeuler default": None}
    if cfg.n_mtp == 1:
        modes = {"nanoeuler plain": False}
        echo("(plain decoding only: the model has one head, so no extra heads propose tokens to speculate with)")
    ours = run_worker({**common, "engine": "nanoeuler", "temperature": temperature, "modes": list(modes.values()),
                       "weights": weights, "prefill": prefill}, MODULE)
    rows = dict(zip(modes, ours or [None] * len(modes)))
    if peers and temperature == 0:
        try:
            import torch  # noqa: F401  (only to know whether the peers can run)
        except ImportError:
            echo("torch is not installed: no peer comparison (pip install 'nanoeuler[bench]')")
        else:
            rows["torch eager, KV cache"] = run_worker({**common, "engine": "torch", "compile": False,
                                                        "prefill": prefill}, MODULE)
            if be.peer_device != "cpu":   # CUDA graphs: a GPU peer only
                rows["torch compile, static cache + CUDA graphs"] = run_worker(
                    {**common, "engine": "torch", "compile": True}, MODULE)
            if run_dir is not None:   # random weights have no run to export (nor a tokenizer)
                rows |= transformers_rows(common, weights, prefill, echo)
    plain = rows.get("nanoeuler plain")
    echo(f"{'engine':<44}{'tokens/s':>10}{'ms/step':>10}{'memory MB':>11}{'vs plain':>10}{'same tokens':>13}")
    for name, r in rows.items():
        if r is None:
            echo(f"{name:<44}{'failed':>10}")
            continue
        r["tokens_per_s"] = batch_size * tokens / r["median_s"]
        ratio = f"{plain['median_s'] / r['median_s']:.2f}" if plain else "-"
        same = _agreement(r["tokens"], plain["tokens"]) if plain and temperature == 0 else "-"
        echo(f"{name:<44}{r['tokens_per_s']:>10.0f}{r['median_s'] / tokens * 1e3:>10.3f}{r['memory_mb']:>11.0f}"
             f"{ratio:>10}{same:>13}")
    if plain:   # a plain step's positions run from the prompt's length to that plus tokens - 1
        step_bytes = plain_step_bytes(cfg, plain["weights"], plain["matrix_bytes"], batch_size,
                                      prompt + (tokens - 1) / 2)
        rate = step_bytes / (plain["median_s"] / tokens) / 1e9
        peak = next((v for k, v in PEAK_GB_PER_S.items() if k in machine), None)
        echo(f"bandwidth, plain: {step_bytes / 1e6:.1f} MB read a step, {rate:.0f} GB/s"
             + (f", {rate / peak:.1%} of the card's {peak:,.0f} GB/s" if peak else ""))
    for name in ("nanoeuler speculative", "nanoeuler default"):
        r = rows.get(name)
        if r:
            echo(f"{name.removeprefix('nanoeuler ')}: {r['weights']} weights, {r['mode']} ({r['speculative_steps']:.0%} of steps speculative), "
                 f"{r['acceptance']:.1%} of proposals accepted, {r['per_step']:.2f} tokens per row and step"
                 + _kept_line(r["kept_where_reached"]))
    for name, r in rows.items():
        if r is not None and r.get("prefill_s"):
            r["prefill_tokens_per_s"] = batch_size * prefill / r["prefill_s"]
            echo(f"prefill, {prefill}-token prompt x {batch_size}: {name.split(',')[0]} "
                 f"{r['prefill_tokens_per_s']:.0f} tokens/s ({r['prefill_s'] * 1e3:.1f} ms)")
    best = max((r["tokens_per_s"] for n, r in rows.items() if r and n.startswith("nanoeuler")), default=0.0)
    peer_speeds = {n: r["tokens_per_s"] for n, r in rows.items() if r and not n.startswith("nanoeuler")}
    if best and peer_speeds:   # against the strongest peer: the others' ratios are in the table
        strongest = max(peer_speeds, key=peer_speeds.get)
        echo(f"ratio nanoeuler (best) / {strongest}: {best / peer_speeds[strongest]:.2f}")
    return {"machine": machine, "rows": rows}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    engine = spec.pop("engine")
    workers = {"nanoeuler": worker_nanoeuler, "torch": worker_torch, "transformers": worker_transformers,
               "export": worker_export}
    result = workers[engine](**spec)
    print(json.dumps(result))
