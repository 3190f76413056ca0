"""Collectives over NCCL (nccl4py) on CUDA device arrays, one GPU per rank; host arrays over MPI.

Device collectives go to the stream the backend's kernels go to at that moment (the graph
builder's stream while the training step is captured, so they replay with the graph), or, for
the `*_async` ones, to a communication stream of their own: it first waits for the work queued so
far (an event), runs the collective, and `wait()` makes the kernels' stream wait for it in turn.
Inside a capture those events become the graph's edges, and the collectives run beside the rest
of the backward.
"""

from nanoeuler_core.collectives import MpiCollectives, shard

INSTALL_HINT = "pip install 'nanoeuler[cuda,dist-cuda]'"


class NcclCollectives:
    def __init__(self, comm, backend):
        try:
            import nccl.core as nccl
        except ImportError:
            raise ValueError(f"the cuda backend under mpiexec needs nccl4py: {INSTALL_HINT}") from None
        from numba import cuda

        self.nccl, self.backend, self.cuda = nccl, backend, cuda
        self.host = MpiCollectives(comm)
        self.rank, self.size = self.host.rank, self.host.size
        uid = comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.comm = nccl.Communicator.init(self.size, self.rank, uid)
        self.side = cuda.stream()
        self._forked = cuda.event(timing=False)
        self._joined = cuda.event(timing=False)
        self._pending = False

    def all_reduce_sum(self, buf) -> None:
        self.comm.allreduce(buf, buf, self.nccl.SUM, stream=self.backend.stream_handle())

    def reduce_scatter_sum(self, buf) -> None:
        lo, hi = shard(buf.size, self.rank, self.size)
        self.comm.reduce_scatter(buf, buf[lo:hi], self.nccl.SUM, stream=self.backend.stream_handle())  # in place

    def all_gather(self, buf) -> None:
        lo, hi = shard(buf.size, self.rank, self.size)
        self.comm.allgather(buf[lo:hi], buf, stream=self.backend.stream_handle())  # in place

    def all_reduce_sum_async(self, buf) -> None:
        self.comm.allreduce(buf, buf, self.nccl.SUM, stream=self._fork())

    def reduce_sum_async(self, buf, root: int) -> None:
        self.comm.reduce(buf, buf, self.nccl.SUM, root, stream=self._fork())

    def wait(self) -> None:
        if self._pending:
            self._joined.record(self.side)
            self._joined.wait(self._main())
            self._pending = False

    def host_sum(self, values):
        return self.host.host_sum(values)

    def host_concat(self, values):
        return self.host.host_concat(values)

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
