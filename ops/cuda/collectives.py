"""Collectives over NCCL (nccl4py) on CUDA device arrays, one GPU per rank; host arrays over MPI.

Device collectives go to the stream the backend's kernels go to at that moment (the graph
builder's stream while the training step is captured, so they replay with the graph), or, for
the `*_async` ones, to a communication stream of their own: it first waits for the work queued so
far (an event), runs the collective, and `wait()` makes the kernels' stream wait for it in turn.
Inside a capture those events become the graph's edges, and the collectives run beside the rest
of the backward.

ZeRO-2's reduce onto a shard's owner adds the sum into the owner's gradient shard (`into`) by a
kernel queued after it on the communication stream; `mark` records an event there, which
`wait_for` makes the kernels' stream wait for: the backward reuses a bucket's memory once the
sums that read it are done, not waiting for the later ones.

A sum in bfloat16 (`wire`) runs on the communication stream too: a kernel rounds the float32
values into the bf16 buffer, NCCL sums that buffer in place (ncclBfloat16), and a kernel writes
the sums back as float32. nccl4py's Communicator reads a buffer's type from its array interface,
which has no bfloat16, so these calls go to its bindings with the type given.

The exposed communication is timed by two CUDA events on the kernels' stream: one where the
backward ends (`backward_done`), one after `wait()` has joined the communication stream. Inside a
capture they are recorded as the graph's own event nodes (CU_EVENT_RECORD_EXTERNAL), so every
replay records them again.
"""

from nanoeuler_core.collectives import MpiCollectives, shard

INSTALL_HINT = "pip install 'nanoeuler[cuda,dist-cuda]'"


class NcclCollectives:
    def __init__(self, comm, backend):
        try:
            import nccl.core as nccl
            from nccl.bindings import nccl as bindings
        except ImportError:
            raise ValueError(f"the cuda backend under mpiexec needs nccl4py: {INSTALL_HINT}") from None
        from cuda.bindings import driver as cu
        from numba import cuda

        self.nccl, self.bindings, self.cu, self.backend, self.cuda = nccl, bindings, cu, backend, cuda
        self.host = MpiCollectives(comm)
        self.rank, self.size = self.host.rank, self.host.size
        uid = comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.comm = nccl.Communicator.init(self.size, self.rank, uid)
        self.side = cuda.stream()
        self._forked = cuda.event(timing=False)
        self._joined = cuda.event(timing=False)
        self._pending = False
        self._timing = [_checked(cu, cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT), "creating a CUDA event")
                        for _ in range(2)]   # [backward done, sums done]

    def all_reduce_sum(self, buf) -> None:
        self.comm.allreduce(buf, buf, self.nccl.SUM, stream=self.backend.stream_handle())

    def reduce_scatter_sum(self, buf) -> None:
        lo, hi = shard(buf.size, self.rank, self.size)
        self.comm.reduce_scatter(buf, buf[lo:hi], self.nccl.SUM, stream=self.backend.stream_handle())  # in place

    def all_gather(self, buf) -> None:
        lo, hi = shard(buf.size, self.rank, self.size)
        self.comm.allgather(buf[lo:hi], buf, stream=self.backend.stream_handle())  # in place

    def all_reduce_sum_async(self, buf, wire=None) -> None:
        stream = self._fork()
        if wire is None:
            self.comm.allreduce(buf, buf, self.nccl.SUM, stream=stream)
        else:
            self._in_bf16(buf, wire, lambda ptr: self.bindings.all_reduce(
                ptr, ptr, wire.size, int(self.nccl.BFLOAT16), int(self.nccl.SUM), self._nccl_comm(), stream))

    def reduce_sum_async(self, buf, root: int, wire=None, into=None) -> None:
        stream = self._fork()
        if wire is None:
            self.comm.reduce(buf, buf, self.nccl.SUM, root, stream=stream)
        else:
            self._in_bf16(buf, wire, lambda ptr: self.bindings.reduce(
                ptr, ptr, wire.size, int(self.nccl.BFLOAT16), int(self.nccl.SUM), root, self._nccl_comm(), stream))
        if into is not None:   # into += the sum, after it on the communication stream
            from nanoeuler_ops.cuda import add, runtime

            with runtime.on_stream(self.side, capturing=runtime.capturing()):   # the add op's kernel, in place
                runtime.launch(add._add, runtime.blocks_for(into.size, add.THREADS), add.THREADS, into, buf, into)

    def wait(self) -> None:
        if self._pending:
            self._joined.record(self.side)
            self._joined.wait(self._main())
            self._pending = False
        self._record(self._timing[1])

    def mark(self, marker=None):
        marker = marker or self.cuda.event(timing=False)
        marker.record(self.side)
        return marker

    def wait_for(self, marker) -> None:
        marker.wait(self._main())

    def backward_done(self) -> None:
        self._record(self._timing[0])

    def exposed_ms(self) -> float:
        cu = self.cu
        _checked(cu, cu.cuEventSynchronize(self._timing[1]), "waiting for a CUDA event")
        return float(_checked(cu, cu.cuEventElapsedTime(*self._timing), "timing CUDA events"))

    def host_sum(self, values):
        return self.host.host_sum(values)

    def host_concat(self, values):
        return self.host.host_concat(values)

    def _in_bf16(self, buf, wire, collective) -> None:
        """On the communication stream: wire <- buf rounded to bf16, collective(wire's address)
        summing it in place, buf <- wire as float32."""
        from nanoeuler_ops.cuda import runtime

        with runtime.on_stream(self.side, capturing=runtime.capturing()):
            runtime.copy(wire, buf)
            collective(wire.device_ctypes_pointer.value)
            runtime.copy(buf, wire)

    def _nccl_comm(self):
        """The bindings' handle of the communicator (what nccl4py's own methods pass them)."""
        return self.comm._comm

    def _main(self):
        """The stream the kernels go to now, as a Numba stream."""
        handle = self.backend.stream_handle()
        return self.cuda.external_stream(handle) if handle else self.cuda.default_stream()

    def _fork(self) -> int:
        """The communication stream's handle, after making it wait for the kernels queued so far."""
        self._forked.record(self._main())
        self._forked.wait(self.side)
        self._pending = True
        return int(self.side)

    def _record(self, event) -> None:
        """Record a timing event on the kernels' stream: a node of the graph while capturing."""
        from nanoeuler_ops.cuda import runtime

        cu, handle = self.cu, self.backend.stream_handle()
        if runtime.capturing():
            result = cu.cuEventRecordWithFlags(event, handle, cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
        else:
            result = cu.cuEventRecord(event, handle)
        _checked(cu, result, "recording a CUDA event")


def _checked(cu, result, what: str):
    """A cuda.bindings call's value, or RuntimeError naming `what` if it failed."""
    err, *value = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return value[0] if value else None
