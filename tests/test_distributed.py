"""Data parallelism and gradient accumulation: micro-batches equal one big batch on every backend;
`mpiexec -n 2` equals one process accumulating two micro-batches, with and without sharded AdamW
state (ZeRO-1) and sharded gradients (ZeRO-2), through resume too; a killed or hung rank ends the
job with the last checkpoint intact; Ctrl-C stops every rank after the same step; errors are one line.

The multi-process tests run the CLI under MPICH's mpiexec (pip install '.[dist]'), one Numba
thread per process so that runs of different shapes sum in the same order."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from nanoeuler_core.corpus.tokens import BatchLoader
from nanoeuler_core.engine import checkpoint
from nanoeuler_core.engine.gradcheck import tiny_config
from nanoeuler_core.engine.model import Model
from nanoeuler_core.engine.optim import make_optimizer
from nanoeuler_core.registry import bf16_bits, bf16_values
from nanoeuler_core.training.step import TrainStep
from nanoeuler_core.training import dpo, sft
from nanoeuler_core.training import pretrain as train
from finetune_helpers import make_base_run, write_jsonl

# where pip put mpich's launcher: this environment's scripts, or its base interpreter's
MPIEXEC = next((path for path in (Path(sysconfig.get_path("scripts")) / "mpiexec",
                                  Path(sysconfig.get_path("scripts", vars={"base": sys.base_prefix})) / "mpiexec")
                if path.exists()), Path("mpiexec-not-found"))
needs_mpi = pytest.mark.skipif(not MPIEXEC.exists(), reason="needs mpiexec and mpi4py: pip install '.[dist]'")
ONE_THREAD = {"NUMBA_NUM_THREADS": "1"}


def quiet(_msg):
    pass


def relative_difference(a: dict, b: dict) -> float:
    """|a - b| / |b| over every tensor of two name -> array dicts."""
    num = sum(float(np.sum((np.asarray(a[k], np.float64) - b[k]) ** 2)) for k in b)
    return float(np.sqrt(num / sum(float(np.sum(np.asarray(b[k], np.float64) ** 2)) for k in b)))


# ------------------------------------------------------------------------------------------------
# in one process: micro-batches, loaders


def _real_gpu() -> bool:
    import numba
    from numba import cuda

    return not numba.config.ENABLE_CUDASIM and cuda.is_available()


# On the CUDA simulator a step of even the tiny model takes about a minute: the kernels the
# accumulation uses (add, copy, adamw) are checked there by the registry's gradcheck instead.
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("backend", ["reference", "cpu", pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _real_gpu(), reason="needs a real CUDA GPU")])])
def test_micro_batches_equal_one_batch(backend, optimizer):
    """4 micro-batches of 1 row make the step of one batch of 4 rows (captured as one CUDA graph on
    a GPU): the MTP weights count the whole step's targets (some ignored, some heads with fewer)."""
    cfg = tiny_config()
    results = []
    for split in (False, True):
        model = Model(cfg, backend=backend, seed=0)
        model.backend.matmul_precision = "highest"  # float32 products (a training run in this process may have chosen TF32)
        step = TrainStep(model, make_optimizer(optimizer, model))
        rows = np.random.default_rng(1)
        history = []
        for _ in range(3):
            inputs = rows.integers(0, cfg.vocab_size, (4, 5))
            targets = rows.integers(0, cfg.vocab_size, (4, 5))
            targets[1, :4] = -1
            targets[3, 2] = -1
            batches = [(inputs[i:i + 1], targets[i:i + 1]) for i in range(4)] if split else [(inputs, targets)]
            history.append(step.micro_batches(batches, 1e-2))
        results.append((np.array(history), {n: np.array(w) for n, w in model.params.items()}))
    (whole, w_whole), (split, w_split) = results
    np.testing.assert_allclose(split, whole, rtol=1e-6 if backend != "reference" else 1e-12)
    assert relative_difference(w_split, w_whole) < (1e-6 if backend != "reference" else 1e-12)


class RecordingCollectives:
    """Stands in for rank 0 of `size` ranks: records which slice of the gradient buffer each
    started collective covers (and whether the backward was still running), sums nothing."""

    rank = 0

    def __init__(self, model, size):
        self.model, self.size, self.calls, self.after_backward = model, size, [], False

    def _record(self, kind, buf, root=None):
        offset = (buf.__array_interface__["data"][0] - self.model.grad_flat.__array_interface__["data"][0])
        lo = offset // buf.itemsize
        self.calls.append((kind, lo, lo + buf.size, root, self.after_backward))

    def all_reduce_sum_async(self, buf, wire=None):
        self._record("all-reduce", buf)

    def reduce_sum_async(self, buf, root, wire=None, into=None):
        self._record("reduce", buf, root)

    def wait(self):
        self.calls.append(("wait",))

    def backward_done(self):
        self.calls.append(("backward done",))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("zero", [False, True], ids=["all-reduce", "zero-1"])
def test_gradient_sums_start_during_the_backward_in_buckets_covering_every_gradient(optimizer, zero, tied):
    from nanoeuler_core.engine.optim import GradientSync, make_optimizer

    cfg = tiny_config(tie_embeddings=tied)
    model = Model(cfg, backend="cpu")
    comm = RecordingCollectives(model, size=2)
    groups = make_optimizer(optimizer, model, comm=comm, zero=zero).groups
    sync = GradientSync(model, comm, groups, bucket=60)   # a few tensors per bucket
    batch = model.prepare(*np.ones((2, 2, cfg.ctx_len), dtype=np.int64))
    sync.begin()
    model.forward_backward(batch, grads_ready=sync.ready)
    comm.after_backward = True
    sync.finish()
    *sums, done, last = comm.calls
    assert done == ("backward done",) and last == ("wait",)
    assert sum(not done for *_, done in sums) >= 3, "the sums should start while the backward still runs"
    covered = sorted((lo, hi) for _, lo, hi, _, _ in sums)
    assert covered[0][0] == 0 and covered[-1][1] == model.n_params
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), "every gradient summed exactly once"
    heads, _ = model.layout["heads.1" if tied else "heads.0"]   # a tied tok_emb is final only after the embedding
    assert sums[0][1] >= heads, "the heads' gradients are final first"
    for kind, lo, hi, root, _ in sums:
        group = next(g for g in groups if g.lo <= lo < g.hi)
        assert hi <= group.hi, "a sum never spans two groups"
        assert kind == ("reduce" if group.sharded else "all-reduce")
        assert group.sharded == (zero or group.op == "muon")
        if group.sharded:   # each part goes to the rank that owns it, never across two parts
            per_rank = (group.hi - group.lo) // 2
            assert root == (lo - group.lo) // per_rank == (hi - 1 - group.lo) // per_rank


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_buckets_fire_in_the_order_the_backward_finishes_them_and_the_last_is_the_last_report(tied):
    """Each report of final gradients fires every final gradient not yet summed once they fill a
    bucket: the norms ride with the next block instead of waiting for the end, and once the rest
    fits in a bucket every report fires, so the sums after the backward's last report cover
    exactly what that report names (the embedding table and the first norm)."""
    from nanoeuler_core.engine.optim import GradientSync, make_optimizer

    cfg = tiny_config(tie_embeddings=tied)
    model = Model(cfg, backend="cpu")
    comm = RecordingCollectives(model, size=2)
    groups = make_optimizer("adamw", model, comm=comm).groups
    block = sum(int(np.prod(s)) for n, (_, s) in model.layout.items() if n.startswith("layers.1."))
    sync = GradientSync(model, comm, groups, bucket=block)   # about one block per bucket
    reports = []

    def ready(names):
        reports.append((list(names), len(comm.calls)))
        sync.ready(names)

    batch = model.prepare(*np.ones((2, 2, cfg.ctx_len), dtype=np.int64))
    sync.begin()
    model.forward_backward(batch, grads_ready=ready)
    sync.finish()
    size = lambda name: int(np.prod(model.layout[name][1]))
    last_names, first_of_last = reports[-1]
    last = [call for call in comm.calls[first_of_last:] if call[0] == "all-reduce"]
    assert sum(hi - lo for _, lo, hi, _, _ in last) == sum(size(n) for n in last_names) < block
    assert comm.calls[-2:] == [("backward done",), ("wait",)], "nothing is left to sum once the backward ends"
    # a block's norms are summed before the backward's last report, with a bucket that fills
    norm_offset, _ = model.layout[f"layers.{cfg.n_layers - 1}.ffn_norm"]
    assert any(lo <= norm_offset < hi for _, lo, hi, _, _ in comm.calls[:first_of_last])
    # and the buckets follow the backward: the last block's matrices before the first block's
    def summed_at(name):
        offset, _ = model.layout[name]
        return next(i for i, (_, lo, hi, _, _) in enumerate(comm.calls[:first_of_last]) if lo <= offset < hi)

    assert summed_at(f"layers.{cfg.n_layers - 1}.wq") < summed_at("layers.0.wq")


class OneRank:
    """The collectives of a job of one rank, in this process: a sum over one rank is the rank's
    values (rounded to bf16 where they travel in bf16), added into `into` where given."""

    rank, size = 0, 1

    def all_reduce_sum(self, buf):
        pass

    reduce_scatter_sum = all_gather = all_reduce_sum

    def all_reduce_sum_async(self, buf, wire=None):
        if wire is not None:
            buf[:] = bf16_values(bf16_bits(buf))

    def reduce_sum_async(self, buf, root, wire=None, into=None):
        self.all_reduce_sum_async(buf, wire)
        if into is not None:
            into += buf

    def wait(self):
        pass

    backward_done = wait

    def mark(self, marker=None):
        return None

    def wait_for(self, marker):
        pass

    def host_sum(self, values):
        return np.asarray(values)

    host_concat = host_sum


def train_tiny(cfg, micro_batches: int, optimizer: str = "adamw", **settings):
    """Three steps of `micro_batches` micro-batches of 2 rows: (losses and norms, weights, optimizer)."""
    model = Model(cfg, backend="cpu", seed=0)
    opt = make_optimizer(optimizer, model, **settings)
    step, rows = TrainStep(model, opt), np.random.default_rng(1)
    history = []
    for _ in range(3):
        inputs, targets = rows.integers(0, cfg.vocab_size, (2, 2 * micro_batches, 5))
        history.append(step.micro_batches([(inputs[2 * k:2 * k + 2], targets[2 * k:2 * k + 2])
                                           for k in range(micro_batches)], 1e-2))
    return np.array(history), model.params, opt


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_zero_2_keeps_the_gradients_in_reused_buckets_and_trains_as_the_plain_step(optimizer, tied, micro_batches):
    """ZeRO-2 on one rank: the backward writes into a few slots that the buckets take in turn
    (less memory than the whole gradient, the flat buffer gone), each micro-batch's sums add into
    the gradient shards, and training equals the plain step's (exactly for one micro-batch)."""
    cfg = dataclasses.replace(tiny_config(tie_embeddings=tied), n_layers=4)
    plain, w_plain, _ = train_tiny(cfg, micro_batches, optimizer)
    zero, w_zero, opt = train_tiny(cfg, micro_batches, optimizer, comm=OneRank(), zero=2)
    assert opt.model.grad_flat is None and opt.sync.grads.elements < opt.model.n_params
    assert len(opt.sync.grads.slots) < len(opt.sync.buckets)
    bound = 0 if micro_batches == 1 else 1e-6
    np.testing.assert_allclose(zero, plain, rtol=bound, atol=0)
    assert relative_difference(w_zero, w_plain) <= bound


def test_zero_2_sums_in_bf16_as_zero_1_does():
    """The bf16 copy the sums travel in follows the buckets' slots: on one rank ZeRO-2's rounded
    sums train exactly as ZeRO-1's, and differ from float32 sums."""
    cfg = dataclasses.replace(tiny_config(), n_layers=4)
    runs = [train_tiny(cfg, 1, comm=OneRank(), zero=zero, grad_reduce=reduce)
            for zero, reduce in ((1, "bf16"), (2, "bf16"), (2, "fp32"))]
    (one, w_one, _), (two, w_two, opt), (_, w_fp32, _) = runs
    np.testing.assert_array_equal(two, one)
    assert relative_difference(w_two, w_one) == 0 < relative_difference(w_two, w_fp32)
    assert opt.memory()["bf16_sums"] == 2 * opt.sync.grads.elements < 2 * opt.model.n_params


def test_loaders_split_a_step_into_micro_batches(tok):
    tokens = np.arange(5000, dtype=np.uint16) % 300
    big, small = BatchLoader(tokens, 8, 16, seed=4), BatchLoader(tokens, 2, 16, seed=4)
    for step in (1, 9):
        whole = big.batch(step)
        parts = [small.batch(step, part) for part in range(4)]
        for i in (0, 1):
            np.testing.assert_array_equal(np.concatenate([p[i] for p in parts]), whole[i])
    seqs = [sft.encode_example(tok, sft.render_prompt(f"Say {i}."), str(i), 96) for i in range(7)]
    big = sft.SFTLoader(seqs, 6, 96, seed=1, pad_id=tok.eos_id)
    small = sft.SFTLoader(seqs, 2, 96, seed=1, pad_id=tok.eos_id, rows_per_step=6)
    for step in (0, 3):
        np.testing.assert_array_equal(np.concatenate([small.batch(step, p)[1] for p in range(3)]), big.batch(step)[1])


def test_pretrain_grad_accum_4_equals_batch_4b(corpus_and_tokenizer, tmp_path):
    runs = {}
    for name, batch_size, grad_accum in (("big", 4, 1), ("accum", 1, 4)):
        tc = train_config(corpus_and_tokenizer, batch_size=batch_size, grad_accum=grad_accum)
        run = train.start_run(tmp_path / name, tc, quiet)
        train.train(run, quiet)
        runs[name] = run
    assert np.allclose(metric_losses(tmp_path / "accum"), metric_losses(tmp_path / "big"), rtol=1e-6, atol=1e-5)
    assert relative_difference(runs["accum"].model.params, runs["big"].model.params) < 1e-6


def test_sft_and_dpo_grad_accum_equal_one_batch(tmp_path, tok):
    base = make_base_run(tmp_path / "base", tok)
    words = ("night", "sword", "crown", "blood", "heart", "grace", "honour", "tongue")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"instruction": f"Reverse: {w}", "chosen": w[::-1], "rejected": w}
                                                   for w in words])
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [{"instruction": f"Repeat: {w}", "output": w} for w in words])
    params = {}
    for name, batch_size, grad_accum in (("big", 4, 1), ("accum", 2, 2)):
        tc = sft.fine_tune_config(base, steps=3, batch_size=batch_size, grad_accum=grad_accum, lr=1e-3, val_fraction=0.0)
        run, _ = sft.start_sft(base, tasks, tmp_path / f"sft-{name}", tc, quiet)
        train.train(run, quiet)
        trainer = dpo.start_dpo(base, pairs, tmp_path / f"dpo-{name}", tc, 0.1, quiet)
        trainer.train(quiet)
        params[name] = (run.model.params, trainer.run.model.params)
        for stage in ("sft", "dpo"):
            params[name, stage] = metric_losses(tmp_path / f"{stage}-{name}")
    for i in (0, 1):
        assert relative_difference(params["accum"][i], params["big"][i]) < 1e-6
    for stage in ("sft", "dpo"):
        assert np.allclose(params["accum", stage], params["big", stage], rtol=1e-6, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# several processes under mpiexec


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    from test_train import CORPUS_CHARS
    from nanoeuler_core.corpus.tokens import default_corpus
    from nanoeuler_core.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("corpus")
    text = default_corpus().read_text(encoding="utf-8")[:CORPUS_CHARS]
    (folder / "shakespeare.txt").write_text(text, encoding="utf-8")
    Tokenizer.train(text, 512).save(folder / "tokenizer.json")
    return folder / "shakespeare.txt", folder / "tokenizer.json"


def train_config(corpus_and_tokenizer, **overrides):
    corpus, tokenizer = corpus_and_tokenizer
    settings = dict(corpus=str(corpus), tokenizer=str(tokenizer), steps=4, batch_size=2, eval_every=2,
                    eval_batches=3, ckpt_every=2)
    return train.TrainConfig(**{**settings, **overrides})


def metric_losses(run_dir: Path) -> list[float]:
    return [orjson.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def pretrain_args(corpus_and_tokenizer, out, *extra, steps=6, batch_size=2):
    corpus, tokenizer = corpus_and_tokenizer
    return ["pretrain", "--corpus", corpus, "--tokenizer", tokenizer, "--steps", steps, "--decay-steps", 6,
            "--batch-size", batch_size, "--eval-every", 3, "--ckpt-every", 3, "--sample-prompt", "x", "--out", out,
            *extra]


def command(args, ranks: int | None = None) -> list[str]:
    launcher = [str(MPIEXEC), "-n", str(ranks)] if ranks else []
    return [*launcher, sys.executable, "-m", "nanoeuler_core.cli", *map(str, args)]


def run(args, ranks: int | None = None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command(args, ranks), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ONE_THREAD, **(env or {})})


def checked(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr
    return result


def saved_state(run_dir: Path) -> tuple[dict, dict]:
    return (checkpoint.load_tensors(run_dir / "model.safetensors")[0],
            checkpoint.load_tensors(run_dir / "optimizer.safetensors")[0])


def assert_same_run(a: Path, b: Path, rtol: float = 1e-6) -> None:
    """Losses step for step and final weights and optimizer state within `rtol` (relative)."""
    np.testing.assert_allclose(metric_losses(a), metric_losses(b), rtol=rtol, atol=0)
    (wa, oa), (wb, ob) = saved_state(a), saved_state(b)
    assert relative_difference(wa, wb) <= rtol and relative_difference(oa, ob) <= rtol


@pytest.fixture(scope="module")
def runs(corpus_and_tokenizer, tmp_path_factory):
    """Six steps of batch 2 x 128: one process accumulating 2 micro-batches; 2 ranks; 2 ranks
    with sharded AdamW state (ZeRO-1), and sharded gradients too (ZeRO-2: with batch 2, and with 2
    micro-batches of 1 row); sums in bf16; 2 ranks stopped at step 3 and resumed; Muon in one process
    accumulating 2 micro-batches, and on 2 ranks (shared out, ZeRO-1) stopped at step 3 and resumed."""
    if not MPIEXEC.exists():
        pytest.skip("needs mpiexec and mpi4py: pip install '.[dist]'")
    root = tmp_path_factory.mktemp("dp")
    checked(run(pretrain_args(corpus_and_tokenizer, root / "accum", "--grad-accum", 2)))
    checked(run(pretrain_args(corpus_and_tokenizer, root / "ranks"), ranks=2))
    checked(run(pretrain_args(corpus_and_tokenizer, root / "zero", "--zero", 1), ranks=2))
    for name, args in (("zero2", pretrain_args(corpus_and_tokenizer, root / "zero2", "--zero", 2)),
                       ("zero2_accum", pretrain_args(corpus_and_tokenizer, root / "zero2_accum", "--zero", 2,
                                                     "--grad-accum", 2, batch_size=1))):
        (root / f"{name}.log").write_text(checked(run(args, ranks=2)).stderr)
    checked(run(pretrain_args(corpus_and_tokenizer, root / "bf16", "--grad-reduce", "bf16"), ranks=2))
    checked(run(pretrain_args(corpus_and_tokenizer, root / "resumed", steps=3), ranks=2))
    checked(run(["pretrain", "--resume", root / "resumed", "--steps", 6, "--sample-prompt", "x"], ranks=2))
    checked(run(pretrain_args(corpus_and_tokenizer, root / "muon_accum", "--optimizer", "muon", "--grad-accum", 2)))
    checked(run(pretrain_args(corpus_and_tokenizer, root / "muon_zero", "--optimizer", "muon", "--zero", 1, steps=3),
                ranks=2))
    checked(run(["pretrain", "--resume", root / "muon_zero", "--steps", 6, "--sample-prompt", "x"], ranks=2))
    return root


@needs_mpi
def test_two_ranks_equal_one_process_accumulating_two_micro_batches(runs):
    ranks = checked(run(["generate", runs / "ranks", "It", "--max-new-tokens", 3, "--seed", 0]))
    assert ranks.stdout.startswith("It")
    assert_same_run(runs / "ranks", runs / "accum")


@needs_mpi
def test_zero_1_equals_plain_data_parallel(runs):
    assert_same_run(runs / "zero", runs / "ranks")


def memory_logged(log: str) -> dict[str, float]:
    """The MB of parameters, gradients and optimizer state per rank that a run logs at its end."""
    line = next(line for line in log.splitlines() if line.startswith("memory per rank:"))
    return {what: float(mb.replace(",", ""))
            for what, mb in re.findall(r"(parameters|gradients|optimizer state) ([\d,.]+) MB", line)}


@needs_mpi
def test_zero_2_equals_plain_data_parallel(runs):
    """Each rank keeps only its shard of the summed gradients (and of the moments): the same run as
    plain data parallelism and as one process accumulating both ranks' micro-batches."""
    assert_same_run(runs / "zero2", runs / "ranks")
    assert_same_run(runs / "zero2", runs / "accum")
    held = memory_logged((runs / "zero2.log").read_text())
    assert held["gradients"] < held["parameters"] and held["optimizer state"] == held["parameters"]   # (2 moments) / 2 ranks


@needs_mpi
def test_zero_2_adds_every_micro_batch_into_the_gradient_shards(runs):
    """2 ranks of 2 micro-batches of 1 row: each micro-batch's sums add into the shards, as one
    process accumulating 2 micro-batches of 2 rows trains (the gradients added in another order:
    each micro-batch's summed over the ranks first)."""
    assert_same_run(runs / "zero2_accum", runs / "accum", rtol=1e-5)


@needs_mpi
def test_bf16_gradient_sums_round_and_train_as_fp32_ones(runs):
    """Sums in bf16 really round (the weights differ from the float32 sums' after one step) and
    train as float32 sums do, within bf16's rounding."""
    bf16, fp32 = metric_losses(runs / "bf16"), metric_losses(runs / "ranks")
    assert bf16[0] == fp32[0], "step 1's loss comes before any update"
    np.testing.assert_allclose(bf16, fp32, rtol=2e-3)
    (wb, ob), (wf, of) = saved_state(runs / "bf16"), saved_state(runs / "ranks")
    assert 1e-6 < relative_difference(wb, wf) < 1e-2
    assert relative_difference(ob, of) < 2e-2


@needs_mpi
def test_two_rank_run_resumes_exactly(runs):
    assert_same_run(runs / "resumed", runs / "ranks", rtol=0)


@needs_mpi
def test_muon_shared_out_over_two_ranks_equals_one_process(runs):
    """Each rank orthogonalizes the matrices of half the blocks and keeps their momentum alone
    (AdamW's moments sharded too, ZeRO-1); stopped at step 3 and resumed, it trains as one process
    accumulating both ranks' micro-batches."""
    assert_same_run(runs / "muon_zero", runs / "muon_accum", rtol=1e-5)


@needs_mpi
@pytest.mark.parametrize("zero", [1, 2])
def test_sharded_checkpoint_resumes_in_one_process(corpus_and_tokenizer, runs, tmp_path, zero):
    """A ZeRO-1 or ZeRO-2 checkpoint is the full optimizer state: it resumes without --zero, on one rank."""
    checked(run(pretrain_args(corpus_and_tokenizer, tmp_path / "zero", "--zero", zero, steps=3), ranks=2))
    checked(run(["pretrain", "--resume", tmp_path / "zero", "--steps", 6, "--grad-accum", 2, "--zero", 0,
                 "--sample-prompt", "x"]))
    assert_same_run(tmp_path / "zero", runs / "accum")


@needs_mpi
def test_dpo_two_ranks_equal_one_process_accumulating(tmp_path, tok):
    base = make_base_run(tmp_path / "base", tok)
    words = ("night", "sword", "crown", "blood", "heart", "grace", "honour", "tongue")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"instruction": f"Reverse: {w}", "chosen": w[::-1], "rejected": w}
                                                   for w in words])
    common = ["dpo", "--base", base, "--data", pairs, "--steps", 3, "--batch-size", 2, "--val-fraction", 0.25,
              "--eval-every", 3]
    checked(run([*common, "--out", tmp_path / "accum", "--grad-accum", 2]))
    two = checked(run([*common, "--out", tmp_path / "ranks"], ranks=2))
    assert two.stdout.count("after DPO") == 1  # rank 0 reports
    assert_same_run(tmp_path / "ranks", tmp_path / "accum")


@needs_mpi
@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_fine_tuning_sums_in_bf16_over_two_ranks(tmp_path, tok, stage):
    """--grad-reduce bf16 reaches sft's and dpo's optimizer: the sums round (the weights differ from
    one process accumulating both ranks' micro-batches in float32) and train as float32 sums do."""
    base = make_base_run(tmp_path / "base", tok)
    words = ("night", "sword", "crown", "blood", "heart", "grace", "honour", "tongue")
    if stage == "sft":
        data = write_jsonl(tmp_path / "data.jsonl", [{"instruction": f"Repeat: {w}", "output": w} for w in words])
    else:
        data = write_jsonl(tmp_path / "data.jsonl", [{"instruction": f"Reverse: {w}", "chosen": w[::-1], "rejected": w}
                                                     for w in words])
    common = [stage, "--base", base, "--data", data, "--steps", 3, "--batch-size", 2, "--val-fraction", 0,
              "--eval-every", 3, "--lr", 1e-3]
    checked(run([*common, "--out", tmp_path / "fp32", "--grad-accum", 2]))
    bf16 = checked(run([*common, "--out", tmp_path / "bf16", "--grad-reduce", "bf16"], ranks=2))
    assert "sums in bf16" in bf16.stderr
    assert checkpoint.read_json(tmp_path / "bf16" / "config.json")["training"]["grad_reduce"] == "bf16"
    losses, fp32 = metric_losses(tmp_path / "bf16"), metric_losses(tmp_path / "fp32")
    assert losses[0] == fp32[0], "step 1's loss comes before any update"
    np.testing.assert_allclose(losses, fp32, rtol=2e-3)
    assert 0 < relative_difference(saved_state(tmp_path / "bf16")[0], saved_state(tmp_path / "fp32")[0]) < 1e-2


@needs_mpi
def test_ranks_spend_a_time_budget_together(corpus_and_tokenizer, tmp_path):
    """Each rank's clock runs on its own: the learning rate follows rank 0's, and every rank stops
    after the same step (a rank that went on alone would wait in its all-reduce)."""
    args = pretrain_args(corpus_and_tokenizer, tmp_path / "run", "--time-budget", 0.05, steps=10**6)
    out = checked(run(args, ranks=2))
    assert (out.stdout + out.stderr).count("time budget of 0.05 min spent at step") == 1, out.stderr
    rows = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    # rank 0's clock (the metrics') may stand a little behind the rank whose clock ended the budget
    assert rows[-1]["time"] >= 2.5 and "val_loss" in rows[-1]


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the processes mpiexec started, found through /proc (PMI_RANK in their environment)."""
    found, todo = {}, [launcher_pid]
    while todo:
        pid = todo.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(child) for child in (task / "children").read_text().split()]
            for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if entry.startswith(b"PMI_RANK="):
                    found[int(entry.split(b"=")[1])] = pid
        except OSError:
            continue
    return found


def start_long_run(corpus_and_tokenizer, run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    """A 2-rank run of many steps, checkpointing every 2; returns once it has logged 4 steps."""
    args = pretrain_args(corpus_and_tokenizer, run_dir, steps=100_000)
    args[args.index("--ckpt-every") + 1] = 2
    args[args.index("--eval-every") + 1] = 100_000
    proc = subprocess.Popen(command(args, ranks=2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ONE_THREAD, **(env or {})})
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_bytes().count(b"\n") >= 4):
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    return proc


def assert_checkpoint_resumes(run_dir: Path) -> int:
    """The run resumes from a whole checkpoint: step 2's at least (a step's metrics row is written before
    its checkpoint, so the one of step 4 may be the write the dying job cut short, and is not there)."""
    resumed = train.resume_run(run_dir, {}, quiet)
    step = resumed.optimizer.step_count
    assert step >= 2 and step % 2 == 0
    assert checkpoint.load_tensors(run_dir / "model.safetensors")[1]["step"] == str(step)
    return step


@needs_mpi
def test_killed_rank_ends_the_job_and_the_checkpoint_stays_intact(corpus_and_tokenizer, tmp_path):
    proc = start_long_run(corpus_and_tokenizer, tmp_path / "run")
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    start = time.time()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.time() - start < 30
    assert "Killed (signal 9)" in out + err  # mpiexec's report of the rank that died
    assert_checkpoint_resumes(tmp_path / "run")


@needs_mpi
def test_hung_rank_stops_the_job_after_the_timeout(corpus_and_tokenizer, tmp_path):
    proc = start_long_run(corpus_and_tokenizer, tmp_path / "run", env={"NANOEULER_DIST_TIMEOUT": "3"})
    os.kill(rank_pids(proc.pid)[1], signal.SIGSTOP)  # alive but silent: rank 0 waits in the all-reduce
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and time.time() - start < 30
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "made no progress for 3 s" in errors[0] and "is intact" in errors[0], err
    assert_checkpoint_resumes(tmp_path / "run")


@needs_mpi
def test_ctrl_c_stops_every_rank_after_the_same_step(corpus_and_tokenizer, tmp_path):
    proc = start_long_run(corpus_and_tokenizer, tmp_path / "run")
    proc.send_signal(signal.SIGINT)  # mpiexec passes it to every rank
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("interrupted: checkpoint at step") == 1 and "Traceback" not in err
    step = int(err.split("checkpoint at step ")[1].split()[0])
    assert train.resume_run(tmp_path / "run", {}, quiet).optimizer.step_count == step
    assert len(metric_losses(tmp_path / "run")) == step


@needs_mpi
def test_errors_are_one_line(corpus_and_tokenizer, tmp_path):
    cases = [
        # the CUDA simulator (tests) or a real machine with fewer GPUs than ranks
        ((pretrain_args(corpus_and_tokenizer, tmp_path / "a", "--backend", "cuda"), 2),
         "2 ranks on this machine but 1 GPU"),
        ((pretrain_args(corpus_and_tokenizer, tmp_path / "b", "--zero", 1), 3), "3 ranks do not divide them"),
        ((pretrain_args(corpus_and_tokenizer, tmp_path / "m", "--zero", 2, "--optimizer", "muon"), 3),
         "--zero 2 --optimizer muon shares out the gradients of whole blocks: 3 ranks do not divide the 4 blocks"),
        ((pretrain_args(corpus_and_tokenizer, tmp_path / "c", "--grad-accum", 0), 2), "--grad-accum must be at least 1"),
    ]
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        cases.pop(0)
    for (args, ranks), message in cases:
        result = run(args, ranks=ranks, timeout=120)
        lines = result.stderr.strip().splitlines()  # (mpiexec may print a banner of its own on stdout)
        assert result.returncode != 0 and len(lines) == 1 and message in lines[0], (args, result.stderr)
    # started by mpiexec, but mpi4py cannot be imported
    script = ("import sys; sys.modules['mpi4py'] = None; sys.argv[0] = 'nanoeuler-run'\n"
              "from nanoeuler_core.cli import main; main()")
    args = map(str, pretrain_args(corpus_and_tokenizer, tmp_path / "d"))
    result = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-c", script, *args], capture_output=True,
                            text=True, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and "mpi4py is not installed" in lines[0], result.stderr
    # started by another MPI's launcher (its variables set), which this mpi4py's library cannot join: each
    # process would see a job of one and train alone as rank 0 into the same run directory
    result = run(pretrain_args(corpus_and_tokenizer, tmp_path / "e"), timeout=60,
                 env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "mpiexec started 2 processes but MPI sees a job of 1" in lines[0] and not (tmp_path / "e").exists()


# ------------------------------------------------------------------------------------------------
# on a real GPU (bench/run_gpu_dist.sh runs these)

@pytest.mark.gpu
@needs_mpi
@pytest.mark.skipif(not _real_gpu(), reason="needs a real CUDA GPU")
def test_nccl_self_check_on_one_gpu():
    result = subprocess.run([str(MPIEXEC), "-n", "1", sys.executable, "bench/nccl_selfcheck.py"], capture_output=True,
                            text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0 and "nccl self-check passed" in result.stdout, result.stdout + result.stderr


@pytest.mark.gpu
@needs_mpi
@pytest.mark.skipif(not _real_gpu(), reason="needs a real CUDA GPU")
def test_captured_step_with_nccl_and_zero_equals_the_plain_step_on_one_gpu():
    """One rank: the NCCL all-reduce (or ZeRO-1's reduce-scatter and all-gather, or ZeRO-2's buckets
    summed into the gradient shards) inside the graph changes nothing: the same losses and norms,
    step for step, micro-batches included."""
    histories = []
    for variant in ("plain", "allreduce", "zero", "zero2"):
        result = subprocess.run([str(MPIEXEC), "-n", "1", sys.executable, "bench/bench_dist.py", "--variant", variant,
                                 "--preset", "small", "--batch-size", "4", "--grad-accum", "2", "--steps", "4",
                                 "--warmup", "1"], capture_output=True, text=True, timeout=600,
                                cwd=Path(__file__).parent.parent)
        assert result.returncode == 0, result.stderr
        histories.append(orjson.loads(result.stdout.strip().splitlines()[-1])["loss_and_norm"])
    assert histories[0] == histories[1] == histories[2]
    # ZeRO-2 adds each micro-batch's sums into its shard: the same up to float32 rounding
    np.testing.assert_allclose(histories[3], histories[0], rtol=1e-5)
