"""CUDA graphs: a step of dozens of small kernels captured once and replayed as one launch.

A graph bakes in the address of every buffer it touches, so the function runs once eagerly while
the arena records each buffer it hands out, then again inside the capture while the arena hands
the same buffers back in the same order (ops/cuda/runtime.py). docs/cuda.md says more.
"""

from __future__ import annotations

from nanoeuler_ops.cuda import cublas, runtime
from nanoeuler_ops.cuda.device import DEVICE


def capture(fn):
    """Run fn() once while the arena records its buffers, then capture it as a CUDA graph over the
    same buffers. Returns (replay, result): replay() launches the graph and returns the same
    `result` objects, now holding the new values. On a device without graphs (the simulator),
    replay is fn itself."""
    on_device = DEVICE.graph_builder()
    if on_device is None:
        return fn, fn()
    builder, stream = on_device
    with runtime.ARENA.recording() as buffers:
        result = fn()
    if cublas.uses_cublas():
        cublas.handle_for(int(builder.stream.handle))   # cuBLAS's work joins the graph
    builder.begin_building()
    with runtime.on_stream(builder, capturing=True), runtime.ARENA.replaying():
        fn()
    graph = builder.end_building().complete()

    def replay(buffers=buffers):  # the graph reads and writes these: keep them alive with it
        graph.launch(stream)
        return result

    return replay, result
