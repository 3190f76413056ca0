"""What the training and decoding benchmarks measure with: memory in use, and each engine run in
a fresh process of its own (separate thread pools, compilation caches and peak memory)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys


def peak_rss_mb() -> float:
    """This process's peak resident set, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_mb(backend) -> float:
    """Memory in use: the device's (total - free, the figure nvidia-smi shows) where the backend
    has device memory, else this process's peak resident set."""
    in_use = backend.memory_in_use()
    return in_use / 2**20 if in_use is not None else peak_rss_mb()


def run_worker(args: dict, module: str) -> dict | None:
    """Run `module` as a script in a fresh process with the JSON `args`; its last output line, parsed."""
    import nanoeuler_core

    env = dict(os.environ)
    first = ""
    if args["engine"] in ("torch", "transformers"):
        # nanoeuler_core's import tunes OpenMP's idle threads for Numba: a peer keeps its own defaults
        for name in nanoeuler_core.THREAD_ENV_SET_HERE:
            env.pop(name, None)
        first = "import torch; "
    code = first + f"import runpy; runpy.run_module('{module}', run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, env=env)
    if out.returncode:
        print(f"{args['engine']} worker failed: {out.stderr.strip()[-1500:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])
