"""A CuPy stand-in built on NumPy, so that the CuPy path of attn runs where no GPU is.

``fakecupy.cupy`` and ``fakecupy.cupyx`` look like the parts of ``cupy`` and ``cupyx`` that
attn uses, and behave like them where CuPy differs from NumPy and attn could depend on it:

* Arrays are their own type (:class:`fakecupy.cupy.ndarray`), not ``numpy.ndarray``.
  ``numpy.asarray(a)`` (implicit conversion) raises ``TypeError`` as CuPy's does;
  ``a.get()`` and ``cupy.asnumpy(a)`` are the ways to the host.
* Mixing a host ``numpy.ndarray`` into a device operation (``a + host``, ``cupy.exp(host)``,
  ``cupy.concatenate([a, host])``) raises ``TypeError``; NumPy scalars and Python numbers
  are fine, and ``cupy.asarray(host)`` is the way to the device.
* Reductions and scalar indexing give 0-d device arrays, not NumPy scalars.
* Integer-array indices out of range wrap around (``a[ids]``, ``take``,
  ``take_along_axis``, ``cupyx.scatter_add``) instead of raising.
* Every device -> host transfer is counted: ``.get()``, ``asnumpy``, ``float()``, ``int()``,
  ``bool()``, ``operator.index()``, ``.item()``, ``.tolist()``, printing an array, and the
  operations whose result size depends on the data (boolean-mask indexing, ``nonzero``...).
  :func:`counting` reads the count; ``cupyx.allow_synchronize(False)`` makes one raise.
* ``cupy.random.RandomState``, ``cupy.cuda`` (runtime, Device, Stream, Event, memory pool and
  hooks, ``nccl``'s all-reduce: over MPI between ``mpiexec``'s ranks) and ``cupy.get_default_memory_pool()`` exist and do what a single device would.
* ``cupy.cuda.cublas`` has the GEMMs attn calls (``sgemm``/``dgemm``, their ``StridedBatched``
  and pointer-array ``Batched`` forms) with CuPy's signatures and cuBLAS's constants, and
  ``cupy.cuda.device.get_cublas_handle()``: device pointers (``a.data.ptr``) are resolved to
  the arrays whose address was taken, every matrix touched must lie inside one (a wrong ld or
  stride raises ``CUBLASError``), and the result is what cuBLAS defines for the arguments
  (column-major, transposes, alpha and beta read from host memory at the call).
* Every operation can be traced as CuPy would run it (``fakecupy.cupy.tracer``): the kernel it
  launches (elementwise, reduction, RawKernel with its grid, cuBLAS product, copy, cuRAND draw),
  the arrays it reads and writes and those it allocates, including the copies CuPy's ``matmul``
  makes of operands cuBLAS is not given as they are. ``attn.bench.counts`` counts with it.
* Streams capture CUDA graphs (``Stream.begin_capture``/``end_capture``, ``Graph.launch``) as a
  GPU does: the capture has no effect on memory, the graph replays the recorded operations with
  the host scalars they were given then, and what CUDA or CuPy refuse while a stream captures
  (a host transfer or sync, CuPy's ``matmul``, cuRAND) raises ``StreamCaptureError`` naming the
  line that asked. An allocation from the pool that the capturing stream's free blocks serve is
  not refused, in any capture mode, as on a GPU, nor a ``cudaMalloc`` in relaxed mode (CuPy's
  default): it is recorded (``Graph.pool_allocations``), the pool's byte counts grow and memory
  hooks are told, so only the capturer's own guard (:class:`attn.fast.gpu.graph.CaptureGuard`) can
  refuse it. A ``cudaMalloc`` in global or thread-local mode is refused, as CUDA refuses it.
  ``begin_capture(survey=True)`` notes every refusal instead, pool allocations included
  (:func:`attn.fast.gpu.graph.survey`).
* The memory pool keeps its free blocks per stream, as CuPy's (:mod:`fakecupy.pool`): a block
  freed on one stream is never handed to a request on another, and ``used_bytes``,
  ``total_bytes``, ``free_bytes``, ``n_free_blocks`` and ``free_all_blocks(stream)`` count them
  (the null stream's arrays are not counted). Each stream has a handle of its own.
* The current stream is per thread, as CuPy keeps it (``cupy/cuda/stream.pyx``'s thread-local
  state): ``use()`` and ``with stream:`` change the calling thread's only, and a thread that made
  none current launches on ``Stream.null`` (``Stream.ptds``, each thread's own default stream,
  where ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``), whatever stream the thread that started it
  made current. A worker that should launch on its caller's stream must be handed it. While a
  stream captures, an operation on another stream (another thread's, or inside a ``with`` of
  another) is refused (``StreamCaptureError``): a GPU runs it at once, outside the graph.
* An asynchronous mode (``with fakecupy.cupy.asynchronous():``, or ``FAKECUPY_ASYNC=1``): each
  launch is queued on its stream and has run only once an event or the host waited for it, and
  reading a result before its producer ran (on another stream, or on the host through a copy on
  a stream that does not wait for it) raises ``ReadBeforeRunError`` (:mod:`fakecupy.streams`).
* CuPy's allocator API (``cupy.cuda.using_allocator``, ``set_allocator``, ``get_allocator``;
  ``MemoryPointer + offset``): while an allocator other than the pool's is in place, every new
  array asks it for its bytes and becomes a view of the memory it returns, so memory handed out
  twice is shared for real; such arrays count as the allocator's (the tracer's ``step_memory``),
  not the pool's, and a capture accepts them (attn's step memory, :mod:`attn.fast.gpu.stepmem`).

**The one difference that is not CuPy's**: a kernel (``cupy.RawModule``) cannot run CUDA
here, so each kernel function is run by its NumPy twin, the function that
``attn.fast.gpu.kernels`` keeps beside every kernel as its specification (see
:class:`fakecupy.cupy.RawModule`). Everything around the kernels (argument packing, strides,
grid and block sizes, the launch code of ``CupyOps``) runs as it would on a GPU.

Selecting it: ``ATTN_BACKEND=fakecupy python -m pytest`` runs every ``backend`` test on the
stand-in alone; with ``ATTN_BACKEND`` unset (CI), the ``cupy`` copy of each test runs on real
CuPy where a GPU is usable and on the stand-in elsewhere. :func:`install` registers it in
``attn.backend.cupy_modules``, where attn looks for CuPy. A child process (a lesson, a
command) runs on the stand-in with the environment of :func:`child_env`.
"""
from __future__ import annotations

from . import cupy, cupyx
from .cupy import TransferCounter, counting, transfers  # noqa: F401

__all__ = ["cupy", "cupyx", "install", "uninstall", "installed", "counting", "transfers", "child_env"]


def install():
    """Make attn find the stand-in where it looks for CuPy. Returns the ``cupy`` look-alike."""
    import attn.backend as B
    B.cupy_modules = (cupy, cupyx)
    return cupy


def uninstall():
    """Let attn import the real CuPy again."""
    import attn.backend as B
    B.cupy_modules = None


def child_env(env: dict | None = None) -> dict:
    """The environment of a child process that runs on the stand-in: ``ATTN_BACKEND=cupy``, and
    ``PYTHONPATH`` starting with ``as_cupy`` (where ``import cupy`` and ``import cupyx`` give the
    stand-in's modules) and ``tests`` (where ``fakecupy`` is). The child's own children inherit
    it, so a command that starts more processes (``attn-check``, the benchmark's workers) runs
    on the stand-in throughout."""
    import os
    env = dict(os.environ if env is None else env)
    here = os.path.dirname(os.path.abspath(__file__))
    path = [os.path.join(here, "as_cupy"), os.path.dirname(here)]
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["ATTN_BACKEND"] = "cupy"
    return env


def installed() -> bool:
    import attn.backend as B
    return B.cupy_modules is not None and B.cupy_modules[0] is cupy
