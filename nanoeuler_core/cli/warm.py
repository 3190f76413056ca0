"""A run's kernels compiled ahead, in a second process, when it starts on a cold kernel cache.

A backend whose kernels compile on first use into a cache on disk (the CPU's Numba kernels)
compiles the tokenizer's, the training step's and decoding's kernels one after another on one
core the first time a run starts on a machine: most of a small run's first half-minute.
`KernelWarmer` runs the same kernels in a child process, on a one-layer model of the run's preset
(the training step and validation first, then decoding with the run's sampling), so that they
compile on another core while the run trains its tokenizer. The run waits for the child before
its first step and before its sample (the child is then compiling what the run would compile
next) and carries on alone if the child fails. It is started only on a cold cache, with a second
core to run on, and unless NANOEULER_COMPILE_AHEAD=0.

    python -m nanoeuler_core.cli.warm PRESET BACKEND PRECISION RECOMPUTE CAPTURE TEMPERATURE TOP_K OPTIMIZER
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import subprocess
import sys

import numpy as np

STEP_READY = "step kernels ready"
WAIT_SECONDS = 600   # the longest the run waits for the child at each point (a cold cache takes ~20 s)
SWITCH = "NANOEULER_COMPILE_AHEAD"   # 0: never start the child


def wanted() -> bool:
    """Whether a run may compile ahead: a second core to do it on, and NANOEULER_COMPILE_AHEAD not 0."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return os.environ.get(SWITCH, "1") != "0" and cores > 1


class KernelWarmer:
    """The child process compiling a run's kernels (a context manager: it is stopped at the exit);
    `wait_for_step()` before the first step, `wait_for_decoding()` before generating."""

    def __init__(self, preset: str, backend: str, precision: str, recompute: bool, capture: bool,
                 temperature: float, top_k: int | None, optimizer: str = "adamw"):
        args = [preset, backend, precision, str(int(recompute)), str(int(capture)), repr(temperature), str(top_k or 0),
                optimizer]
        self.start([sys.executable, "-m", __name__, *args])

    def start(self, command: list[str]) -> None:
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)

    def wait_for_step(self) -> None:
        """Until the child has compiled the training step's kernels, has failed, or WAIT_SECONDS."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if selector.select(WAIT_SECONDS):
                self.process.stdout.readline()   # the ready line, or "" if the child ended

    def wait_for_decoding(self) -> None:
        """Until the child has compiled decoding's kernels (and ended), or WAIT_SECONDS."""
        try:
            self.process.wait(WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "KernelWarmer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()


def warm(preset: str, backend: str, precision: str, recompute: bool, capture: bool, temperature: float,
         top_k: int, optimizer: str) -> None:
    """Run a run's kernels once on a one-layer model of its preset: a training step and a validation
    loss, then (after printing STEP_READY) a few sampled tokens."""
    from nanoeuler_core.engine.config import ModelConfig
    from nanoeuler_core.engine.model import Model
    from nanoeuler_core.engine.optim import make_optimizer
    from nanoeuler_core.inference.decoder import Sampling, decoder_for
    from nanoeuler_core.training.step import TrainStep

    cfg = dataclasses.replace(ModelConfig.preset(preset), n_layers=1)
    model = Model(cfg, backend=backend, seed=0, precision=precision, recompute=recompute)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.ctx_len + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    TrainStep(model, make_optimizer(optimizer, model), capture=capture).micro_batches([(inputs, targets)], 1e-3)
    model.head_losses(inputs, targets)
    print(STEP_READY, flush=True)
    decoder = decoder_for(model, 1, None, Sampling(temperature, top_k or None, None))
    decoder.generate([[0, 1, 2]], 4, [0], None, lambda row, token: None, None)


if __name__ == "__main__":
    preset, backend, precision, recompute, capture, temperature, top_k, optimizer = sys.argv[1:]
    warm(preset, backend, precision, recompute == "1", capture == "1", float(temperature), int(top_k), optimizer)
