"""The stand-in's asynchronous mode: each launch is queued on its stream and has run only once
something waited for it, so that reading a result before its producer ran is an error.

On a GPU a call returns as soon as its kernel is queued on a stream. The kernels of one stream
run in order; two streams are ordered only by an event (``Event.record`` on one,
``Stream.wait_event`` on the other) or by the host waiting for the first before queuing on the
second (``Stream.synchronize``, ``Event.synchronize``, ``Device.synchronize``, and every copy to
the host: ``get()``, ``asnumpy``, ``float()`` ... copy on the *current* stream and wait for it).
The legacy null stream waits for the work queued before on every blocking stream, and they for
its (streams made ``non_blocking=True`` do neither). Nothing else orders them: a kernel on stream
B that reads what a kernel on stream A wrote may run before it, and a copy to the host on the null
stream of what a non-blocking stream wrote may copy it before it is written.

The stand-in runs each operation at once (NumPy), so its values are always ready; this mode
keeps the GPU's order beside them, with a vector clock per stream (how many launches of each
stream its next launch is known to run after) and the host's (how many of each it has waited
for), and raises :class:`ReadBeforeRunError` where a launch, or a copy to the host, reads an
array whose last writer is not known to have run before it. A graph launch reads and writes
what its capture did (the operations run while a stream captures are not launches); NCCL's
all-reduce reads and writes its buffers on the stream it is given. Not modelled: a write over
what another stream still reads.

:func:`fakecupy.cupy.asynchronous` switches it on (a ``with``); ``FAKECUPY_ASYNC=1`` in the
environment switches it on at import, for a whole test run.
"""
from __future__ import annotations

import weakref
from collections import Counter


class ReadBeforeRunError(RuntimeError):
    """A launch or a host copy read an array before the launch that wrote it was known to have run."""


def _merge(into: dict, other: dict) -> None:
    for k, n in other.items():
        if into.get(k, 0) < n:
            into[k] = n


class Order:
    """The launches' order across streams (see the module's docstring). ``inner``: the tracer
    that was in place (``attn.bench.counts``'), told of every operation as before."""

    #: how many arrays' writers are kept before the gone ones are dropped
    PRUNE = 20000
    #: how many writes into one array are kept before those known to have run are dropped
    SPANS = 64

    def __init__(self, cp, inner=None):
        self.cp, self.inner = cp, inner
        self.launched: Counter = Counter()    # stream -> launches queued on it
        self.clock: dict = {}                 # stream -> {stream: launches its next launch runs after}
        self.host: dict = {}                  # {stream: launches the host has waited for}
        #: id(memory) -> (its weak ref, [(first byte, past the last, stream, launch number, what) of its writes])
        self.writer: dict = {}
        self.captured: dict = {}              # id(capture) -> (reads, writes) of its operations

    # ---- what a stream's next launch runs after

    def _label(self, s: int) -> str:
        return "the null stream" if s == 0 else f"stream {s:#x}"

    def _blocking(self, s: int) -> bool:
        stream = self.cp.Stream._made.get(s)
        return stream is not None and not stream.non_blocking

    def _clock_of(self, s: int) -> dict:
        c = self.clock.setdefault(s, {})
        _merge(c, self.host)
        if s == 0:                                # the legacy stream waits for every blocking stream
            for t, ct in list(self.clock.items()):
                if t != 0 and self._blocking(t):
                    _merge(c, ct)
        elif self._blocking(s) and 0 in self.clock:
            _merge(c, self.clock[0])
        return c

    # ---- launches and reads

    def launch(self, s: int, what: str, reads, writes) -> None:
        c = self._clock_of(s)
        for a in reads:
            self._check(s, c, what, a)
        self.launched[s] += 1
        n = c[s] = self.launched[s]
        for a in writes:
            m, lo, hi = self._where(a)
            if hi == lo:
                continue
            ref, spans = self.writer.get(id(m), (None, None))
            if ref is None or ref() is not m:
                spans = []
                self.writer[id(m)] = (weakref.ref(m), spans)
            spans[:] = [w for w in spans if not lo <= w[0] < w[1] <= hi]      # those it writes over
            spans.append((lo, hi, s, n, what))
            if len(spans) > self.SPANS:                                       # those known to have run
                spans[:] = [w for w in spans if self.host.get(w[2], 0) < w[3]]
        if len(self.writer) > self.PRUNE:
            self.writer = {k: v for k, v in self.writer.items() if v[0]() is not None}

    def _where(self, a):
        """(the array owning ``a``'s memory, the first and one past the last byte of ``a`` in it);
        ``a`` may be that already."""
        if isinstance(a, tuple):
            return a
        m = self.cp._root(a)
        if not a.size:
            return m, 0, 0
        lo, hi = self.cp.np.lib.array_utils.byte_bounds(a)
        base = self.cp.np.lib.array_utils.byte_bounds(m)[0]
        return m, lo - base, hi - base

    def _check(self, s: int, c: dict, what: str, a) -> None:
        m, lo, hi = self._where(a)
        ref, spans = self.writer.get(id(m), (None, None))
        if ref is None or ref() is not m or hi == lo:
            return
        for w_lo, w_hi, t, n, by in spans:
            if w_lo < hi and lo < w_hi and c.get(t, 0) < n:
                raise ReadBeforeRunError(
                    f"fakecupy (asynchronous): {what} on {self._label(s)} reads an array that {by} wrote on "
                    f"{self._label(t)}, and nothing orders it after that launch, which may not have run yet: "
                    f"record an event after it and wait for it on {self._label(s)} (Stream.wait_event), or "
                    "synchronize first")

    def host_read(self, kind: str, a=None, stream=None) -> None:
        """A copy to the host (``kind``) of ``a`` on ``stream`` (the current one), then the host
        waits for that stream, as CuPy's ``get()`` does."""
        s = self.cp._CURRENT_STREAM[-1].ptr if stream is None else stream
        if a is not None:
            self.launch(s, f"a device->host copy ({kind})", [a], [])
        self.synchronized(s)

    # ---- what the host waited for

    def synchronized(self, s=None) -> None:
        """The host waited for stream ``s`` (None: the whole device)."""
        if s is None:
            for t in list(self.clock):
                _merge(self.host, self._clock_of(t))
        else:
            _merge(self.host, self._clock_of(s))

    def recorded(self, event, s: int) -> None:
        event._clock = dict(self._clock_of(s))

    def waited(self, s: int, event) -> None:
        _merge(self._clock_of(s), getattr(event, "_clock", {}))

    def event_done(self, event) -> None:
        _merge(self.host, getattr(event, "_clock", {}))

    # ---- the tracer

    def __call__(self, kind, name, inputs, outputs, info):
        if self.inner is not None:
            self.inner(kind, name, inputs, outputs, info)
        if kind == "copy" and info.get("direction") == "d2h":
            return                                # (host_read saw it)
        capture = self.cp._capturing
        if kind == "graph":
            return
        if "written_at" in info:                  # cuBLAS: where its matrices lie, not its copies of them
            reads, writes = info["read_at"], info["written_at"]
        else:
            reads = list(inputs)
            writes = list(outputs) + (list(info.get("written", inputs)) if kind == "raw" else [])
        if capture is not None:                   # recorded, not launched: the graph's launch is
            r, w = self.captured.setdefault(id(capture), ([], []))
            r += reads
            w += writes
            return
        s = info.get("stream")
        self.launch(self.cp._CURRENT_STREAM[-1].ptr if s is None else int(s), f"{kind} {name}", reads, writes)

    def end_capture(self, capture, graph) -> None:
        graph._touched = self.captured.pop(id(capture), ([], []))

    def graph_launched(self, graph, s: int) -> None:
        reads, writes = getattr(graph, "_touched", ([], []))
        self.launch(s, "a graph launch", reads, writes)
