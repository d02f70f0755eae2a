"""The benchmark: ``python -m attn.bench [--json] [--preset NAME] [--backend numpy|cupy|auto] ...``

Times, for one named configuration on one backend:

* ``train_step`` -- forward, label-smoothed loss, backward and Adam, on the fast path
  (:mod:`attn.fast`), and ``train_step_reference`` on the readable one (:mod:`attn.model`);
* ``forward`` / ``forward_reference`` -- logits in evaluation mode (no dropout);
* ``greedy_cached`` / ``greedy_uncached`` / ``beam4_cached`` / ``beam4_uncached`` -- decoding
  a batch for a fixed number of tokens (EOS is banned so every sentence runs to the end)
  with and without the key/value cache (:mod:`attn.decode`).

Each figure is the median of several timed runs after warm-up. Where PyTorch is installed
the same architecture, written in :func:`attn.bench.twin.torch_transformer` (post-norm, tied
embeddings scaled by sqrt(d_model), label-smoothed cross-entropy ignoring padding, Adam
with betas (0.9, 0.98) and eps 1e-9), runs the same work in the same process, interleaved
run by run with ours, with ``torch.set_num_threads`` equal to NumPy's BLAS threads; the
ratio is ours / PyTorch (below 1: we are faster).

Model FLOPs count the matrix multiplies (2*m*n*k each) at the padded shapes; a training
step is three times the forward's. The machine's matmul rate is measured in the same run by
timing float32 matmuls of exactly the step's shapes with NumPy's BLAS: a replay of all of the
step's products (forward and backward), timed in the same rotation as the step itself, so
``fraction_of_matmul_rate`` (replay median / step median) says how close the step comes to
doing nothing but its matmuls. For reference there are also each shape's best of three
(``fraction_of_best_matmul_rate``) and a square 2048^3 matmul.

Peak memory is the growth of the resident set during one step over the resident set
just before it (parameters, optimizer state and the batch already allocated), measured
for both frameworks in the same way in a child process: glibc is told to return freed
blocks of 64 kB and more to the system (``MALLOC_MMAP_THRESHOLD_``), the kernel's
high-water mark is reset (``/proc/self/clear_refs``), one step runs, ``VmHWM`` is read.
On CuPy / CUDA it is the peak of the memory pool's bytes in use (PyTorch: its allocator's
``max_memory_allocated``). For NumPy the child also reports ``tracemalloc``'s peak
(NumPy reports its allocations to it) as a cross-check.

The JSON output (``--json``) is one object per line: first ``machine``, then ``matmul``,
then one per measurement with at least ``name``, ``seconds_per_step``,
``tokens_per_second``, ``peak_memory_mb`` and, with PyTorch, ``torch_seconds_per_step``
and ``ratio``.

``python -m attn.bench --quality ...`` (:mod:`attn.bench.quality`) is the other benchmark:
attn and the same model in PyTorch trained one after the other for the same wall-clock
minutes on a corpus, with test BLEU and chrF for both.

The package's rooms: ``presets`` (the configurations and their batches), ``flops`` (model
FLOPs, the matmul rate and replay), ``machine`` (CPU, BLAS, threads), ``twin`` (the same
model in PyTorch), ``work`` (the measurements as callables), ``timing``, ``memory`` (the
peak-memory child processes), ``report`` (table and Markdown), ``cli`` (the command;
``__main__`` runs it), ``quality`` (the side-by-side training run), ``counts`` (kernel launches,
bytes, syncs and pool allocations of a step, counted on the CuPy stand-in: ``--counts``) and
``gpu_report`` (the suite, this benchmark, bf16 and tf32, the captured step, a training run,
peak memory and the counts on a GPU, part by part, every measurement isolated: ``--gpu-report
DIR``; ``gpu_report_md`` its page).
"""
from __future__ import annotations

from .cli import main, parse_args, run
from .flops import gemm_replay, matmul_shapes, measure_matmul_rate, model_flops
from .machine import blas_threads, machine_info
from .memory import measure_memory
from .presets import BENCH_PRESETS, MEASUREMENTS, BenchConfig, decode_batch, make_batch, model_config
from .report import print_markdown, print_table
from .timing import time_work
from .twin import _torch_decode, torch_adam, torch_available, torch_loss, torch_transformer
from .work import Work, _no_eos, build_work
