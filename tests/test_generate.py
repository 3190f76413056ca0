"""Generation: the decoder against the full forward, speculative against plain decoding (greedy:
the same tokens; sampling: the same distribution, by a chi-square test), batches against rows
decoded alone, the captured step against eager launches, the text API, the CLI and its errors.

Most tests run on a tiny model trained for a few seconds on sequences that mostly follow a fixed
cycle of tokens, so its multi-token heads agree with head 0 often but not always: speculative
steps both keep and refuse proposals."""

import itertools

import numpy as np
import pytest
from typer.testing import CliRunner

import nanoeuler_core
from nanoeuler_core import Model, ModelConfig, registry
from nanoeuler_core.engine.gradcheck import run_backend, stored_values
from nanoeuler_core.inference.decoder import DecodeStats, Decoder, Sampling, decoder_for
from nanoeuler_core.inference.decoder.speculation import SpeculationPolicy
from nanoeuler_core.inference.generate import generate, generate_batch
from nanoeuler_ops.sample import warped

from cycle_model import cycle_trained

CYCLE_CFG = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=48, ctx_len=24, n_mtp=3)
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], list(range(16)) + [3] * 8]   # the last fills the context


@pytest.fixture(scope="module")
def cycle_model():
    return cycle_trained(CYCLE_CFG)


def on_backend(model, backend):
    twin = Model(model.cfg, backend=backend)
    twin.load_params(model.params)
    return twin


def decode(model, prompts, n, speculative, sampling=Sampling(0.0), seeds=None, eos_id=None, stats=None,
           capture=True, weights=None):
    seeds = list(range(len(prompts))) if seeds is None else seeds
    decoder = Decoder(model, len(prompts), speculative, sampling, capture=capture, weights=weights)
    return decoder.generate(prompts, n, seeds, eos_id, stats=stats)


def tied_twin(model, backend):
    """The model with tied embeddings: its weights but heads.0, head 0 reading tok_emb."""
    twin = Model(ModelConfig(**{**model.cfg.to_dict(), "tie_embeddings": True}), backend=backend)
    twin.load_params({n: w for n, w in model.params.items() if n != "heads.0"})
    return twin


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_decoding_matches_the_full_forward(cycle_model, backend, tied):
    """Greedy decoding through the KV cache (prefill, one token per step, and the window sliding
    when the context is full) picks the argmax of the full forward over the same window."""
    model = (tied_twin if tied else on_backend)(cycle_model, backend)
    prompt, ctx = [2, 7, 1], model.cfg.ctx_len
    new = decode(model, [prompt], 40, speculative=False)[0]
    sequence, start = list(prompt), 0
    for token in new:
        if len(sequence) - start == ctx:       # the decoder refilled its cache with the last ctx // 2 tokens
            start = len(sequence) - ctx // 2
        logits = model.forward(np.array([sequence[start:]]))[0, -1]
        assert token == int(np.argmax(logits))
        sequence.append(token)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_speculative_greedy_equals_plain_greedy(cycle_model, backend):
    model = on_backend(cycle_model, backend)
    stats = DecodeStats()
    plain = decode(model, PROMPTS, 50, speculative=False)
    speculative = decode(model, PROMPTS, 50, speculative=True, stats=stats)
    assert speculative == plain
    assert all(len(row) == 50 for row in plain)              # past the context: the window slid
    assert 0 < stats.accepted < stats.proposed               # proposals both kept and refused
    assert stats.steps < 50 / 1.5                            # several tokens per step


def test_tied_speculative_greedy_equals_plain_greedy(cycle_model):
    model = tied_twin(cycle_model, "cpu")
    stats = DecodeStats()
    assert decode(model, PROMPTS, 20, speculative=True, stats=stats) == decode(model, PROMPTS, 20, speculative=False)
    assert stats.proposed > 0


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(1.0, top_k=5, top_p=0.9)])
def test_batch_equals_rows_alone(cycle_model, speculative, sampling):
    """Each row of a batch decodes exactly as alone with its seed (ragged prompts, one filling
    the context, rows stopping at an end token at different steps)."""
    eos = 0
    batch = decode(cycle_model, PROMPTS, 30, speculative, sampling, seeds=[7, 8, 9, 10], eos_id=eos)
    alone = [decode(cycle_model, [p], 30, speculative, sampling, seeds=[7 + i], eos_id=eos)[0]
             for i, p in enumerate(PROMPTS)]
    assert batch == alone
    assert eos not in sum(batch, [])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_sampling_filters(backend):
    """The tokens the sample op can draw under greedy, top-k and top-p (500 rows, one seed each)."""
    op = registry.op("sample").impl(backend)
    be = registry.backend(backend)
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))

    def drawn(temperature, top_k=0, top_p=1.0, rows=500):
        state = [be.asarray(a) for a in (np.zeros((rows, 1), np.int64), np.zeros((rows, 0, 4)), np.arange(rows),
                                          np.zeros(rows, np.int64), np.zeros(rows, np.int64))]
        settings = [be.asarray(np.full(rows, x)) for x in (float(temperature), top_k, float(top_p))]
        mask = be.asarray(np.full((rows, 1), -1, np.int32))   # every token allowed
        op.forward(be.asarray(np.tile(logits, (rows, 1, 1, 1))), *state, *settings, mask, max_pos=100)
        return set(be.to_host(state[0])[:, 0].tolist())

    assert drawn(0.0) == {0}
    assert drawn(1.0, top_k=2) == {0, 1}
    assert drawn(1.0, top_p=0.7) == {0, 1}
    assert drawn(1.0, top_p=0.5) == {0}
    assert drawn(1.0) == {0, 1, 2, 3}


def test_speculative_sampling_keeps_head0_distribution():
    """Chi-square test, fixed seeds: the first two tokens drawn by speculative sampling follow head 0's
    distribution (temperature 0.8, top-k 6), computed exactly from the full forward. The heads are
    random and sharpened so that proposals are kept about half the time, and a wrong acceptance rule
    (keeping every proposal, or never replacing one from the residual) fails the test."""
    cfg = ModelConfig(vocab_size=8, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=16, ctx_len=8, n_mtp=2)
    model = Model(cfg, backend="cpu", seed=3)
    params = model.params
    model.load_params({n: w * (10.0 if n.startswith("heads.") else 1.0) for n, w in params.items()})
    sampling, prompt, draws = Sampling(0.8, top_k=6), [3, 1], 4000
    first = warped(model.forward(np.array([prompt]))[0, -1], 0.8, 6, 1.0)
    expected = np.array([first[a] * warped(model.forward(np.array([prompt + [a]]))[0, -1], 0.8, 6, 1.0)
                         for a in range(cfg.vocab_size)])          # P(y1 = a, y2 = b)
    stats = DecodeStats()
    rows = decode(model, [prompt] * draws, 2, speculative=True, sampling=sampling, seeds=list(range(draws)),
                  stats=stats)
    counts = np.zeros_like(expected)
    for a, b in rows:
        counts[a, b] += 1
    assert 0.2 < stats.acceptance < 0.6
    keep = expected.reshape(-1) * draws >= 5                        # cells expected at least 5 times
    observed, predicted = counts.reshape(-1)[keep], expected.reshape(-1)[keep] * draws
    rest = draws - predicted.sum()                                  # the rarer cells, as one
    if rest > 1e-6:
        observed, predicted = np.append(observed, draws - observed.sum()), np.append(predicted, rest)
    else:                                                           # they have no mass: never drawn
        assert observed.sum() == draws
    chi2 = float(((observed - predicted) ** 2 / predicted).sum())
    df = observed.size - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3   # p = 0.001 (Wilson-Hilferty)
    assert chi2 < critical, (chi2, critical, df)


@pytest.mark.parametrize("wide_seconds, speculates", [(10.0, False), (1.0, True)])
def test_policy_runs_the_faster_mode(cycle_model, wide_seconds, speculates):
    """Told the step times (a step feeding proposals 10x, or 1x, a plain step's), the policy decodes
    plainly where speculating costs more per token than it gains, and speculates where it pays
    (this model's heads agree with head 0 most of the time); greedy tokens are plain decoding's."""
    decoder = Decoder(cycle_model, 4, None, Sampling(0.0))
    decoder.policy.step_seconds = {(n, W): 1.0 if W == 1 else wide_seconds for n in (1, 2, 4) for W in (1, 2, 3)}
    stats = DecodeStats()
    assert decoder.generate(PROMPTS, 50, [0, 1, 2, 3], stats=stats) == decode(cycle_model, PROMPTS, 50, False)
    assert stats.mode == ("speculative" if speculates else "plain")
    assert (stats.acceptance > 0.5) if speculates else stats.proposed == 0
    assert ("proposals accepted" if speculates else "plain decoding") in stats.line()


def test_policy_takes_a_wider_step_only_past_the_margin():
    """Measured times carry noise: a wider step must promise SPECULATION_MARGIN more tokens per
    second than a plain one, and a wider step timed below a narrower one counts as the narrower
    one's time. With proposal 1 kept 9 times in 100 offers (10 in 101 with the optimistic start: 1.10
    tokens a width-2 step), a width-2 step timed 10% slower than plain gains nothing (plain is kept);
    one timed as fast, or faster, gains 10% (it is taken). With proposal 1 never kept, even a width-2
    step timed 10% faster than plain gains 1%: plain is kept. The policy is numbers alone: no model."""
    policy = SpeculationPolicy(3, adaptive=True, multi_token_step_cheap=False)
    policy.offered[:], policy.kept[:] = 100, 9
    policy.step_seconds = {(1, 1): 1.0, (1, 2): 1.1, (1, 3): 1.5}
    assert policy.width(1, greedy=True) == 1
    for faster in (1.0, 0.9):
        policy.step_seconds = {(1, 1): 1.0, (1, 2): faster, (1, 3): 1.5}
        assert policy.width(1, greedy=True) == 2
    never_kept = SpeculationPolicy(3, adaptive=True, multi_token_step_cheap=False)
    never_kept.offered[:] = 100
    never_kept.step_seconds = policy.step_seconds
    assert never_kept.width(1, greedy=True) == 1


def test_policy_measures_and_switches_widths_exactly(cycle_model):
    """Whatever widths the steps take, one after another (proposals laid out again, some stale),
    greedy tokens are plain decoding's; a greedy call measures every width first."""
    plain = decode(cycle_model, PROMPTS, 50, False)
    decoder = Decoder(cycle_model, 4, None, Sampling(0.0))
    assert decoder.generate(PROMPTS, 50, [0, 1, 2, 3]) == plain
    assert sorted(decoder.policy.step_seconds) == [(n, W) for n in (1, 2, 4) for W in (1, 2, 3)]
    assert all(seconds > 0 for seconds in decoder.policy.step_seconds.values())
    for pattern in ([1, 3], [3, 2, 1, 1], [2, 3, 3, 1]):
        widths = itertools.cycle(pattern)
        decoder.choose_width = lambda n: next(widths)
        stats = DecodeStats()
        assert decoder.generate(PROMPTS, 50, [0, 1, 2, 3], stats=stats) == plain
        assert stats.mode == "mixed"


def test_policy_keeps_sampled_rows_on_the_backends_width(cycle_model):
    """While a sampled row is active, the policy's steps have the width the backend's traits give
    (1 on the CPU) whatever it measured, so a sampled row decodes as with that mode forced, alone
    or beside a greedy row, and the greedy row as plain decoding."""
    sampling = Sampling(1.0, top_k=5)
    decoder = Decoder(cycle_model, 2, None)
    decoder.policy.step_seconds = {(n, W): 1.0 for n in (1, 2) for W in (1, 2, 3)}   # speculating would pay
    assert decoder.policy.fixed_width() == 1
    greedy = decoder.admit(0, PROMPTS[0], 0, Sampling(0.0), 20)
    sampled = decoder.admit(1, PROMPTS[1], 5, sampling, 20)
    while decoder.active_rows():
        decoder.step()
    assert decoder.speculative_steps == 0
    assert greedy.new == decode(cycle_model, [PROMPTS[0]], 20, False)[0]
    assert sampled.new == decode(cycle_model, [PROMPTS[1]], 20, False, sampling, seeds=[5])[0]


def test_captured_step_equals_the_cpu_in_fp32_and_bf16():
    """The decode step through Backend.capture (the function itself on the simulator) with float32
    weights gives the CPU's tokens. With the default on the GPU, a bf16 copy of the weights and
    float32 accumulation, greedy tokens are float32 decoding's until two candidates' logits lie
    within bf16's rounding of each other, where they may part: on this one-block model they agree
    (tests/test_generate_gpu.py decodes a trained model in bf16 on a GPU). A prefill plus one
    speculative step keeps the simulator quick. The CPU has no bf16: one line."""
    cfg = ModelConfig(vocab_size=11, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=8, ctx_len=6, n_mtp=2)
    model = Model(cfg, backend="cuda", seed=2)
    stats, bf16_stats = DecodeStats(), DecodeStats()
    captured = decode(model, [[1, 2]], 2, speculative=True, stats=stats, weights="fp32")
    assert stats.steps == 1 and stats.weights == "fp32"
    assert captured == decode(on_backend(model, "cpu"), [[1, 2]], 2, speculative=True)
    assert decode(model, [[1, 2]], 2, speculative=True, stats=bf16_stats) == captured
    assert bf16_stats.weights == "bf16" and "bf16 weights" in bf16_stats.line()
    with pytest.raises(ValueError, match="use fp32 weights"):
        Decoder(on_backend(model, "cpu"), 1, False, weights="bf16")


@pytest.mark.parametrize("speculative,sampling", [(False, Sampling(0.0)), (True, Sampling(1.0, top_k=5, top_p=0.9))])
def test_cpu_captured_steps_replay_their_kernels(cycle_model, speculative, sampling):
    """On the CPU a captured step is the kernels its ops launched, launched again over the same
    buffers: it decodes the tokens eager steps decode. Prefill chunks run eagerly: the CPU backend
    does not declare `captures`, which would pad them to shapes captured once."""
    model, seeds = on_backend(cycle_model, "cpu"), [3, 4, 5, 6]
    decoder = Decoder(model, len(PROMPTS), speculative, sampling)
    assert decoder.generate(PROMPTS, 30, seeds) == decode(model, PROMPTS, 30, speculative, sampling, seeds, capture=False)
    assert decoder.launcher.replays and all(replay.__name__ == "replay" for replay in decoder.launcher.replays.values())
    assert decoder.prefill._runs and all(run.__name__ == "forward" for *_, run in decoder.prefill._runs.values())


def test_decoders_are_reused_and_follow_training(cycle_model):
    model = on_backend(cycle_model, "cpu")
    decoder = decoder_for(model, 2, True, Sampling(0.0))
    assert decoder_for(model, 2, True, Sampling(0.0)) is decoder
    before = decoder.generate(PROMPTS[:2], 8, [0, 1])
    model.load_params({n: -w for n, w in model.params.items()})   # new weights, same buffers
    after = decoder.generate(PROMPTS[:2], 8, [0, 1])
    assert after == decode(model, PROMPTS[:2], 8, True) and after != before


def test_pytorch_peer_decodes_the_same_tokens(cycle_model):
    """The benchmark's PyTorch peer (static KV cache) decodes greedily what nanoeuler decodes."""
    torch = pytest.importorskip("torch")
    from nanoeuler_core.bench.torch_peer import TorchModel

    peer = TorchModel(cycle_model.cfg).load(cycle_model.params).setup_cache(1, cycle_model.cfg.ctx_len)
    prompt = PROMPTS[2]
    with torch.no_grad():
        token = peer.next_token(torch.tensor([prompt]), torch.arange(len(prompt)))
        tokens = [int(token)]
        for position in range(len(prompt), cycle_model.cfg.ctx_len - 1):
            token = peer.next_token(token, torch.tensor([position]))
            tokens.append(int(token))
    assert tokens == decode(cycle_model, [prompt], len(tokens), speculative=False)[0]


# ------------------------------------------------------------------------------------------------
# running ahead: the next step launched before a step's results are taken


def count_running_ahead(decoder) -> list[bool]:
    """After each of `decoder`'s steps from now on, whether it left a step in flight (it ran ahead)."""
    ahead, step = [], decoder.step

    def step_and_look():
        step()
        ahead.append(decoder._in_flight is not None)

    decoder.step = step_and_look
    return ahead


MATRIX_OPS = {"norm_linear": 2, "norm_swiglu": 2, "linear_residual": 2}   # decoding op -> its weights' position


def run_with_bf16_weights(name, inputs, attrs, backend):
    """The decoding op `name` on float32 inputs with its weights rounded to bf16: on CUDA stored as
    bf16 (the decoder's copy, multiplied on the tensor cores), elsewhere as their float32 values."""
    be, i = registry.backend(backend), MATRIX_OPS[name]
    weights = stored_values(inputs[i], "bf16").astype(np.float32)
    weights = be.asarray(weights, storage="bf16" if backend == "cuda" else None)
    inputs = tuple(x.astype(np.float32) for x in inputs)
    return run_backend(registry.op(name), backend, inputs[:i] + (weights,) + inputs[i + 1:], attrs)[0][0]


def matrix_op_inputs(name, rng, N, C, O):
    """(inputs, attrs) of a decoding op that reads a matrix: N rows of C features, O outputs."""
    normal = rng.standard_normal
    if name == "linear_residual":
        return (normal((N, C)), normal((N, O)), normal((O, C)) / C ** 0.5), {}
    rows = 2 * O if name == "norm_swiglu" else O
    return (normal((N, C)), 1 + 0.1 * normal(C), normal((rows, C)) / C ** 0.5), {"eps": 1e-5}


@pytest.mark.parametrize("name", list(MATRIX_OPS))
def test_bf16_weights_give_the_cpus_products_and_rows_alone(name):
    """With the decoder's bf16 weights and float32 rows, the CUDA kernels (the simulator's twins of
    the tensor-core products here) give the CPU's results on the same weights, within float32's
    sums; and a row is bit for bit the same alone as the 9th of 41 (a second group of 8 rows) or the
    38th (a second slice of 32 rows, on blocks of its own)."""
    inputs, attrs = matrix_op_inputs(name, np.random.default_rng(3), 41, 200, 20)
    cuda, cpu = (run_with_bf16_weights(name, inputs, attrs, backend) for backend in ("cuda", "cpu"))
    assert np.linalg.norm(cuda - cpu) <= 2e-5 * np.linalg.norm(cpu)
    for n in (8, 37):
        alone = run_with_bf16_weights(name, tuple(x[n:n + 1] if x.ndim == 2 and x.shape[0] == 41 else x
                                                  for x in inputs), attrs, "cuda")
        assert np.array_equal(alone[0], cuda[n])


@pytest.mark.parametrize("name", list(MATRIX_OPS))
def test_float32_weights_give_rows_alone_in_any_slice(name):
    """With float32 weights, the CUDA kernels give a row bit for bit the same alone (the kernel of
    one row), among 9 (groups of 4) and among 40 (groups of 8, a second slice of 32 rows)."""
    inputs, attrs = matrix_op_inputs(name, np.random.default_rng(4), 40, 72, 6)
    op = registry.op(name)
    many = run_backend(op, "cuda", inputs, attrs)[0][0]
    few = run_backend(op, "cuda", tuple(x[:9] if x.ndim == 2 and x.shape[0] == 40 else x for x in inputs),
                      attrs)[0][0]
    assert np.array_equal(few, many[:9])
    for n in (4, 37):
        alone = run_backend(op, "cuda", tuple(x[n:n + 1] if x.ndim == 2 and x.shape[0] == 40 else x
                                              for x in inputs), attrs)[0][0]
        assert np.array_equal(alone[0], many[n])


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_read_back_gives_the_arrays_as_the_work_before_left_them(backend):
    """Backend.read_back's copies hold what the arrays held when it was called, not what later work
    writes (bf16 storage as float32 values). The CPU and the simulator copy at once; a GPU queues
    the copies, which its later work waits for."""
    be = registry.backend(backend)
    ids, values = be.asarray(np.arange(4)), be.asarray(np.array([0.5, -1.25]), storage="bf16")
    read = be.read_back([ids, values])
    be.copy_(ids, np.zeros(4, dtype=np.int64))
    be.copy_(values, np.zeros(2))
    host_ids, host_values = read()
    assert host_ids.tolist() == [0, 1, 2, 3]
    assert host_values.dtype == np.float32 and host_values.tolist() == [0.5, -1.25]


@pytest.mark.parametrize("eos", [None, 4])
@pytest.mark.parametrize("speculative", [False, True, None])
@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(1.0, top_k=5, top_p=0.9)])
def test_running_ahead_decodes_the_same_tokens(cycle_model, speculative, sampling, eos):
    """Running ahead (forced on the CPU, which computes a step when it is launched) decodes the tokens
    of one step after the other, plain, speculative or the policy's (told step times under which it
    speculates: its widths lag a step), greedy or sampled: over ragged prompts, the last filling the
    context (windows slide), to the token budget or to an end token that rows reach at different
    steps (tokens computed for them ahead are dropped). Forced modes run the same steps, plus one
    where the end token ended every row of a step run ahead; a call leaves no step in flight."""
    seeds = [7, 8, 9, 10]
    expected_stats, stats = DecodeStats(), DecodeStats()
    expected = decode(cycle_model, PROMPTS, 50, speculative, sampling, seeds, eos, expected_stats)
    decoder = Decoder(cycle_model, len(PROMPTS), speculative, sampling, run_ahead=True)
    decoder.policy.step_seconds = {(n, W): 1.0 for n in (1, 2, 4) for W in (1, 2, 3)}
    ahead = count_running_ahead(decoder)
    assert decoder.generate(PROMPTS, 50, seeds, eos, stats=stats) == expected
    assert any(ahead) and not all(ahead) and decoder._in_flight is None
    assert stats.tokens == expected_stats.tokens
    if speculative is not None:
        counted = ("row_steps", "proposed", "accepted")
        assert [getattr(stats, name) for name in counted] == [getattr(expected_stats, name) for name in counted]
        assert stats.steps - expected_stats.steps in ((0,) if eos is None else (0, 1))


def test_running_ahead_with_rows_admitted_and_retired_between_steps(cycle_model):
    """Rows driven one by one, as a server does, while the decoder runs ahead: a row admitted while a
    step is in flight, rows of different budgets and sampling, one ending at an end token, one
    retired while a step computed it and its row admitted again; each decodes what it decodes alone
    (the retired one, a beginning of it)."""
    greedy, sampled = Sampling(0.0), Sampling(1.0, top_k=5)
    decoder = Decoder(cycle_model, 4, True, run_ahead=True)
    ahead = count_running_ahead(decoder)
    # (row, prompt, seed, sampling, budget, eos)
    first = [(0, PROMPTS[0], 1, greedy, 30, None), (1, PROMPTS[2], 2, sampled, 40, None)]
    later = [(2, PROMPTS[1], 3, greedy, 20, 4), (3, PROMPTS[3], 4, sampled, 9, None)]
    again = (0, PROMPTS[1], 5, sampled, 12, None)
    rows = {}

    def admit(b, prompt, seed, sampling, budget, eos):
        rows[(b, seed)] = decoder.admit(b, prompt, seed, sampling, budget, eos), (prompt, seed, sampling, budget, eos)

    for plan in first:
        admit(*plan)
    decoder.step()
    assert decoder._in_flight is not None
    for plan in later:
        admit(*plan)
        decoder.step()
    assert decoder._in_flight is not None
    retired = decoder.retire(0)
    admit(*again)
    while decoder.active_rows():
        decoder.step()
    assert sum(ahead) >= 5
    for row, (prompt, seed, sampling, budget, eos) in rows.values():
        alone = decode(cycle_model, [prompt], budget, True, sampling, [seed], eos)[0]
        if row is retired:
            assert 0 < len(row.new) < budget and row.new == alone[:len(row.new)]
        else:
            assert row.new == alone and row.finish_reason == ("stop" if eos is not None else "length")


def test_an_interrupted_generate_leaves_the_decoder_usable(cycle_model):
    """Ctrl-C while the decoder runs ahead (here from on_token, as a step's results are taken): the
    call frees its rows and leaves no step in flight, and the next call decodes as a new decoder."""
    decoder = Decoder(cycle_model, len(PROMPTS), True, Sampling(0.0), run_ahead=True)
    kept = []

    def interrupt(row, token):
        kept.append(token)
        if len(kept) == 30:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        decoder.generate(PROMPTS, 20, [0, 1, 2, 3], on_token=interrupt)
    assert decoder._in_flight is None and decoder.free_rows() == [0, 1, 2, 3]
    assert decoder.generate(PROMPTS, 20, [0, 1, 2, 3]) == decode(cycle_model, PROMPTS, 20, True)


# ------------------------------------------------------------------------------------------------
# text API and command line


@pytest.fixture(scope="module")
def text_model(tok):
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=48,
                      ctx_len=40, n_mtp=3)
    return Model(cfg, backend="cpu", seed=5)


def test_text_api(text_model, tok):
    model = text_model
    assert generate(model, tok, "It was", max_new_tokens=12, temperature=0.9, seed=4) == \
        nanoeuler_core.generate(model, tok, "It was", max_new_tokens=12, temperature=0.9, seed=4)   # reproducible
    prompts = ["It was", "Add 2 and 3", ""]
    batch = nanoeuler_core.generate_batch(model, tok, prompts, max_new_tokens=12, temperature=0.9, seed=4)
    assert batch == [generate(model, tok, p, max_new_tokens=12, temperature=0.9, seed=4 + i)
                     for i, p in enumerate(prompts)]
    pieces = []
    assert generate(model, tok, "It", max_new_tokens=10, temperature=0.0, on_text=pieces.append) == "".join(pieces)
    stats = DecodeStats()
    greedy = generate(model, tok, "It", max_new_tokens=60, temperature=0.0, stop_at_eos=False, speculative=True,
                      stats=stats)
    assert greedy == generate(model, tok, "It", max_new_tokens=60, temperature=0.0, stop_at_eos=False,
                              speculative=False)
    assert stats.tokens == 60 and stats.speculative and "proposals accepted" in stats.line()


def test_errors(text_model, tok):
    model = text_model
    with pytest.raises(ValueError, match="longer than the model's context of 40 tokens"):
        generate(model, tok, "word " * 60)
    with pytest.raises(ValueError, match="prompt 1 is"):
        generate_batch(model, tok, ["ok", "word " * 60])
    with pytest.raises(ValueError, match="no prompts"):
        generate_batch(model, tok, [])
    with pytest.raises(ValueError, match="needs .* GiB .* generate fewer rows"):
        decoder_for(model, 10**8, False, Sampling())
    single = Model(ModelConfig(**{**model.cfg.to_dict(), "n_mtp": 1}), backend="cpu")
    with pytest.raises(ValueError, match="n_mtp = 1"):
        generate(single, tok, "It", speculative=True)
    assert isinstance(generate(single, tok, "It", max_new_tokens=3), str)   # the default falls back to plain


def test_generate_command(tok, tmp_path):
    from finetune_helpers import make_base_run
    from nanoeuler_core.cli import app

    run = make_base_run(tmp_path / "run", tok, seed=5, ctx_len=40, n_mtp=3)
    runner = CliRunner()
    args = ["generate", str(run), "It was", "--max-new-tokens", "8", "--temperature", "0"]
    plain = runner.invoke(app, args + ["--no-speculative"])
    speculative = runner.invoke(app, args + ["--speculative"])
    assert plain.exit_code == 0 and speculative.exit_code == 0, plain.output
    assert plain.stdout == speculative.stdout and plain.stdout.startswith("It was")
    assert "tokens/s" in plain.stderr and "proposals accepted" in speculative.stderr
    several = runner.invoke(app, ["generate", str(run), "It", "--max-new-tokens", "6", "--num-samples", "3",
                                  "--seed", "1"])
    assert several.exit_code == 0 and several.stdout.count("\n---\n") == 2
    model = Model.load(run)
    assert several.stdout.split("\n---\n")[1] == "It" + generate(model, tok, "It", max_new_tokens=6, seed=2)
    for bad, message in ((["--num-samples", "0"], "--num-samples must be at least 1"),
                         (["--temperature", "-1"], "temperature")):
        result = runner.invoke(app, ["generate", str(run), "It", *bad])
        assert result.exit_code != 0 and message in str(result.exception)
    long = runner.invoke(app, ["generate", str(run), "word " * 60])
    assert long.exit_code != 0 and "longer than the model's context" in str(long.exception)


def test_warm_up_captures_every_prefill_length(cycle_model, monkeypatch):
    """Where the backend captures, `warm_up` also captures the prefill of every length a prompt is
    padded to (here 16 and the context, 24), so that no prompt pays for a capture later; padded
    prompts decode as unpadded ones do."""
    model = on_backend(cycle_model, "cpu")
    unpadded = decode(model, PROMPTS, 8, speculative=False)   # the CPU backend does not capture
    monkeypatch.setattr(type(model.backend), "captures", True)
    captured = []
    capture = model.backend.capture
    monkeypatch.setattr(model.backend, "capture", lambda fn: captured.append(fn) or capture(fn))
    decoder = Decoder(model, len(PROMPTS), speculative=False)
    decoder.warm_up()
    after_warm_up = len(captured)
    assert decoder.generate(PROMPTS, 8, list(range(len(PROMPTS)))) == unpadded
    assert len(captured) == after_warm_up
