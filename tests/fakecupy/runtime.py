"""``cupy.cuda``'s runtime side: :class:`Device`, :class:`Stream` (and its graph capture),
:class:`Event`, memory hooks and pools, the runtime's calls and NCCL's all-reduce.
Part of :mod:`fakecupy.cupy`, which re-exports every name; its state lives there.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref

import numpy as np

from . import cupy as _c
from . import pool as _pool


class Device:
    """The one device of the stand-in."""

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise ValueError(f"fakecupy has one device (0), not {self.id}")

    def synchronize(self):
        _c._sync("synchronize")
        if _c._order is not None:
            _c._order.synchronized()

    def use(self):
        return self

    @property
    def mem_info(self):
        return (1 << 34, 1 << 34)

    @property
    def compute_capability(self):
        return "90"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Stream:
    null = ptds = None
    #: the next stream's handle: each stream has one of its own, never used again (an ``id`` may
    #: be, and the memory pool keeps a free-block arena per handle: :mod:`fakecupy.pool`)
    _handles = iter(range(0x5000_0000, 1 << 62, 0x100))

    #: handle -> stream, of the streams alive (the asynchronous mode asks which are blocking)
    _made: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.ptr = 0 if null else _c.PER_THREAD_STREAM if ptds else next(Stream._handles)
        self.non_blocking = bool(non_blocking)
        Stream._made[self.ptr] = self

    def begin_capture(self, mode=None, *, survey: bool = False):
        """Record what follows into a graph (see :data:`_capturing`) in ``mode`` (a
        ``runtime.streamCaptureMode*``; None: relaxed, CuPy's default). ``survey`` (the stand-in
        only): note every operation a capture would refuse (:attr:`Graph.refused`) instead of
        raising at the first."""
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if _c._capturing is not None:
            raise RuntimeError("fakecupy: a stream is already capturing")
        mode = _Runtime.streamCaptureModeRelaxed if mode is None else int(mode)
        if mode not in (_Runtime.streamCaptureModeGlobal, _Runtime.streamCaptureModeThreadLocal,
                        _Runtime.streamCaptureModeRelaxed):
            raise ValueError(f"fakecupy: unknown stream capture mode {mode}")
        _c._capturing = _c._Capture(self, survey, mode)

    def end_capture(self) -> _c.Graph:
        if _c._capturing is None or _c._capturing.stream is not self:
            raise RuntimeError("fakecupy: end_capture on a stream that is not capturing")
        capture, _c._capturing = _c._capturing, None
        capture.undo()
        graph = _c.Graph(capture.ops, capture.refused)
        graph.pool_allocations = capture.pool_allocations
        if _c._order is not None:
            _c._order.end_capture(capture, graph)
        return graph

    def is_capturing(self) -> bool:
        return _c._capturing is not None and _c._capturing.stream is self

    def record(self, event=None):
        """An event recorded on this stream (here all work is done when a call returns)."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self):
        _c._sync("synchronize")
        if _c._order is not None:
            _c._order.synchronized(self.ptr)

    def wait_event(self, event):
        """Work queued later waits for ``event`` (the asynchronous mode keeps the order: :data:`_order`)."""
        if _c._order is not None:
            _c._order.waited(self.ptr, event)

    def use(self):
        """This thread's current stream is this one (until another ``use`` or ``with``)."""
        _c._tls.stream = self
        _c._update_allocator()
        return self

    def __enter__(self):
        _c._tls.entered.append(_current_stream())
        return self.use()

    def __exit__(self, *exc):
        _c._tls.entered.pop().use()
        return False


def _current_stream() -> Stream:
    """``cupy.cuda.get_current_stream()``: the stream this thread made current last (``use``,
    or the innermost ``with stream:`` it is in), as CuPy keeps it per thread; in a thread that
    has made none current, the null stream (``Stream.ptds`` with :data:`_PTDS`)."""
    s = _c._tls.stream
    if s is not None:
        return s
    return Stream.ptds if _c._PTDS else Stream.null


@contextlib.contextmanager
def asynchronous():
    """``with asynchronous():`` each launch is queued on its stream and has run only once the host
    or its stream waited for it: a read of a result before that raises
    :class:`fakecupy.streams.ReadBeforeRunError` (see :mod:`fakecupy.streams`). It is the tracer
    while on (a tracer set before it is still told everything)."""
    from .streams import Order
    if _c._order is not None:
        yield _c._order
        return
    previous = _c.tracer
    _c._order = _c.tracer = Order(_c, previous)
    try:
        yield _c._order
    finally:
        _c._order, _c.tracer = None, previous


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()
        if _c._order is not None:
            _c._order.recorded(self, (_current_stream() if stream is None else stream).ptr)

    def synchronize(self):
        _c._sync("synchronize")
        if _c._order is not None:
            _c._order.event_done(self)


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events."""
    return (end._t - start._t) * 1e3


class MemoryHook:
    """``cupy.cuda.MemoryHook``: while one is registered (its ``with``, in this thread: CuPy's
    hooks are per thread, as its ``using_allocator``), every device array made
    from the pool is an allocation it hears of (``malloc_pre/postprocess``, the block rounded to
    512 bytes as CuPy's pool rounds it), and its free when the last array on that memory goes
    (``free_pre/postprocess``), as CuPy tells its hooks; memory from another allocator is not the
    pool's, and a hook does not hear of it."""
    name = "MemoryHook"

    def __enter__(self):
        _c._tls.hooks = _c._tls.hooks + (self,)
        _c._update_allocator()
        return self

    def __exit__(self, *exc):
        _c._tls.hooks = tuple(h for h in _c._tls.hooks if h is not self)
        _c._update_allocator()
        return False

    def malloc_preprocess(self, **kwargs):
        pass

    def malloc_postprocess(self, **kwargs):
        pass

    def free_preprocess(self, **kwargs):
        pass

    def free_postprocess(self, **kwargs):
        pass


def _current_stream_ptr() -> int:
    return _current_stream().ptr


def _malloc_refused(size: int) -> None:
    """A ``cudaMalloc`` of the pool now: refused from the capturing thread in the global and
    thread-local capture modes (from any thread in global mode), as CUDA refuses it."""
    c = _c._capturing
    if c is None or c.mode == _Runtime.streamCaptureModeRelaxed:
        return
    if c.mode == _Runtime.streamCaptureModeGlobal or c.thread == threading.get_ident():
        c.refuse(f"cudaMalloc of {size} bytes by the memory pool, whose arena for the current stream holds no free "
                 "block of that size (a block freed on another stream is not handed to this one)", "pool allocation")


class MemoryPool(_pool.MemoryPool):
    """``cupy.cuda.MemoryPool``: free blocks per stream (:mod:`fakecupy.pool`)."""

    def __init__(self, allocator=None):
        super().__init__(_current_stream_ptr, _malloc_refused)


def get_default_memory_pool():
    return _c._POOL


def get_default_pinned_memory_pool():
    return _c._PINNED_POOL


class _Runtime:
    CUDARuntimeError = RuntimeError
    CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14      # cudaDataType (as _Cublas's)
    streamCaptureModeGlobal, streamCaptureModeThreadLocal, streamCaptureModeRelaxed = 0, 1, 2
    streamPerThread = _c.PER_THREAD_STREAM

    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDeviceProperties(device):
        return {"name": b"fakecupy (NumPy stand-in)", "totalGlobalMem": 1 << 34, "major": 9, "minor": 0,
                "multiProcessorCount": 1, "maxThreadsPerBlock": 1024, "sharedMemPerBlock": 48 << 10,
                "sharedMemPerBlockOptin": 227 << 10}

    @staticmethod
    def runtimeGetVersion():
        return 12000

    @staticmethod
    def driverGetVersion():
        return 12000

    @staticmethod
    def deviceSynchronize():
        _c._sync("synchronize")
        if _c._order is not None:
            _c._order.synchronized()


class _Nccl:
    """``cupy.cuda.nccl``: NCCL's all-reduce as attn.training.distributed calls it.

    A communicator of one rank copies the send buffer to the receive buffer; one of several
    ranks needs the ranks to be MPI processes (``mpiexec``) and all-reduces over MPI's
    ``COMM_WORLD``, after checking that every rank was given the same unique id (what rank 0's
    broadcast must ensure). Buffers are device pointers (``a.data.ptr``), as in NCCL; the
    stand-in's device memory is host memory, so no transfer is counted."""
    NCCL_SUM = 0
    NCCL_FLOAT32, NCCL_FLOAT64 = 7, 8
    _DTYPES = {7: np.float32, 8: np.float64}

    @staticmethod
    def get_unique_id():
        import os
        return tuple(int(b) - 128 for b in os.urandom(128))      # NCCL's: 128 signed chars

    class NcclCommunicator:
        def __init__(self, ndev: int, commId, rank: int):
            self.ndev, self.rank_id, self._mpi = int(ndev), int(rank), None
            if self.ndev > 1:
                from mpi4py import MPI
                comm = MPI.COMM_WORLD
                if comm.Get_size() != self.ndev or comm.Get_rank() != self.rank_id:
                    raise RuntimeError(f"fakecupy nccl: rank {rank} of {ndev}, but MPI has rank "
                                       f"{comm.Get_rank()} of {comm.Get_size()}")
                if len(set(comm.allgather(tuple(commId)))) != 1:
                    raise RuntimeError("fakecupy nccl: the ranks were given different unique ids")
                self._mpi = (MPI, comm)

        def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int):
            import ctypes
            if op != _Nccl.NCCL_SUM:
                raise NotImplementedError("fakecupy nccl: only NCCL_SUM")
            dtype = np.dtype(_Nccl._DTYPES[datatype])

            def at(ptr):
                return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype=dtype)
            send, recv = at(sendbuf), at(recvbuf)
            if _c._order is not None:               # (not a kernel the tracer counts: the asynchronous mode's order)
                n = count * dtype.itemsize
                _c._order.launch(int(stream), "NCCL all-reduce", _c._spans(sendbuf, n), _c._spans(recvbuf, n))
            if self._mpi is None:
                if sendbuf != recvbuf:
                    recv[...] = send
                return
            MPI, comm = self._mpi
            comm.Allreduce(MPI.IN_PLACE if sendbuf == recvbuf else send, recv, op=MPI.SUM)
