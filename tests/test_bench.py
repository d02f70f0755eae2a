"""The benchmark command (:mod:`attn.bench`).

* ``--help`` explains; ``--quick --json`` prints one JSON object per measurement with the
  fields the issue asks for (and the PyTorch ones where PyTorch is installed).
* The FLOP count agrees with an independent count (two FLOPs per weight per token, plus
  the attention's products).
* The PyTorch model the benchmark times is the same model: with attn's parameters loaded
  it gives the same logits, loss and gradients (float64), post- and pre-norm; its greedy
  decoding picks the same tokens as attn's.
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

import attn.backend as B
from attn.bench import (BENCH_PRESETS, MEASUREMENTS, _no_eos, _torch_decode, make_batch, model_config,
                        model_flops, torch_loss, torch_transformer)
from attn.gradcheck import rel_error
from attn.loss import cross_entropy
from attn.model import Transformer, TransformerConfig, parameter_shapes


def _bench(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "attn.bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_explains_the_options():
    r = _bench("--help")
    assert r.returncode == 0
    for flag in ("--json", "--preset", "--backend", "--quick", "--threads", "--only", "toy-bench"):
        assert flag in r.stdout, flag


def test_quick_json_has_the_fields():
    only = "train_step,train_step_reference,forward,greedy_cached,greedy_uncached,beam_cached"
    r = _bench("--quick", "--json", "--only", only, "--settle", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    by = {row["name"]: row for row in rows}
    assert list(by)[:2] == ["machine", "matmul"]
    assert set(only.split(",")) <= set(by)
    assert by["matmul"]["gflops_per_second"] > 0
    has_torch = "torch" in by["machine"]
    for name in only.split(","):
        row = by[name]
        for key in ("seconds_per_step", "tokens_per_second", "peak_memory_mb"):
            assert key in row, (name, key)
        assert row["seconds_per_step"] > 0 and row["tokens_per_second"] > 0
        assert row["isolated_seconds_per_step"] > 0 and row["interleaved_seconds_per_step"] > 0
        if has_torch:
            assert row["torch_seconds_per_step"] > 0
            assert math.isclose(row["ratio"], row["seconds_per_step"] / row["torch_seconds_per_step"])
            # the headline is the less favourable of the two settings
            assert row["ratio"] == max(row["isolated_ratio"], row["interleaved_ratio"])
            assert row["ratio"] == row[row["ratio_setting"] + "_ratio"]
    assert by["train_step"]["flops_per_step"] == 3 * by["forward"]["flops_per_step"]
    assert 0 < by["train_step"]["fraction_of_matmul_rate"]
    assert by["train_step"]["peak_memory_mb"] is not None
    assert by["greedy_cached"]["cache_speedup"] > 0 and by["beam_cached"]["cost_vs_greedy"] > 0
    assert "[attn.bench]" in r.stderr          # progress on stderr
    machine = by["machine"]
    assert machine["cpu_model"] and machine["isolated_attn"]["framework"] == "attn"
    if B.blas_threads() is not None:                               # OpenBLAS: its kernel is recorded
        assert machine["blas_kernel"] and machine["isolated_attn"]["blas"]["corename"] == machine["blas_kernel"]
    if has_torch:
        # the PyTorch worker runs beside a one-thread OpenBLAS, with the parent's thread count
        assert machine["isolated_torch"]["blas_threads"] == 1
        assert machine["isolated_torch"]["torch_threads"] == machine["torch_threads"]
        assert machine["isolated_attn"]["blas_threads"] == machine["blas_threads"]


def test_headline_is_the_less_favourable_setting():
    """_row picks the setting with the larger ours/PyTorch ratio, and without PyTorch the slower one."""
    from attn.bench.cli import _row
    from attn.bench.work import Work
    w = Work("train_step", None, None, tokens=100, flops=0, repeats=3)
    iso = {"ours": [1.0, 1.1, 0.9], "torch": [2.0, 2.0, 2.0]}              # ratio 0.5
    intl = {"ours": [1.2, 1.2, 1.2], "torch": [1.5, 1.5, 1.5]}             # ratio 0.8
    r = _row(w, {"isolated": iso, "interleaved": intl}, 1.0, 1.0, "numpy")
    assert r["ratio_setting"] == "interleaved" and math.isclose(r["ratio"], 0.8)
    assert math.isclose(r["isolated_ratio"], 0.5) and r["seconds_per_step"] == 1.2
    r = _row(w, {"isolated": {"ours": [3.0]}, "interleaved": {"ours": [2.0]}}, 1.0, 1.0, "numpy")
    assert r["ratio_setting"] == "isolated" and r["seconds_per_step"] == 3.0 and "ratio" not in r


def test_flops_agree_with_a_count_by_weights():
    cfg = TransformerConfig(vocab_size=50, d_model=16, n_heads=4, d_ff=24, n_encoder_layers=2,
                            n_decoder_layers=3)
    Bsz, S, T = 3, 5, 7
    shapes = parameter_shapes(cfg)
    mat = {k: s for k, s in shapes.items() if len(s) == 2 and not k.endswith("weight")}
    enc = sum(math.prod(s) for k, s in mat.items() if k.startswith("encoder"))
    dec_kv = sum(math.prod(s) for k, s in mat.items() if ".cross_attn.w_k" in k or ".cross_attn.w_v" in k)
    dec = sum(math.prod(s) for k, s in mat.items() if k.startswith("decoder")) - dec_kv
    D = cfg.d_model
    attention = 2 * 2 * Bsz * D * (cfg.n_encoder_layers * S * S + cfg.n_decoder_layers * (T * T + T * S))
    want = 2 * Bsz * (S * enc + S * dec_kv + T * dec + T * cfg.vocab_size * D) + attention
    assert model_flops(cfg, Bsz, S, T, training=False) == want
    assert model_flops(cfg, Bsz, S, T) == 3 * want


def test_presets_are_the_issue_s():
    bc = BENCH_PRESETS["toy-bench"]
    cfg = model_config(bc)
    assert (bc.batch, bc.src_len, bc.tgt_len) == (64, 32, 32)
    assert (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.d_ff) == (1000, 256, 4, 1024)
    assert (cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.norm_position, cfg.share_embeddings) == (3, 3, "post", True)
    src, tgt_in, tgt_out = make_batch(bc)
    assert src.shape == (64, 32) and tgt_in.shape == tgt_out.shape == (64, 32)
    assert np.all((tgt_out != 0) <= (tgt_in != 0)) and (tgt_out == 2).sum() == 64     # one EOS each


@pytest.mark.parametrize("name,V", [("vocab-16k", 16000), ("vocab-32k", 32000)])
def test_vocabulary_presets(name, V):
    """A real corpus's vocabulary at d_model 256, 3+3 layers, d_ff 1024 and a batch of ~4,000
    tokens (B * max(S, T), as attn.data counts them); a plain run times what fits in minutes."""
    bc = BENCH_PRESETS[name]
    cfg = model_config(bc)
    assert (cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.n_encoder_layers, cfg.n_decoder_layers) == (V, 256, 1024, 3, 3)
    assert 3500 <= bc.batch * max(bc.src_len, bc.tgt_len) <= 4500
    assert "train_step" in bc.measurements and set(bc.measurements) <= set(MEASUREMENTS)
    from attn.bench.cli import parse_args
    assert parse_args(["--preset", name]).only == list(bc.measurements)
    assert parse_args(["--preset", "toy-bench"]).only == list(MEASUREMENTS)


LATER = {"norm_kind": "rms", "positional": "rope", "ffn": "swiglu", "kv_heads": 1}


@pytest.mark.parametrize("options", [{"norm_position": "post"}, {"norm_position": "pre"}, {**LATER, "norm_position": "pre"}, LATER,
                                     {"kv_heads": 2, "n_heads": 4}],
                         ids=["post", "pre", "later-pre", "later-post", "gqa"])
def test_torch_model_is_the_same_model(torch, options):
    """attn's parameters loaded into the PyTorch twin: the same logits, loss and every gradient
    (read back in attn's layout), float64; the paper's block and the later one (RMSNorm, rotary
    positions, SwiGLU, grouped-query attention)."""
    B.set_backend("numpy")
    cfg = TransformerConfig(**{"vocab_size": 13, "d_model": 8, "n_heads": 2, "d_ff": 12, "n_encoder_layers": 2,
                               "n_decoder_layers": 2, "dropout": 0.0, "label_smoothing": 0.1, "max_len": 16,
                               **options})
    ours = Transformer(cfg, seed=3, dtype="float64")
    theirs = torch_transformer(cfg, dtype="float64")
    theirs.load_attn_params(ours.params)
    src = np.array([[4, 5, 6, 7, 0], [8, 9, 10, 0, 0]])
    tgt = np.array([[1, 4, 5, 6], [1, 7, 8, 0]])
    tgt_out = np.array([[4, 5, 6, 2], [7, 8, 2, 0]])
    logits, cache = ours.forward(src, tgt)
    loss, d = cross_entropy(logits, tgt_out, 0.1)
    grads = ours.backward(d, cache)
    t_logits = theirs(torch.as_tensor(src), torch.as_tensor(tgt))
    t_loss = torch_loss(t_logits, torch.as_tensor(tgt_out), 0.1)
    t_loss.backward()
    assert rel_error(logits, t_logits.detach().numpy()) < 1e-12
    assert abs(float(loss) - float(t_loss.detach())) < 1e-12
    t_grads = theirs.attn_params(grads=True)
    assert set(t_grads) == set(grads) and len(list(theirs.parameters())) <= len(grads)
    for name in ours.params:
        err = rel_error(grads[name], t_grads[name])
        assert err < 1e-10, f"{name}: attn and the torch model differ (relative error {err:.1e})"
    assert all(np.array_equal(theirs.attn_params()[k], ours.params[k]) for k in ours.params)


@pytest.mark.parametrize("options", [{"positional": "learned"}, {**LATER, "norm_position": "pre"}],
                         ids=["gpt", "later"])
def test_torch_language_model_is_the_same_model(torch, options):
    """A decoder-only config (nanoGPT's block: pre-norm, learned positions; and the later block):
    attn's weights copied into the twin bit for bit, the same logits, loss and every gradient in
    float64, and the cross-attention's parameters absent from both."""
    B.set_backend("numpy")
    cfg = TransformerConfig(vocab_size=13, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=0, n_decoder_layers=2,
                            dropout=0.0, label_smoothing=0.0, max_len=8, norm_position="pre",
                            **{k: v for k, v in options.items() if k != "norm_position"})
    ours = Transformer(cfg, seed=3, dtype="float64")
    theirs = torch_transformer(cfg, dtype="float64")
    theirs.load_attn_params(ours.params)
    assert all(np.array_equal(theirs.attn_params()[k], ours.params[k]) for k in ours.params)
    ids = np.array([[4, 5, 6, 7, 8, 9], [10, 11, 12, 4, 4, 5]])
    nxt = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 4, 4, 5, 6]])
    logits, cache = ours.forward(None, ids)
    loss, d = cross_entropy(logits, nxt, 0.0)
    grads = ours.backward(d, cache)
    t_logits = theirs(None, torch.as_tensor(ids))
    t_loss = torch_loss(t_logits, torch.as_tensor(nxt), 0.0)
    t_loss.backward()
    assert rel_error(logits, t_logits.detach().numpy()) < 1e-12
    assert abs(float(loss) - float(t_loss.detach())) < 1e-12
    t_grads = theirs.attn_params(grads=True)
    assert set(t_grads) == set(grads) == set(ours.params) and not any("cross" in k for k in grads)
    assert ("tgt_pos.weight" in grads) == (options.get("positional") == "learned")
    for name in ours.params:
        err = rel_error(grads[name], t_grads[name])
        assert err < 1e-10, f"{name}: attn and the torch language model differ (relative error {err:.1e})"
    with pytest.raises(ValueError, match="src must be None"):
        theirs(torch.as_tensor(ids), torch.as_tensor(ids))


@pytest.mark.parametrize("options", [{}, LATER], ids=["paper", "later"])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("beam", [1, 3])
def test_torch_decoding_is_the_same_work(torch, use_cache, beam, options):
    """The PyTorch decoding the benchmark times picks the tokens attn picks (EOS banned); with
    the later block, its cache turns each key once."""
    B.set_backend("numpy")
    from attn import decode
    cfg = TransformerConfig(vocab_size=17, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=1,
                            n_decoder_layers=2, dropout=0.0, max_len=32, **options)
    ours = _no_eos(Transformer(cfg, seed=5, dtype="float64"))
    theirs = torch_transformer(cfg, dtype="float64")
    theirs.load_attn_params(ours.params)
    theirs.eval()
    src = np.array([[4, 5, 6, 7, 0], [8, 9, 10, 11, 12], [13, 0, 0, 0, 0]])
    steps = 6
    if beam == 1:
        got = decode.greedy_decode(ours, src, max_len=steps, use_cache=use_cache).tokens
    else:
        got = decode.beam_search(ours, src, beam_size=beam, alpha=0.0, max_len=steps, use_cache=use_cache).tokens
    t = _torch_decode(theirs, torch.as_tensor(src), steps, beam, use_cache).numpy()
    assert got == t[::beam].tolist()         # each sentence's best (row 0 of its beams)


@pytest.mark.parametrize("beam", [1, 3])
def test_torch_decoding_is_the_same_work_as_the_gpu_engines(torch, beam):
    """The benchmark's decoding on CuPy (the stand-in: attn.fast's device state and kernels, the
    no-EOS projection written into the step's logits buffer) picks the tokens PyTorch picks."""
    from attn import decode
    from attn.fast import FastTransformer
    from conftest import selected_backend
    cfg = TransformerConfig(vocab_size=17, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=1,
                            n_decoder_layers=2, dropout=0.0, max_len=32)
    src, steps = np.array([[4, 5, 6, 7, 0], [8, 9, 10, 11, 12], [13, 0, 0, 0, 0]]), 6
    with selected_backend("numpy"):
        theirs = torch_transformer(cfg, dtype="float64")
        theirs.load_attn_params(Transformer(cfg, seed=5, dtype="float64").params)
        theirs.eval()
        t = _torch_decode(theirs, torch.as_tensor(src), steps, beam, True).numpy()
    with selected_backend("fakecupy") as cp:
        ours = _no_eos(FastTransformer(cfg, seed=5, dtype="float64"))
        if beam == 1:
            got = decode.greedy_decode(ours, cp.asarray(src), max_len=steps).tokens
        else:
            got = decode.beam_search(ours, cp.asarray(src), beam_size=beam, alpha=0.0, max_len=steps).tokens
    assert got == t[::beam].tolist()


def test_the_block_option_times_each_block_named():
    """``--block paper,later``: each block in turn in one run; the later one is the preset with the
    later models' block (the workers are told it too); an unknown block is refused naming it."""
    from attn.bench.cli import parse_args
    from attn.bench.isolated import _worker_args
    from attn.bench.presets import _bench_config
    args = parse_args(["--block", "paper,later", "--preset", "toy-bench"])
    assert args.blocks == ["paper", "later"] and args.block == "paper"
    assert model_config(_bench_config(args)) == model_config(BENCH_PRESETS["toy-bench"])
    args.block = "later"
    cfg = model_config(_bench_config(args))
    assert (cfg.norm_position, cfg.norm_kind, cfg.positional, cfg.ffn, cfg.kv_heads) == ("pre", "rms", "rope", "swiglu", 2)
    assert _worker_args(args, "attn")[-2:] == ["--block", "later"]
    with pytest.raises(SystemExit):
        parse_args(["--block", "llama"])


def _attention_rows(out: str) -> list:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["T"] for r in rows] == [16, 40]
    for r in rows:
        assert r["plain_seconds"] > 0 and r["tiled_seconds"] > 0
        assert r["plain_peak_mb"] is not None and r["tiled_peak_mb"] is not None
    return rows


def test_the_attention_rows_time_and_measure_each_way():
    """``--attention``: per length the plain and the tiled attention's forward and backward, and
    PyTorch's where installed, seconds and peak memory growth (a process of its own: the command
    hands freed memory back to the system for the whole process)."""
    r = _bench("--attention", "--lengths", "16,40", "--repeats", "1", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    rows = _attention_rows(r.stdout)
    if importlib.util.find_spec("torch"):
        assert all(row["torch_seconds"] > 0 and row["torch_peak_mb"] is not None for row in rows)


def test_the_attention_rows_run_the_kernels_on_the_stand_in(capsys):
    from conftest import selected_backend
    from attn.bench.cli import main
    with selected_backend("cupy"):
        assert main(["--attention", "--lengths", "16,40", "--repeats", "1", "--json", "--quiet", "--backend", "cupy",
                     "--no-torch"]) == 0
    _attention_rows(capsys.readouterr().out)
