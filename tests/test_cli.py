"""Commands as a user runs them: `nanoeuler-run ops`, `gradcheck` and `bench`; the errors of
`generate`, `chat`, `sft` and `export` a user can cause (one line on stderr, exit status 1, nothing
on stdout), an operating system's among them."""

import errno
import json
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from typer.testing import CliRunner

from nanoeuler_core import registry
from nanoeuler_core.cli import app
from nanoeuler_core.errors import one_line
from nanoeuler_core.registry import Impl, Op, Sample
from finetune_helpers import make_base_run

no_gpu = pytest.mark.skipif(not numba.config.ENABLE_CUDASIM, reason="a real GPU: cuda is usable without --simulate")


def run(*args, input=None, env=None):
    return subprocess.run([sys.executable, "-m", "nanoeuler_core.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=600, input=input, env=env)


def run_without_simulator(*args):
    """The command as a user without a GPU starts it: Numba's CUDA simulator off."""
    return run(*args, env={k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"})


def assert_one_line_error(result, message):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
        result.stderr


def test_ops_lists_every_op_with_backends_and_package():
    result = run("ops")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:-1]}
    assert set(lines) == set(registry.ops())
    assert "nanoeuler-gelu" in lines["gelu"]
    assert "reference* cpu*" in lines["attention"]


def test_gradcheck_passes_and_prints_the_model_table():
    result = run("gradcheck", "--backend", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gradcheck passed" in result.stdout
    assert "ok   tok_emb:" in result.stdout and "ok   heads.3:" not in result.stdout  # the tiny model has 2 heads
    assert "== model, tied embeddings (float64 reference)" in result.stdout
    for name in registry.ops():
        assert f"ok   {name} " in result.stdout


def test_gradcheck_unknown_backend_is_one_line():
    result = run("gradcheck", "--backend", "tpu")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: unknown backend 'tpu' (choose from: cpu, cuda, reference)"]


@no_gpu
def test_gradcheck_says_what_it_checked_and_skipped_and_simulate_adds_cuda():
    plain = run_without_simulator("gradcheck", "--op", "add")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "cpu: checked\n" in plain.stdout
    assert "cuda: skipped, not usable here (it needs an NVIDIA GPU" in plain.stdout
    assert "--simulate runs its kernels on Numba's CUDA simulator, slowly" in plain.stdout
    assert "refuses 2 error inputs on reference, cpu\n" in plain.stdout
    assert "== model: not checked (--op checks the ops named; add --model" in plain.stdout
    assert "also in" not in plain.stdout   # add's bf16 runs on cuda alone
    assert plain.stdout.splitlines()[-1] == \
        "gradcheck passed: 1 op (add) in fp32 on reference, cpu; not checked: cuda (not usable here; --simulate)"

    simulated = run_without_simulator("gradcheck", "--op", "add", "--simulate")
    assert simulated.returncode == 0, simulated.stdout + simulated.stderr
    assert "cuda: checked on Numba's CUDA simulator" in simulated.stdout
    assert "(cpu/cuda, reference/cpu, reference/cuda, reference/finite diff)" in simulated.stdout
    assert "refuses 2 error inputs on reference, cpu, cuda" in simulated.stdout
    assert "also in bf16: add (--precision bf16 checks it)" in simulated.stdout
    assert simulated.stdout.splitlines()[-1] == "gradcheck passed: 1 op (add) in fp32 on reference, cpu, cuda"


@no_gpu
def test_gradcheck_in_a_precision_nothing_here_runs_is_one_line():
    assert_one_line_error(run_without_simulator("gradcheck", "--precision", "bf16"),
                          "nothing to check in bf16: no backend usable here runs it (cuda: not usable here")


def test_gradcheck_of_an_unknown_op_lists_the_ops_in_one_line():
    assert_one_line_error(run("gradcheck", "--op", "add", "--op", "relu"),
                          f"no op named 'relu' (registered: {', '.join(sorted(registry.ops()))})")


def test_gradcheck_of_an_op_and_the_model_on_one_backend():
    result = CliRunner().invoke(app, ["gradcheck", "--op", "swiglu", "--op", "gelu", "--backend", "cpu", "--model"])
    assert result.exit_code == 0, result.output
    assert "cuda: not asked (--backend cpu)" in result.output
    assert [line.split()[1] for line in result.output.splitlines() if line.startswith("ok   ") and "checks (" in line] \
        == ["swiglu", "gelu"]
    assert "== model: cpu backend in fp32 vs reference" in result.output
    assert result.output.splitlines()[-1].startswith(
        "gradcheck passed: 2 ops (swiglu, gelu) in fp32 on reference, cpu; "
        "the model's gradients: float64 vs finite differences, cpu vs")


def test_gradcheck_failing_at_a_kink_names_the_step_bounds_and_the_usual_cause(monkeypatch):
    def sample_inputs(rng):
        yield Sample((np.array([-1.0, 0.0, 2.0]),), grad_inputs=(0,), name="at_0")

    relu = Op("relu", "max(x, 0)", Impl(lambda x: (np.maximum(x, 0.0), ()), lambda dy, saved, x: (dy * (x > 0),)),
              sample_inputs)
    monkeypatch.setitem(registry.REGISTRY._ops, "relu", relu)
    result = CliRunner().invoke(app, ["gradcheck", "--op", "relu"])
    assert result.exit_code == 1
    failed = [line for line in result.output.splitlines() if line.startswith("  FAIL relu")]
    assert len(failed) == 1 and "reference vs finite diff grad x0" in failed[0]
    assert failed[0].endswith("(finite differences with step 1e-06, bound 1e-07 + 1e-05 |numeric|: usually a sample "
                              "within a step of a kink (e.g. relu at 0): keep samples away from kinks)")
    assert "cpu: skipped, lacks op relu" in result.output


def test_bench_times_training_and_decoding():
    train = run("bench", "--preset", "small", "--batch-size", "2", "--steps", "1", "--warmup", "1", "--no-peers")
    assert train.returncode == 0, train.stderr
    assert "tokens/s" in train.stdout
    decode = run("bench", "--generate", "--preset", "small", "--prompt-tokens", "4", "--new-tokens", "8",
                 "--prefill-tokens", "32", "--steps", "1", "--no-peers")
    assert decode.returncode == 0, decode.stderr
    rows = {line.split("  ")[0]: line.split() for line in decode.stdout.splitlines() if line.startswith("nanoeuler")}
    assert set(rows) == {"nanoeuler plain", "nanoeuler speculative", "nanoeuler default"}
    assert all(row[-1] == "8/8" for row in rows.values())  # greedy: the same tokens whatever the mode
    assert "speculative: fp32 weights" in decode.stdout and "default: fp32 weights" in decode.stdout
    assert "proposals 1..3 kept where reached: " in decode.stdout   # the forced speculative run judged some
    assert "prefill, 32-token prompt x 1: nanoeuler plain " in decode.stdout
    assert "bandwidth, plain: " in decode.stdout and " GB/s" in decode.stdout


def test_bench_decodes_a_model_with_one_head_plainly(tmp_path, tok):
    """An imported model has no multi-token heads: bench runs plain decoding and says why alone."""
    from nanoeuler_core import Model, ModelConfig

    model = Model(ModelConfig.preset("small", vocab_size=tok.vocab_size, n_mtp=1), seed=0)
    model.save(tmp_path / "run")
    tok.save(tmp_path / "run" / "tokenizer.json")
    decode = run("bench", "--generate", "--run", str(tmp_path / "run"), "--prompt-tokens", "4", "--new-tokens", "8",
                 "--prefill-tokens", "16", "--steps", "1", "--no-peers")
    assert decode.returncode == 0, decode.stderr
    rows = [line.split("  ")[0] for line in decode.stdout.splitlines() if line.startswith("nanoeuler")]
    assert rows == ["nanoeuler plain"]
    assert "plain decoding only: the model has one head" in decode.stdout
    assert "prefill, 16-token prompt x 1: nanoeuler plain " in decode.stdout


def test_bench_prompts_come_from_either_end_of_the_corpus(tok):
    from nanoeuler_core.bench.generation import bench_prompt
    from nanoeuler_core.corpus.tokens import default_corpus

    text = default_corpus().read_text(encoding="utf-8")
    assert bench_prompt(None, tok, 12, "training") == tok.encode(text[:480])[:12]
    held_out = tok.decode(bench_prompt(None, tok, 12, "held-out"))
    assert held_out and text.rindex(held_out) > len(text) * 0.95


def test_bench_prompts_come_from_the_corpus_the_run_trained_on(tmp_path, tok):
    from nanoeuler_core.bench.generation import bench_prompt

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def first():\n    return 1\n\n" * 40 + "class Last:\n    pass\n\n" * 4, encoding="utf-8")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"training": {"corpus": str(corpus)}}), encoding="utf-8")
    assert tok.decode(bench_prompt(None, tok, 4, "training", str(run_dir))).startswith("def")
    assert tok.decode(bench_prompt(None, tok, 4, "held-out", str(run_dir))).startswith("class")
    corpus.unlink()
    result = run("bench", "--generate", "--run", str(run_dir))
    assert result.returncode == 1 and result.stderr.strip().endswith("which is missing: the prompts come from it")


def test_bench_errors_are_one_line(tmp_path):
    cases = [(("--generate", "--precision", "bf16"), "use fp32 weights"),
             (("--generate", "--run", str(tmp_path)), "is not a nanoeuler run directory"),
             (("--generate", "--new-tokens", "0"), "positive --prompt-tokens, --new-tokens and --prefill-tokens"),
             (("--generate", "--prompt-from", "elsewhere"), "--prompt-from must be one of held-out, training"),
             (("--steps", "0",), "positive --steps")]
    for args, message in cases:
        result = run("bench", *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and message in lines[0], (args, result.stderr)


# ------------------------------------------------------------------------------------------------
# generate, chat, sft


@pytest.fixture
def base_run(tmp_path, tok):
    return make_base_run(tmp_path / "run", tok)  # a context of 96 tokens


def test_generate_refuses_a_prompt_longer_than_the_context_before_printing_it(base_run):
    result = run("generate", base_run, "It was the best of times. " * 40)
    assert result.stdout == ""
    assert_one_line_error(result, "longer than the model's context of 96 tokens")


def test_chat_template_errors_are_one_line(base_run, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    no_system = tmp_path / "no_system.jinja"
    no_system.write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    one_turn = tmp_path / "one_turn.jinja"
    one_turn.write_text("{% if messages | length > 1 %}{{ raise_exception('one turn only') }}{% endif %}"
                        "Q: {{ messages[0]['content'] }}\nA:")
    chat = ("chat", base_run, "--temperature", "0", "--max-new-tokens", "3")
    cases = [
        ((*chat, "--template", tmp_path / "missing.jinja"), f"chat template file {tmp_path}/missing.jinja not found"),
        ((*chat, "--template", broken), f"{broken} is not a valid Jinja template (line 1: "),
        ((*chat, "--template", no_system, "--system", "Be brief."),
         "refused the conversation: System role not supported"),
        ((*chat, "--template", "alpaca", "--system", "Be brief."), "the Alpaca template has none"),
        ((*chat, "--system", "Be brief."), "has no chat template, so no system message: pass --template"),
        (("sft", "--base", base_run, "--out", tmp_path / "sft", "--template", broken), "is not a valid Jinja template"),
    ]
    for args, message in cases:
        result = run(*args, input="Hi\n")
        assert result.stdout == "", (args, result.stdout)
        assert_one_line_error(result, message)
    assert not (tmp_path / "sft").exists()

    # a template that refuses the conversation later, when the second message comes
    result = run(*chat, "--template", one_turn, input="Hi\nAgain\n")
    assert result.returncode == 1 and result.stdout.count("\n") == 1  # the first reply
    assert result.stderr.strip().splitlines()[-1] == f"error: {one_turn} refused the conversation: one turn only"
    assert "Traceback" not in result.stderr


def test_an_operating_systems_errors_are_sentences(base_run, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    result = run("export", base_run, a_file)
    assert result.stdout == ""
    assert_one_line_error(result, f"{a_file} exists and is not a directory: choose another path, or move it away")
    assert_one_line_error(run("export", base_run, a_file / "hf"),
                          f"{a_file / 'hf'} has a file where its path needs a directory: choose another path")
    sft = run("sft", "--base", base_run, "--out", a_file, "--steps", "1")
    assert sft.returncode == 1 and sft.stderr.splitlines()[-1] == \
        f"error: {a_file} exists and is not a directory: choose another path, or move it away"
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe{}")
    assert_one_line_error(run("sft", "--base", base_run, "--data", binary, "--steps", "1"),
                          f"data file {binary} is not UTF-8 text (byte 0): convert it to UTF-8 first")


@pytest.mark.parametrize("exc, line", [
    (PermissionError(errno.EACCES, "Permission denied", "/data/run"),
     "/data/run cannot be used: permission denied: choose a path you may read and write, or change its permissions"),
    (OSError(errno.ENOSPC, "No space left on device", "run/model.safetensors"),
     "run/model.safetensors cannot be written: the disk is full: free some space, or choose another disk"),
    (OSError(errno.EIO, "Input/output error", "run/x"), "run/x: Input/output error: check the path and try again"),
    (OSError(errno.EINVAL, "Invalid argument"),
     "the operating system refused an operation: Invalid argument (run again with NANOEULER_DEBUG=1 to see where)"),
    (OSError("cannot listen on 127.0.0.1:8000 (Address in use): pass another --port"),
     "cannot listen on 127.0.0.1:8000 (Address in use): pass another --port"),
    (ZeroDivisionError("float division by zero"),
     "a computation failed (ZeroDivisionError: float division by zero): run again with NANOEULER_DEBUG=1 to see where"),
    (FloatingPointError("loss became nan at step 3: lower --lr or check the data"),
     "loss became nan at step 3: lower --lr or check the data"),
])
def test_the_line_printed_for_an_error(exc, line):
    assert one_line(exc) == line


def test_a_run_fine_tuned_in_an_unknown_template_is_one_line(base_run):
    config = json.loads((base_run / "config.json").read_text())
    config["training"]["template"] = "vicuna"
    (base_run / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run("chat", base_run, input="Hi\n"), "fine-tuned with template 'vicuna'")
