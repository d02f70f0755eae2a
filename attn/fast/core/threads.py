"""Threads for the NumPy fast path: a pool of long-lived helper threads that run the parts
of a split batch at the same time, blocks with NumPy's BLAS on one thread, and the malloc
setting that keeps freed memory for the next step."""
from __future__ import annotations

import os
import queue
import threading

from ... import backend as B

#: Most threads the automatic choice uses: beyond a few, the GIL-bound Python part of a
#: step (a few thousand NumPy calls) would start to serialise them.
MAX_AUTO_WORKERS = 4


def default_workers() -> int:
    """How many parts the NumPy fast path splits a batch into: NumPy's BLAS threads (the
    cores the user gave the program), at most :data:`MAX_AUTO_WORKERS`; 1 where the BLAS
    threads cannot be read (and so cannot be lowered to 1 while the parts run)."""
    n = B.blas_threads()
    return 1 if n is None else max(1, min(n, MAX_AUTO_WORKERS))


def _outcome(f) -> tuple:
    """(True, f()), or (False, the exception it raised)."""
    try:
        return True, f()
    except BaseException as e:      # handed to the caller
        return False, e


class _Threads:
    """Long-lived helper threads. ``run([f0, f1, ...])`` calls ``f0`` in the calling thread
    and the others on helpers at the same time, and returns the results in order (the
    first exception is re-raised once all have finished). NumPy releases the GIL inside
    ufuncs and matmul, so the parts really run on separate cores."""

    def __init__(self):
        self._helpers = []
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._local = threading.local()

    def _loop(self, inbox, outbox):
        self._local.helper = True
        while True:
            f = inbox.get()
            result = _outcome(f)
            # Let go of the task before the caller hears of its end: its closure may hold a
            # step's buffers (a decoding state's keys and values, a training step's cache),
            # which an idle helper would otherwise keep alive until its next task.
            del f
            outbox.put(result)
            del result

    def run(self, fns):
        if len(fns) == 1 or getattr(self._local, "helper", False) or not self._lock.acquire(blocking=False):
            return [f() for f in fns]       # nested or concurrent use: run them one after another
        try:
            if self._pid != os.getpid():      # a forked child inherits the queues, not the threads
                self._helpers, self._pid = [], os.getpid()
            while len(self._helpers) < len(fns) - 1:
                inbox, outbox = queue.SimpleQueue(), queue.SimpleQueue()
                threading.Thread(target=self._loop, args=(inbox, outbox), daemon=True,
                                 name=f"attn-fast-{len(self._helpers)}").start()
                self._helpers.append((inbox, outbox))
            for (inbox, _), f in zip(self._helpers, fns[1:]):
                inbox.put(f)
            outcomes = [_outcome(fns[0])] + [outbox.get() for _, outbox in self._helpers[:len(fns) - 1]]
            err = next((r for ok, r in outcomes if not ok), None)
            if err is not None:
                try:
                    raise err
                finally:                # no cycle through this frame: the parts' arrays go with the error
                    err = outcomes = f = fns = None
            return [r for _, r in outcomes]
        finally:
            self._lock.release()

    def parallel(self, fns):
        """:meth:`run` with NumPy's BLAS set to one thread meanwhile (the parts are the
        parallelism; BLAS threads on top would oversubscribe the cores)."""
        if len(fns) == 1:
            return [fns[0]()]
        with single_threaded_blas():
            return self.run(fns)


class single_threaded_blas:
    """``with single_threaded_blas(): ...`` runs the block with NumPy's BLAS on one thread
    and restores the previous count afterwards (a no-op where the count cannot be set)."""

    def __enter__(self):
        self._prev = B.blas_threads()
        if self._prev not in (None, 1):
            B.blas_threads(1)
        return self

    def __exit__(self, *exc):
        if self._prev not in (None, 1):
            B.blas_threads(self._prev)
        return False


THREADS = _Threads()


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Ask glibc's malloc to keep freed blocks for reuse instead of handing them back to the system
    (False where that is not possible: not glibc). A step allocates and frees a few hundred megabytes;
    by default glibc unmaps and trims them, so the next step page-faults its memory back in, zeroed
    (10 to 30 thousand faults, 5-10 % of a toy-bench step on two cores). With this the process keeps
    its peak footprint between steps. It is a setting for the whole process (PyTorch's CPU tensors
    benefit alike), so only the trainer and the benchmark call it; resident memory then no longer
    falls between steps (the benchmark measures peak memory in child processes without it)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return all([mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1,      # a list: both are set
                mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1])


def row_slices(n: int, k: int):
    """k contiguous slices covering range(n), as equal as possible (none empty)."""
    k = max(1, min(k, n))
    bounds = [n * i // k for i in range(k + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(k)]
