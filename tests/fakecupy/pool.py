"""The stand-in's memory pool: CuPy's ``MemoryPool``, with its free blocks kept per stream.

CuPy's pool (``cupy/cuda/memory.pyx``, ``SingleDeviceMemoryPool``) keeps an *arena* of free
blocks for each stream (keyed by the stream's pointer). A request is rounded up to 512 bytes
and served from the arena of the stream current at the request: the smallest free block that
holds it, split where it is larger (the rest stays free in that arena); where that arena has
none, the pool calls ``cudaMalloc`` and its total grows. A block goes back, when the last array
on it goes, to the arena of the stream it was *allocated* on, whichever stream is current then,
and merges with free neighbours of the same ``cudaMalloc``. So a block freed on stream A is never
handed to a request on stream B: B's requests take B's free blocks or new memory.
``free_all_blocks(stream)`` gives back to the device the free blocks of that stream's arena (of
every arena without one) that are whole ``cudaMalloc`` s.

What follows from it on a GPU, and here: a stream that has never allocated (a capture's own
stream, made for it) has no free blocks, so every pool allocation on it is a ``cudaMalloc``,
which CUDA refuses from the capturing thread in the global and thread-local capture modes
(``cudaErrorStreamCaptureUnsupported``; relaxed mode lets it through): :class:`MemoryPool` asks
``malloc_refused`` before each one.

The stand-in's arrays hold NumPy memory, so the pool keeps accounts, not memory: the blocks'
addresses are the pool's own (a ``cudaMalloc`` takes the next range of a counter), told to memory
hooks as ``mem_ptr``. The legacy null stream's arena is not kept (the stand-in does not watch the
arrays made on it, for speed): its requests are neither counted nor served from another
stream's blocks, and its frees reach no other stream's arena, so the rule above holds for it too.
"""
from __future__ import annotations

import threading

#: CuPy's pool rounds every request up to a multiple of this.
ROUND = 512


def rounded(nbytes: int) -> int:
    return -(-int(nbytes) // ROUND) * ROUND


class _Malloc:
    """One ``cudaMalloc`` of the pool: its address and size (a free chunk covering it all can be
    given back to the device)."""
    __slots__ = ("ptr", "size")

    def __init__(self, ptr: int, size: int):
        self.ptr, self.size = ptr, size


class Block:
    """A block handed out: where (``ptr``, ``size``), from which ``cudaMalloc`` (``mem``), and the
    stream whose arena it goes back to (``stream``)."""
    __slots__ = ("ptr", "size", "mem", "stream")

    def __init__(self, ptr: int, size: int, mem: _Malloc, stream: int):
        self.ptr, self.size, self.mem, self.stream = ptr, size, mem, stream


class _Arena:
    """The free chunks of one stream: address -> (size, its ``cudaMalloc``)."""

    def __init__(self):
        self.free: dict = {}

    def take(self, size: int):
        """(address, its cudaMalloc) of the smallest free chunk of at least ``size`` bytes, split
        to ``size`` (the rest stays free); None where there is none."""
        fits = [(s, p) for p, (s, _) in self.free.items() if s >= size]
        if not fits:
            return None
        s, p = min(fits)
        mem = self.free.pop(p)[1]
        if s > size:
            self.free[p + size] = (s - size, mem)
        return p, mem

    def give(self, ptr: int, size: int, mem: _Malloc) -> None:
        """A chunk back, merged with the free chunks of the same cudaMalloc just after and before it."""
        after = self.free.get(ptr + size)
        if after is not None and after[1] is mem:
            size += self.free.pop(ptr + size)[0]
        before = next((p for p, (s, m) in self.free.items() if m is mem and p + s == ptr), None)
        if before is not None:
            ptr, size = before, size + self.free.pop(before)[0]
        self.free[ptr] = (size, mem)

    def release(self) -> int:
        """Give back every free chunk that is a whole cudaMalloc; the bytes given back."""
        whole = [p for p, (s, m) in self.free.items() if p == m.ptr and s == m.size]
        return sum(self.free.pop(p)[0] for p in whole)


class MemoryPool:
    """``cupy.cuda.MemoryPool`` with per-stream arenas (see the module's docstring).
    ``current_stream()`` gives the pointer of the stream current now; ``malloc_refused(size)``
    raises (or notes) where a ``cudaMalloc`` now is refused (a capture in progress)."""

    #: where the pool's addresses begin (a range no NumPy array of the stand-in is at, in practice)
    BASE = 0x7E00_0000_0000

    def __init__(self, current_stream=lambda: 0, malloc_refused=lambda size: None):
        self._current_stream, self._malloc_refused = current_stream, malloc_refused
        self._arenas: dict = {}
        self._pending: list = []             # blocks freed (by finalisers, any thread) not yet back
        self._lock = threading.RLock()
        self._next = self.BASE
        self._used = self._total = 0
        self._limit = 0

    def hand_out(self, nbytes: int) -> Block | None:
        """The block of a new array of ``nbytes`` on the current stream (None on the null
        stream, whose arena is not kept, or for no bytes: CuPy's pool takes nothing for them)."""
        stream = self._current_stream()
        if not nbytes or stream == 0:
            return None
        size = rounded(nbytes)
        with self._lock:
            self._settle()
            arena = self._arenas.setdefault(stream, _Arena())
            got = arena.take(size)
            if got is None:
                self._malloc_refused(size)
                mem = _Malloc(self._next, size)
                self._next += size
                self._total += size
                got = (mem.ptr, mem)
            self._used += size
        return Block(got[0], size, got[1], stream)

    def give_back(self, block: Block) -> None:
        """``block``'s last array has gone (a finaliser: any thread, any time): back to its arena
        at the pool's next use."""
        self._pending.append(block)

    def _settle(self) -> None:
        with self._lock:
            while self._pending:
                b = self._pending.pop()
                self._arenas.setdefault(b.stream, _Arena()).give(b.ptr, b.size, b.mem)
                self._used -= b.size

    # ---- CuPy's MemoryPool API

    def malloc(self, size):
        """Memory from the pool: the array given it stays NumPy's own (see :func:`_pool_block`
        in ``cupy.py``, which takes its block)."""
        from .cupy import MemoryPointer
        return MemoryPointer(None)

    def used_bytes(self):
        self._settle()
        return self._used

    def total_bytes(self):
        self._settle()
        return self._total

    def free_bytes(self):
        self._settle()
        return self._total - self._used

    def n_free_blocks(self):
        self._settle()
        return sum(len(a.free) for a in self._arenas.values())

    def free_all_blocks(self, stream=None):
        with self._lock:
            self._settle()
            arenas = self._arenas.values() if stream is None else \
                [a for k, a in self._arenas.items() if k == stream.ptr]
            self._total -= sum(a.release() for a in arenas)

    def set_limit(self, size=None, fraction=None):
        self._limit = int(size or 0)

    def get_limit(self):
        return self._limit
