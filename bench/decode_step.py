"""Where a decoding step's time goes on a GPU: the captured step replayed back to back (GPU time
alone), the step with its host work (the replay, the accepted counts and tokens copied back and
waited for), and steps as `generate` runs them (`Decoder.step`, running ahead where the backend
captures: the host's work hidden behind the next step), for a model of random weights (the
`gpu` preset unless told) decoding plain (one token per row and step) at rows R, with the plain
decoder or (--mode default) with the policy's, whose plain step reads a cache with room for
proposals; or (--width W) the policy's step of W tokens a row (the next token and W - 1
proposals), each row from position 200 (or half the context, if less); then a whole `generate` call of one new token (the
prompt's prefill and the first token: what a call costs outside its steps), with --host-profile
its Python profile. With --ncu, three replays between profiler start and stop, for Nsight
Compute to time each kernel (bench/ncu_kernels.py sums them). With --twice KERNEL (the CUDA
backend), that kernel is launched twice wherever the step launches it (each of these kernels
writes the same output from the same inputs again): the step's growth is what the kernel costs
inside the step, overlapped with its neighbours as it runs there, unlike Nsight Compute's
kernels one at a time.

    python bench/decode_step.py [--rows R] [--mode plain|default] [--width W] [--preset P --backend B] [--replay-only]
                                [--twice op.kernel ...]
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python bench/decode_step.py --ncu > kernels.csv && python bench/ncu_kernels.py kernels.csv 3
"""

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
from numba import cuda

from nanoeuler_core.bench.generation import load_weights
from nanoeuler_core.inference.decoder import Sampling, decoder_for

POSITION = 200   # where every row's next token goes (at most half the context)
STEPS = 50       # steps a timing runs


def kernel_name(kernel) -> str:
    """op.kernel: the module (the op) a compiled kernel comes from, and the kernel's name."""
    return f"{kernel.py_func.__module__.rsplit('.', 1)[-1]}.{kernel.py_func.__name__}"


def launch_twice(names: set) -> None:
    """Have the CUDA runtime launch each kernel named in `names` twice, back to back."""
    from nanoeuler_ops.cuda import runtime

    launch = runtime.launch

    def twice(kernel, *args, **kwargs):
        for _ in range(2 if kernel_name(kernel) in names else 1):
            launch(kernel, *args, **kwargs)

    runtime.launch = twice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--mode", choices=("plain", "default"), default="plain",
                        help="the plain decoder, or the policy's (its steps here: plain ones)")
    parser.add_argument("--width", type=int, default=1,
                        help="tokens a row per step: above 1, the policy's speculative step of that width")
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--ncu", action="store_true", help="profile three replays (run under ncu)")
    parser.add_argument("--host-profile", action="store_true", help="the Python profile of a one-token call")
    parser.add_argument("--replay-only", action="store_true", help="stop after the captured step's timings")
    parser.add_argument("--twice", nargs="+", default=[], metavar="OP.KERNEL",
                        help="launch these kernels twice (e.g. decode_attention.combine, linear_residual._forward_mma)")
    args = parser.parse_args()
    rows, width = args.rows, args.width
    if args.twice:
        launch_twice(set(args.twice))
    model, _ = load_weights(args.preset, None, args.backend)
    ctx = model.cfg.ctx_len
    position = min(POSITION, ctx // 2)
    plain = args.mode == "plain" and width == 1
    if not 1 <= width <= model.cfg.n_mtp:
        parser.error(f"--width must be 1 to the model's {model.cfg.n_mtp} heads")
    decoder = decoder_for(model, rows, False if plain else None, Sampling(0.0), None)
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, 16).tolist()
    decoder.generate([prompt] * rows, 32, list(range(rows)))   # compiles and captures the steps (the policy's: every width)
    decoder._set_width(width)
    # a captured step over the rows at this width (one per mailbox; either)
    replay = next(run for key, run in decoder.launcher.replays.items() if key[:2] == (rows, width))
    be = decoder.be
    if args.ncu:
        be.copy_(decoder.cache.pos, np.full(rows, position))
        cuda.profile_start()
        for _ in range(3):
            replay()
        be.synchronize()
        cuda.profile_stop()
        return
    for label, step in (("replay", replay), ("step with host work", lambda: decoder.launcher.run(rows, width))):
        times = []
        for _ in range(7):
            be.copy_(decoder.cache.pos, np.full(rows, position))
            be.synchronize()
            start = time.perf_counter()
            for _ in range(STEPS):
                step()
            be.synchronize()
            times.append((time.perf_counter() - start) / STEPS)
        print(f"{label}: {statistics.median(times) * 1e6:.1f} us a step ({rows} rows, width {width}, "
              f"median of 7 x {STEPS} steps)")
    if args.replay_only or width > 1:
        return
    seeds = list(range(rows))
    times = []
    for _ in range(7):   # rows admitted at `position`, each taking STEPS more tokens, one a step
        for b in range(rows):
            decoder.admit(b, np.resize(prompt, position).tolist(), b, Sampling(0.0), STEPS + 1)
        be.synchronize()
        start, steps = time.perf_counter(), 0
        while decoder.active_rows():
            decoder.step()
            steps += 1
        be.synchronize()
        times.append((time.perf_counter() - start) / steps)
        for b in range(rows):
            decoder.retire(b)
    print(f"steps as generate runs them{' (running ahead)' if decoder.run_ahead else ''}: "
          f"{statistics.median(times) * 1e6:.1f} us a step ({rows} rows, median of 7 x {STEPS} steps)")
    for length in (16, ctx - 1):
        long = np.resize(prompt, length).tolist()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            decoder.generate([long] * rows, 1, seeds)
            be.synchronize()
            times.append(time.perf_counter() - start)
        print(f"generate, {length}-token prompt, 1 new token: {statistics.median(times) * 1e3:.2f} ms (median of 7)")
    if args.host_profile:
        profile = cProfile.Profile()
        profile.runcall(decoder.generate, [prompt] * rows, 1, seeds)
        for order in ("cumulative", "tottime"):
            pstats.Stats(profile).sort_stats(order).print_stats(45)


if __name__ == "__main__":
    main()
