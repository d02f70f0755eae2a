"""Data-parallel training (attn/training/distributed.py): N processes train exactly as one.

The proof runs ``mpiexec -n 2`` (:mod:`attn.bench.parallel_check`): three steps in float64
of a small model with dropout, on batches whose halves are uneven and padding-heavy, against one
process on the whole batches, on NumPy and on the CuPy stand-in (NCCL's all-reduce, and MPI
staged through the host). A mutant that normalises by each rank's own token count must fail it.
Then the trainer itself: ``mpiexec -n 2 attn-train`` equals one process, and a run resumed with
another number of processes continues it. The pieces are tested in this process, without MPI.
Tests that need mpi4py and mpiexec skip with the reason when they are absent.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attn.backend as B
from attn.data import Batch
from attn.training import distributed as D
from attn.bench.parallel_check import BOUNDS, check_batches

ROOT = Path(__file__).resolve().parent.parent


def _why_no_mpi() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    if shutil.which("mpiexec") is None:
        return "mpiexec is not on PATH (pip install mpich)"
    return None


needs_mpi = pytest.mark.skipif(_why_no_mpi() is not None, reason=str(_why_no_mpi()))


def mpiexec(n: int, args: list[str], timeout: int = 300, **env_vars) -> subprocess.CompletedProcess:
    """``mpiexec -n n python ARGS`` with this checkout and the stand-in importable, one BLAS thread
    (and ``env_vars`` set)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg", **env_vars}
    env.pop("ATTN_BACKEND", None)
    return subprocess.run(["mpiexec", "-n", str(n), sys.executable, *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


CHECK = ("import sys, fakecupy; fakecupy.install(); from attn.bench.parallel_check import main; "
         "sys.exit(main(sys.argv[1:]))")


def parallel_check(*flags) -> tuple[int, list[dict]]:
    r = mpiexec(2, ["-c", CHECK, *flags])
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert results, f"no result from the check (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.returncode, results


@needs_mpi
def test_two_processes_train_exactly_as_one():
    code, results = parallel_check("--backend", "numpy", "cupy", "--transport", "nccl", "mpi",
                                   "--engine", "fast", "reference")
    assert {(r["backend"].split()[0], r["transport"], r["engine"]) for r in results} == {
        ("numpy", "mpi", "fast"), ("numpy", "mpi", "reference"), ("cupy", "nccl", "fast"),
        ("cupy", "nccl", "reference"), ("cupy", "mpi-staged", "fast"), ("cupy", "mpi-staged", "reference")}
    for r in results:
        case = f"{r['backend']} / {r['transport']} / {r['engine']}"
        print(f"{case}: gradients {r['max_grad_rel']:.2e}, losses {r['max_loss_rel']:.2e}, "
              f"parameters {r['max_param_rel']:.2e} (all as one vector {r['param_vector_rel']:.2e}), "
              f"ranks bit-for-bit equal: {r['ranks_bitwise_equal']}; target tokens per rank "
              f"{r['target_tokens_per_rank']}")
        assert r["max_grad_rel"] <= BOUNDS["grad"] == 1e-12, case
        assert r["max_loss_rel"] <= BOUNDS["loss"] == 1e-13, case
        assert r["max_param_rel"] <= BOUNDS["param"] == 1e-10, case
        assert r["param_vector_rel"] <= 1e-10, case
        assert r["ranks_bitwise_equal"], case
        assert r["pass"], case
        # uneven: the halves of the first two batches hold very different numbers of tokens, and
        # the last batch (one sentence) leaves rank 0 with nothing to count
        tokens = r["target_tokens_per_rank"]
        assert tokens[0][0] > 2 * tokens[0][1] and tokens[1][0] > 2 * tokens[1][1] and tokens[2][0] == 0
        assert r["buckets"] > 1                      # several buckets in reverse layer order
        # every bucket but the last (the embeddings and the loss) goes out while the backward
        # still runs: the reference model fills the dict it is given, attn.fast announces the
        # stages of its arena, which is the buffer all-reduced (in place, no copy)
        assert r["buckets_sent_during_backward"] == [r["buckets"] - 1] * 3, case
        assert r["all_reduce_buffer"] == ("the arena's own" if r["engine"] == "fast" else "a copy"), case
        assert r["summed_tokens"] == r["batch_tokens"], case          # the shares cover each batch once
        # attn.fast on CuPy: dropout by the counter-based generator (the default), keyed by the
        # index in the global batch; elsewhere drawn from the step's stream, cut to the share
        counter = r["engine"] == "fast" and r["backend"] == "cupy"
        assert r["dropout"] == ("counter-based, keyed by the index in the global batch" if counter
                                else "drawn from the step's stream"), case
        assert r["zero_gradient_params"] and all(k.endswith(".b_k") for k in r["zero_gradient_params"])
    transfers = {r["transport"]: r["all_reduce_host_transfers_per_step"] for r in results if r["backend"] == "cupy"}
    assert transfers == {"nccl": 0.0, "mpi-staged": 1.0}     # NCCL never goes through the host
    assert code == 0


@needs_mpi
def test_normalising_by_the_local_token_count_fails_the_check():
    code, results = parallel_check("--backend", "numpy", "--wrong-normalisation")
    (r,) = results
    print(f"local normalisation: gradients {r['max_grad_rel']:.2e}, losses {r['max_loss_rel']:.2e}")
    assert r["normalisation"] == "local (wrong)" and not r["pass"] and code == 1
    assert r["max_grad_rel"] > 1e-3 and r["max_loss_rel"] > 1e-3
    assert r["ranks_bitwise_equal"]                  # the ranks agree with each other, on the wrong answer


@needs_mpi
def test_counter_dropout_keyed_by_the_index_in_the_share_fails_the_check():
    code, results = parallel_check("--backend", "cupy", "--transport", "nccl", "--wrong-dropout-keys")
    (r,) = results
    print(f"dropout keyed locally: gradients {r['max_grad_rel']:.2e}, losses {r['max_loss_rel']:.2e}")
    assert r["dropout"].endswith("(wrong)") and not r["pass"] and code == 1
    assert r["max_grad_rel"] > 1e-3 and r["max_loss_rel"] > 1e-3


# --------------------------------------------------------------------------- the trainer under mpiexec

PAIRS = [("the red cat sleeps", "le chat rouge dort"), ("a big dog runs", "un grand chien court"),
         ("the small bird sings on the old wall today", "le petit oiseau chante sur le vieux mur"),
         ("a red dog", "un chien rouge"), ("the big cat runs", "le grand chat court"),
         ("a small cat sings", "un petit chat chante"), ("dogs", "chiens"), ("the cat", "le chat")]
TRAIN = ["-m", "attn.train", "--src", "xx", "--tgt", "yy", "--average", "0", "--d-model", "16", "--heads", "2",
         "--d-ff", "32", "--layers", "1", "--max-tokens", "48", "--warmup", "4", "--minutes", "0",
         "--bleu-sentences", "0", "--quiet", "--dtype", "float64", "--dropout", "0.1", "--eval-every", "2",
         "--backend", "numpy"]


@needs_mpi
def test_the_trainer_under_mpiexec_equals_one_process_and_resumes_with_any_number(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val", "test"):
        (data / f"{split}.xx").write_text("\n".join(s for s, _ in PAIRS) + "\n", encoding="utf-8")
        (data / f"{split}.yy").write_text("\n".join(t for _, t in PAIRS) + "\n", encoding="utf-8")
    common = [*TRAIN, "--data", str(data)]
    one = mpiexec(1, [*common, "--steps", "4", "--out", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = mpiexec(2, [*common, "--steps", "2", "--out", str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 processes (gradients over mpi)" in two.stderr
    assert two.stderr.count("step 2: val loss") == 1                       # rank 0 alone evaluates and logs
    resumed = mpiexec(1, ["-m", "attn.train", "--resume", "--out", str(tmp_path / "two"), "--steps", "4",
                          "--quiet"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    from attn.checkpoint import load_npz
    a, meta_a = load_npz(tmp_path / "one" / "checkpoint.npz")
    b, meta_b = load_npz(tmp_path / "two" / "checkpoint.npz")
    assert meta_a["step"] == meta_b["step"] == 4
    np.testing.assert_allclose(b["history/train_loss"], a["history/train_loss"], rtol=1e-13)
    for k in a:
        if k.startswith("param/") and not k.endswith(".b_k"):              # key biases: see parallel_check
            np.testing.assert_allclose(b[k], a[k], rtol=1e-9, atol=1e-12, err_msg=k)
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["steps"] == 4 and "processes" not in metrics             # the resumed run had one
    first = json.loads((tmp_path / "two" / "config.json").read_text())
    assert first["processes"] == 1                                          # rewritten by the resumed run


def test_settings_apart_name_every_differing_field_but_the_per_process_ones():
    from attn.training.config import TrainConfig
    base = TrainConfig().to_dict()
    assert D.settings_apart([base, dict(base), {**base, "out": "elsewhere", "quiet": True}]) is None
    problem = D.settings_apart([base, {**base, "max_tokens": 512},
                                {**base, "dropout": 0.5, "label_smoothing": 0.0}])
    assert "rank 1 has max_tokens 512 (rank 0: None)" in problem
    assert "rank 2 has dropout 0.5 (rank 0: None), label_smoothing 0.0 (rank 0: None)" in problem


@needs_mpi
@pytest.mark.parametrize("odd, words", [(["--max-tokens", "512"], ["max_tokens 512 (rank 0: 48)"]),
                                        (["--dropout", "0.5", "--label-smoothing", "0"],
                                         ["dropout 0.5 (rank 0: 0.1)", "label_smoothing 0.0 (rank 0: None)"])])
def test_processes_started_with_different_flags_refuse_to_train(tmp_path, odd, words):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val", "test"):
        (data / f"{split}.xx").write_text("\n".join(s for s, _ in PAIRS) + "\n", encoding="utf-8")
        (data / f"{split}.yy").write_text("\n".join(t for _, t in PAIRS) + "\n", encoding="utf-8")
    common = [*TRAIN, "--data", str(data), "--steps", "2", "--out", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    r = subprocess.run(["mpiexec", "-n", "1", sys.executable, *common, ":", "-n", "1", sys.executable, *common, *odd],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode != 0, r.stderr[-3000:]
    assert "different settings" in r.stderr and "rank 1 has" in r.stderr, r.stderr[-3000:]
    for w in words:
        assert w in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoint.npz").exists()


@needs_mpi
def test_under_mpiexec_the_cooldown_follows_process_0_and_equals_one_process(tmp_path):
    """With a cooldown the rate depends on the budget used, which process 0 sends each step:
    two processes take the rates, losses and parameters of one."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val", "test"):
        (data / f"{split}.xx").write_text("\n".join(s for s, _ in PAIRS) + "\n", encoding="utf-8")
        (data / f"{split}.yy").write_text("\n".join(t for _, t in PAIRS) + "\n", encoding="utf-8")
    common = [*TRAIN, "--data", str(data), "--steps", "4", "--cooldown", "0.5"]
    runs = {n: mpiexec(n, [*common, "--out", str(tmp_path / f"n{n}")]) for n in (1, 2)}
    for n, r in runs.items():
        assert r.returncode == 0, r.stderr[-3000:]
    from attn.checkpoint import load_npz
    a, _ = load_npz(tmp_path / "n1" / "checkpoint.npz")
    b, _ = load_npz(tmp_path / "n2" / "checkpoint.npz")
    np.testing.assert_allclose(b["history/train_loss"], a["history/train_loss"], rtol=1e-13)
    logged = [[json.loads(x) for x in (tmp_path / f"n{n}" / "metrics.jsonl").read_text().splitlines()] for n in (1, 2)]
    assert [r["lr"] for r in logged[0]] == [r["lr"] for r in logged[1]]
    assert logged[1][-1]["lr_scale"] < 1.0                                  # the cooldown was on
    for k in a:
        if k.startswith("param/") and not k.endswith(".b_k"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-9, atol=1e-12, err_msg=k)


# --------------------------------------------------------------------------- the pieces, in this process

def _batch(rows: list[int], T: int = 6) -> Batch:
    src = np.zeros((len(rows), T), dtype=np.int64)
    tgt = np.zeros((len(rows), T), dtype=np.int64)
    for i, n in enumerate(rows):
        src[i, :n] = 5
        tgt[i, :n] = 6
    return Batch(src, tgt.copy(), tgt, int((src != 0).sum()), int((tgt != 0).sum()))


def test_shares_split_the_sentences_and_their_weights_sum_to_one():
    batch = _batch([6, 5, 5, 2, 1])
    for size in (1, 2, 3, 5, 7):
        shares = [D.share_of(batch, size, r) for r in range(size)]
        assert sum(w for *_, w in shares) == pytest.approx(1.0, rel=1e-15)
        rows = [m.src.shape[0] if w else 0 for m, _, _, w in shares]
        assert sum(rows) == 5 and max(rows) - min(rows) <= 1
        for mine, lo, n, w in shares:
            assert n == 5 and mine.src.shape[1] == batch.src.shape[1]          # padded as the whole batch
            if w:
                np.testing.assert_array_equal(mine.tgt_out, batch.tgt_out[lo:lo + mine.src.shape[0]])
                assert w == mine.n_tgt_tokens / batch.n_tgt_tokens
    empty, lo, n, w = D.share_of(_batch([4]), 2, 0)                          # fewer sentences than ranks
    assert w == 0.0 and empty.src.shape[0] == 1


@pytest.mark.parametrize("keys_first", [False, True])
def test_a_share_draws_its_rows_of_what_one_process_draws(keys_first):
    B.set_backend("numpy")
    rows, lo, hi = 7, 2, 5
    shape_of = (lambda b: (4, b, 2, 3)) if keys_first else (lambda b: (b, 2, 3))
    flat_of = lambda b: (b * 6, 8)                                          # (B*T, D)
    whole = B.DeviceRNG(11)
    expect = [whole.random_uint16(shape_of(rows)), whole.random(flat_of(rows), "float64")]
    mine = D.RowsOf(B.DeviceRNG(11), lo, hi, rows, keys_first=keys_first)
    got = [mine.random_uint16(shape_of(hi - lo)), mine.random(flat_of(hi - lo), "float64")]
    cut = (slice(None), slice(lo, hi)) if keys_first else (slice(lo, hi),)
    np.testing.assert_array_equal(got[0], expect[0][cut])
    np.testing.assert_array_equal(got[1], expect[1][lo * 6:hi * 6])
    with pytest.raises(D.DistributedError, match="sentence axis"):
        mine.random((4, 4))


@pytest.mark.parametrize("keys_first", [False, True])
def test_a_share_keys_counter_dropout_by_its_place_in_the_whole_batch(keys_first):
    """attn.fast's counter-based dropout on CuPy draws nothing: a share's masks, keyed by the
    index of each element in the whole batch (:meth:`RowsOf.place`), are its rows of one
    process's masks, bit for bit, through the kernels' launch code (dropout_hash, and the fused
    epilogues for the row-major (B*T, D) masks) on the stand-in."""
    import fakecupy  # noqa: F401
    from conftest import selected_backend
    from attn.fast import ops_for
    rows, T, width = 7, 3, 8
    shape_of = (lambda b: (5, b, 2, 3)) if keys_first else (lambda b: (b * T, width))
    with selected_backend("fakecupy") as cp:
        ops = ops_for(cp)
        assert ops.counter_dropout
        whole = ops.dropout_mask(B.DeviceRNG(11), shape_of(rows), 0.3)
        want = cp.asnumpy(whole.keep.array(cp))
        x = np.random.default_rng(0).standard_normal(shape_of(rows))
        for lo, hi in ((0, 3), (3, 7), (2, 5), (6, 7)):
            mine = D.RowsOf(B.DeviceRNG(11), lo, hi, rows, keys_first=keys_first)
            m = ops.dropout_mask(mine, shape_of(hi - lo), 0.3)
            cut = (slice(None), slice(lo, hi)) if keys_first else (slice(lo * T, hi * T),)
            assert np.array_equal(cp.asnumpy(m.keep.array(cp)), want[cut]), (lo, hi)
            got = cp.asnumpy(ops.dropout_(cp.asarray(x[cut]), m))
            assert np.array_equal(got, np.where(want[cut], x[cut] * m.scale, 0)), (lo, hi)
            if not keys_first:
                a = np.abs(x[cut]) + 1                                  # positive: ReLU keeps every unit
                got = cp.asnumpy(ops.bias_relu_dropout_(cp.asarray(a), cp.zeros(width), m))
                assert np.array_equal(got != 0, want[cut]), (lo, hi)
            else:                                                       # one run per key, the others' between
                assert (m.keep.run, m.keep.skip) == ((hi - lo) * 6, (rows - hi + lo) * 6)
        base, _, skip = D.RowsOf(B.DeviceRNG(11), 0, rows, rows, keys_first).place(shape_of(rows))
        assert base == skip == 0                                       # the whole batch: its own index


def test_flat_gradients_in_reverse_layer_order_with_buckets_on_parameter_edges():
    B.set_backend("numpy")
    params = {"embedding.weight": np.zeros((10, 4)), "encoder.0.w": np.zeros((4, 4)), "encoder.0.b": np.zeros(4),
              "decoder.0.w": np.zeros((4, 8)), "decoder.0.b": np.zeros(8)}
    fg = D.FlatGrads(params, bucket_bytes=8 * 20)
    assert fg.names == ["decoder.0.b", "decoder.0.w", "encoder.0.b", "encoder.0.w", "embedding.weight"]
    sizes = sum(p.size for p in params.values())
    assert fg.flat.shape == (sizes + 2,) and fg.nbytes == 8 * (sizes + 2)     # the loss and the tokens
    edges = {0} | {fg.offsets[k] + params[k].size for k in fg.names}
    assert fg.buckets[0][0] == 0 and fg.buckets[-1][1] == sizes + 2
    assert all(a[1] == b[0] for a, b in zip(fg.buckets, fg.buckets[1:])) and len(fg.buckets) > 2
    assert all(stop in edges | {sizes + 2} for _, stop in fg.buckets)
    rng = np.random.default_rng(0)
    grads = {k: rng.normal(size=p.shape) for k, p in params.items()}
    for i in range(len(fg.buckets)):
        fg.pack_bucket(i, grads, 0.25)
    fg.pack_loss(np.asarray(2.0), 0.25, 17)
    assert sorted(k for names in fg.bucket_names for k in names) == sorted(params)
    for k in params:
        np.testing.assert_array_equal(fg.views[k], 0.25 * grads[k])
        assert np.shares_memory(fg.views[k], fg.flat)
    assert fg.loss() == 0.5 and not np.shares_memory(fg.loss(), fg.flat) and fg.loss().shape == ()
    assert fg.tokens() == 17 and fg.flat[-1] == 17


def test_the_fast_engine_all_reduces_its_own_arena_bucket_by_bucket_as_the_backward_announces_it():
    """``FlatGrads.over(arena)``: the buffer is the arena's gradient buffer (the views Adam reads
    are the arena's: nothing is copied), its buckets end on the backward's stages, and each goes
    out (scaled by the rank's weight) as soon as the backward has announced its last stage,
    holding then what it holds at the end; the last (the slot, and whatever stages share its
    bucket) waits for the loss."""
    from attn.fast import FastTransformer, cross_entropy as fast_ce
    from attn.model import TransformerConfig
    B.set_backend("numpy")
    cfg = TransformerConfig(vocab_size=23, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=2, n_decoder_layers=3,
                            dropout=0.1, label_smoothing=0.1, max_len=16)
    model = FastTransformer(cfg, seed=0, dtype="float64")
    fg = D.FlatGrads.over(model.arena, bucket_bytes=8 * 1000)
    a = model.arena
    assert fg.flat is a.grad_buffer and fg.views is a.grad_views and fg.nbytes == 8 * (a.size + 2)
    ends = {hi for _, hi in a.layout.stages.values()}
    assert len(fg.buckets) > 2 and all(stop in ends for _, stop in fg.buckets[:-1])
    assert fg.buckets[-1][1] == a.size + 2 and fg.bucket_names[0][0] == "decoder.norm"
    batch = check_batches(23)[0]
    logits, cache = model.forward(batch.src, batch.tgt_in, B.DeviceRNG(1))
    _, d = fast_ce(logits, batch.tgt_out, cfg.label_smoothing, inplace=True)
    sent = []

    class Group:
        def _launch(self, i):
            lo, hi = fg.buckets[i]
            sent.append((i, fg.flat[lo:hi].copy()))

    feed = D.BucketFeed(Group(), fg, 0.25)
    grads = model.backward(d, cache, ready=feed.ready)
    assert [i for i, _ in sent] == list(range(len(fg.buckets) - 1)) == list(range(feed.launched_during_backward))
    assert all(g is fg.views[k] for k, g in grads.items())                # what Adam reads: the arena's views
    for i, early in sent:
        lo, hi = fg.buckets[i]
        np.testing.assert_array_equal(early, fg.flat[lo:hi])                # final when it went out
        assert np.abs(early).max() > 0
    logits, cache = model.forward(batch.src, batch.tgt_in, B.DeviceRNG(1))     # the same step, told nothing
    _, d = fast_ce(logits, batch.tgt_out, cfg.label_smoothing, inplace=True)
    model.backward(d, cache)
    for i, early in sent:                                                   # the weight scaled what went out
        lo, hi = fg.buckets[i]
        np.testing.assert_array_equal(early, 0.25 * a.grads[lo:hi])
    fg.pack_bucket(len(fg.buckets) - 1, {}, 0.25)
    fg.pack_loss(np.asarray(2.0), 0.25, 9)
    assert fg.loss() == 0.5 and fg.tokens() == 9


class _OneRank:
    """What MPIGroup asks of a communicator, for one rank (no MPI in this process)."""

    def Get_size(self):
        return 1

    def Get_rank(self):
        return 0

    def bcast(self, value, root=0):
        return value

    def allgather(self, value):
        return [value]

    def Split_type(self, kind):
        return self


def test_one_rank_nccl_on_the_stand_in_sums_what_one_process_has(monkeypatch):
    """In the stand-in's asynchronous mode: the all-reduce on its own stream reads the packed
    gradients and the step reads its sums only after the events that order them."""
    import fakecupy
    from conftest import selected_backend
    monkeypatch.setattr(D, "_mpi", lambda: type("MPI", (), {"COMM_TYPE_SHARED": 0}))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    with selected_backend("fakecupy"), fakecupy.cupy.asynchronous():
        dp = D.MPIGroup(_OneRank())
        dp.use_backend("nccl")
        assert dp.transport == "nccl"
        cp = B.xp()
        grads = {"a.w": cp.asarray(np.arange(6.0).reshape(2, 3)), "b.w": cp.asarray(np.ones(4))}
        with fakecupy.counting() as c:
            loss, out = dp.all_reduce(cp.asarray(np.float64(3.0)), grads, 0.5)
        assert c.n == 0                                     # no device -> host transfer
        np.testing.assert_array_equal(B.to_host(out["a.w"]), 0.5 * np.arange(6.0).reshape(2, 3))
        assert B.to_float(loss) == 1.5
        dp.use_backend("mpi")
        assert dp.transport == "mpi-staged"


def test_one_process_never_imports_mpi(monkeypatch):
    for name in D.LAUNCHER_SIZE:
        monkeypatch.delenv(name, raising=False)
    assert D.launched_size() == 1 and isinstance(D.group(), D.Single)
    monkeypatch.setenv("PMI_SIZE", "1")
    assert isinstance(D.group(), D.Single)
    one = D.Single()
    batch = check_batches(23)[0]
    assert one.share(batch, "rng") == (batch, "rng", 1.0)
    grads = {"w": np.ones(3)}
    assert one.all_reduce("loss", grads, 1.0) == ("loss", grads)
    assert one.agree(None, True) is None and one.broadcast(7) == 7


def test_mpiexec_without_mpi4py_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)                    # import mpi4py raises ImportError
    with pytest.raises(D.DistributedError, match=r"mpi4py is not installed: pip install 'attn\[mpi\]'"):
        D.group()


# --------------------------------------------------------------------------- python -m attn.bench --data-parallel N

def test_the_bytes_all_reduced_are_every_parameter_and_the_loss():
    from attn.bench.parallel import allreduce_bytes, counts, paper_model, ring_bytes_per_rank
    from attn.bench.presets import BENCH_PRESETS, model_config
    from attn.model import Transformer
    cfg = model_config(BENCH_PRESETS["quick"])
    from attn.fast import FastTransformer
    assert allreduce_bytes(cfg) == FastTransformer(cfg).arena.grad_buffer.nbytes           # the arena, as it is
    assert allreduce_bytes(cfg) >= 4 * (Transformer(cfg).num_parameters() + 2)             # + the loss and tokens
    assert ring_bytes_per_rank(800, 1) == 0 and ring_bytes_per_rank(800, 2) == 800 and ring_bytes_per_rank(800, 8) == 1400
    c = counts("toy-bench", 4)
    assert c["ring_bytes_per_rank"] == 1.5 * c["allreduce_bytes"] and c["flops_per_rank"] == c["step_flops"] / 4
    m = paper_model(8, 0.4, 12.0)
    from attn.model import TransformerConfig, parameter_shapes
    base = TransformerConfig.preset("base", vocab_size=37000)
    assert m["parameters"] == sum(int(np.prod(s)) for s in parameter_shapes(base).values())
    assert m["allreduce_seconds"] == pytest.approx(1.75 * m["allreduce_bytes"] / 12e9)


@needs_mpi
def test_bench_data_parallel_times_one_and_n_processes():
    r = subprocess.run([sys.executable, "-m", "attn.bench", "--data-parallel", "2", "--quick", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {(x["name"], x.get("ranks")): x for x in map(json.loads, r.stdout.splitlines())}
    one, two = rows[("data_parallel_step_quick", 1)], rows[("data_parallel_step_quick", 2)]
    assert one["allreduce_seconds"] == 0 and two["transport"] == "mpi" and 0 < two["allreduce_share"] < 1
    assert two["speedup"] == pytest.approx(one["seconds_per_step"] / two["seconds_per_step"])
    assert rows[("data_parallel_counts_quick", 2)]["allreduce_bytes"] > 0
    assert rows[("data_parallel_model_base", 8)]["ranks"] == 8


def test_a_bucket_goes_out_once_the_backward_is_past_it():
    params = {"embedding.weight": np.zeros((10, 4)), "encoder.0.w": np.zeros((4, 4)), "encoder.0.b": np.zeros(4),
              "decoder.0.w": np.zeros((4, 8)), "decoder.0.b": np.zeros(8)}
    fg = D.FlatGrads(params, bucket_bytes=8 * 20)
    assert fg.bucket_names == [["decoder.0.b", "decoder.0.w"], ["encoder.0.b", "encoder.0.w"], ["embedding.weight"],
                               []]                                              # the loss alone
    launched = []

    class Group:
        def _launch(self, i):
            launched.append(i)
            np.testing.assert_array_equal(fg.flat[slice(*fg.buckets[i])],     # packed, scaled by the weight
                                          np.concatenate([3 * feed[k].ravel() for k in fg.bucket_names[i]]))

    feed = D.BucketFeed(Group(), fg, 3.0)
    # the order the reference backward goes in: the tied embedding (output projection), the
    # decoder's layers, the embedding again (the target side), the encoder's layers
    for name, expect in (("embedding.weight", []), ("decoder.0.w", []), ("decoder.0.b", []),
                         ("embedding.weight", [0]), ("encoder.0.w", [0]), ("encoder.0.b", [0])):
        feed[name] = np.full(params[name].shape, float(len(feed) + 1))
        assert launched == expect, (name, launched)
    assert feed.launched == feed.launched_during_backward == 1


#: An OpenBLAS kernel every x86-64 CPU runs (SSE4.2): the processes of a test sum in another order
#: than the machine's own kernel (Haswell, SkylakeX, Zen), as they would on another machine.
#: OpenBLAS ignores a name it does not know (another architecture keeps its own kernel).
OTHER_KERNEL = "Nehalem"


@needs_mpi
def test_two_processes_equal_one_that_splits_its_batch_with_dropout_on(tmp_path):
    """The default engine with dropout: one process on two BLAS threads splits each batch into two
    parts on two threads; two processes (one thread each) take a half each, and one process on
    two threads resumes their run. Every part draws its rows of what the whole batch draws, so all
    give one run (the parts' own streams of before differed by 1e-2 at step 2). The two processes
    run OpenBLAS's :data:`OTHER_KERNEL`, as another machine would.

    The comparison is made in float64, where it is nearly exact: the three ways sum the same
    terms in other orders, and another BLAS kernel another order again. In float32 that
    rounding (2**-24 of the terms' sum of magnitudes) is no smaller than a gradient near zero,
    and Adam's ``m / sqrt(v)`` turns such a gradient's sign into a step of the learning rate's
    size: a bound tuned on one BLAS's order failed on another's. In float64 the rounding is
    2**-53 of the same sums: the largest difference seen is 3e-15, so a loss within 1e-13 and
    parameters within 1e-9 leave a wide margin over any order of the sums, and a dropout
    stream off by one row (1e-2) still fails."""
    data = tmp_path / "data"
    data.mkdir()
    pairs = PAIRS * 40
    for split in ("train", "val", "test"):
        (data / f"{split}.xx").write_text("\n".join(s for s, _ in pairs) + "\n", encoding="utf-8")
        (data / f"{split}.yy").write_text("\n".join(t for _, t in pairs) + "\n", encoding="utf-8")
    flags = ["-m", "attn.train", "--data", str(data), "--src", "xx", "--tgt", "yy", "--average", "0", "--d-model",
             "128", "--heads", "2", "--d-ff", "64", "--layers", "1", "--max-tokens", "2048", "--warmup", "4",
             "--minutes", "0", "--bleu-sentences", "0", "--quiet", "--dropout", "0.3", "--eval-every", "3",
             "--dtype", "float64", "--steps", "3", "--backend", "numpy"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "2", "MPLBACKEND": "Agg"}
    env.pop("ATTN_BACKEND", None)
    one = subprocess.run([sys.executable, *flags, "--out", str(tmp_path / "one")], capture_output=True, text=True,
                         env=env, timeout=300, cwd=ROOT)
    assert one.returncode == 0, one.stderr[-3000:]
    two = mpiexec(2, [*flags[:-4], "--steps", "2", "--backend", "numpy", "--out", str(tmp_path / "two")],
                  OPENBLAS_CORETYPE=OTHER_KERNEL)      # and another BLAS kernel's order of the sums
    assert two.returncode == 0, two.stderr[-3000:]
    resumed = subprocess.run([sys.executable, "-m", "attn.train", "--resume", "--out", str(tmp_path / "two"),
                              "--steps", "3", "--quiet"], capture_output=True, text=True, env=env, timeout=300,
                             cwd=ROOT)                      # one process on two threads continues it
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    from attn.checkpoint import load_npz
    a, _ = load_npz(tmp_path / "one" / "checkpoint.npz")
    b, _ = load_npz(tmp_path / "two" / "checkpoint.npz")
    np.testing.assert_allclose(b["history/train_loss"], a["history/train_loss"], rtol=1e-13)
    for k in a:
        if k.startswith("param/") and not k.endswith(".b_k"):              # key biases: see parallel_check
            np.testing.assert_allclose(b[k], a[k], rtol=1e-9, atol=1e-12, err_msg=k)
