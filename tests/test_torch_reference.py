"""The whole model against PyTorch (after llm.c's ``test_gpt2``): logits, attention weights, loss,
every parameter's gradient, and the losses of a few Adam steps under the warm-up schedule.

The reference below is written from the paper with PyTorch's own pieces and autograd:
``F.multi_head_attention_forward`` (PyTorch's multi-head attention, with *its* mask convention:
``True`` = may *not* attend, so ours is inverted), ``F.layer_norm``, ``F.relu``, and
``F.cross_entropy(label_smoothing=eps, ignore_index=PAD_ID)``; only the positional sinusoids are
spelled out, from section 3.5. The block of later models is written with PyTorch's
``F.scaled_dot_product_attention(enable_gqa=True)`` (its own grouping of query heads over key/value
heads), rotary positions as the complex product of RoFormer's equation, ``F.silu`` and
``F.rms_norm``. It reads
the attn model's ``params`` under the same dotted names.
attn's linear weights are (Din, Dout) with ``y = x @ w + b``; PyTorch's are (Dout, Din), so the
reference passes ``w.T``. Everything in float64 with dropout off, so the two must agree to
rounding: ~1e-8 relative is asserted, the largest disagreement is printed at the end.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import attn.backend as B
from attn.gradcheck import rel_error
from attn.loss import cross_entropy
from attn.masks import PAD_ID
from attn.model import Transformer, TransformerConfig
from attn.optim import Adam, noam_lr

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e .[ref]): "
                                             "no reference to compare the model against")
F = torch.nn.functional

TOL = 1e-8

CFG = TransformerConfig(vocab_size=13, d_model=16, n_heads=4, d_ff=32, n_encoder_layers=2, n_decoder_layers=2,
                        dropout=0.0, label_smoothing=0.1, max_len=8, warmup_steps=3)
# Padding in both: source lengths 7, 4, 1; target lengths 6, 3, 2 (teacher forcing: same padding in and out).
SRC = np.array([[3, 5, 7, 2, 9, 11, 4],
                [6, 6, 1, 12, 0, 0, 0],
                [8, 0, 0, 0, 0, 0, 0]])
TGT_IN = np.array([[1, 4, 9, 2, 2, 7],
                   [1, 10, 3, 0, 0, 0],
                   [1, 5, 0, 0, 0, 0]])
TGT_OUT = np.array([[4, 9, 2, 2, 7, 3],
                    [10, 3, 6, 0, 0, 0],
                    [5, 2, 0, 0, 0, 0]])

VARIANTS = {
    "post-shared-sinusoidal": dict(),
    "pre-shared-sinusoidal": dict(norm_position="pre"),
    "post-separate-learned": dict(share_embeddings=False, tgt_vocab_size=11, positional="learned"),
    "pre-separate-learned": dict(share_embeddings=False, tgt_vocab_size=11, positional="learned", norm_position="pre"),
    "post-shared-learned-no-smoothing": dict(positional="learned", label_smoothing=0.0),
    "pre-rope-swiglu-gqa-rms": dict(norm_position="pre", positional="rope", ffn="swiglu", kv_heads=2, norm_kind="rms"),
    "post-rms": dict(norm_kind="rms"),
    "post-rope-multi-query": dict(positional="rope", kv_heads=1, rope_base=100.0),
    "pre-separate-swiglu": dict(norm_position="pre", ffn="swiglu", share_embeddings=False, tgt_vocab_size=11),
}

# ----------------------------------------------------------------------------- the largest disagreement

#: Largest relative disagreement with PyTorch per quantity, over the session.
DISAGREEMENT: dict[str, float] = {}


def record(what: str, err: float) -> float:
    DISAGREEMENT[what] = max(err, DISAGREEMENT.get(what, 0.0))
    return err


class _Summary:
    """A tiny plugin, registered by the fixture below, that prints the record at the end of the run."""

    @staticmethod
    def pytest_terminal_summary(terminalreporter):
        if DISAGREEMENT:
            what = max(DISAGREEMENT, key=DISAGREEMENT.get)
            terminalreporter.write_sep("-", "PyTorch reference")
            terminalreporter.write_line(
                f"max relative disagreement with PyTorch: {DISAGREEMENT[what]:.3g} ({what}); "
                + ", ".join(f"{k} {v:.2g}" for k, v in sorted(DISAGREEMENT.items())))


@pytest.fixture(scope="module", autouse=True)
def _report_disagreement(request):
    pm = request.config.pluginmanager
    if not pm.has_plugin("attn-torch-reference-summary"):
        pm.register(_Summary(), "attn-torch-reference-summary")
    yield


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """These matrices are tiny: PyTorch's thread pool only adds overhead (80x on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# ----------------------------------------------------------------------------- the reference


def sinusoids(L: int, D: int):
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(the same)."""
    pos = torch.arange(L, dtype=torch.float64)[:, None]
    two_i = torch.arange(0, D, 2, dtype=torch.float64)
    angle = pos / 10000.0 ** (two_i / D)
    pe = torch.zeros(L, D, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(angle), torch.cos(angle)
    return pe


def reference_forward(P: dict, cfg: TransformerConfig, src, tgt_in):
    """The Transformer in PyTorch. P: name -> float64 tensor (leaves, requires_grad).
    Returns logits (B, T, V) and the attention weights {name: (B, H, Tq, Tk)}."""
    D, H = cfg.d_model, cfg.n_heads
    shared = cfg.share_embeddings
    E_src = P["embedding.weight" if shared else "src_embedding.weight"]
    E_tgt = P["embedding.weight" if shared else "tgt_embedding.weight"]
    E_out = P["embedding.weight" if shared else "generator.weight"]
    weights = {}

    def positions(which, L):
        if cfg.positional == "rope":
            return 0.0                                                  # rotary: inside the self-attention
        return P[f"{which}_pos.weight"][:L] if cfg.positional == "learned" else sinusoids(L, D)

    def attention(name, xq, xkv, key_padding, causal=None):
        if cfg.positional == "rope" or cfg.key_value_heads != H:
            return later_attention(name, xq, xkv, key_padding, causal)
        return paper_attention(name, xq, xkv, key_padding, causal)

    def later_attention(name, xq, xkv, key_padding, causal=None):
        """Grouped-query attention by PyTorch's SDPA, rotary positions on self-attention (the
        weights are recomputed from the scores for the comparison)."""
        KV, Dh = cfg.key_value_heads, D // H
        heads = lambda x, n: x.reshape(*x.shape[:2], n, Dh).transpose(1, 2)  # noqa: E731  (B, n, T, Dh)
        q = heads(xq @ P[f"{name}.w_q"] + P[f"{name}.b_q"], H)
        k = heads(xkv @ P[f"{name}.w_k"] + P[f"{name}.b_k"], KV)
        v = heads(xkv @ P[f"{name}.w_v"] + P[f"{name}.b_v"], KV)
        if cfg.positional == "rope" and name.endswith("self_attn"):
            q, k = rotary(q), rotary(k)
        allowed = ~key_padding[:, None, None, :]                        # (B, 1, 1, Tk), True = may attend
        if causal is not None:
            allowed = allowed & ~causal
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)   # (B, H, Tq, Dh)
        scores = q @ k.repeat_interleave(H // KV, dim=1).transpose(-1, -2) / math.sqrt(Dh)
        weights[name] = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        return o.transpose(1, 2).reshape(*xq.shape[:2], D) @ P[f"{name}.w_o"] + P[f"{name}.b_o"]

    def rotary(x):
        """RoFormer's rotation of pairs (x_i, x_(i + Dh/2)) as z * exp(i m theta)."""
        T, Dh = x.shape[-2:]
        theta = cfg.rope_base ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * theta          # (T, Dh/2)
        z = torch.complex(x[..., :Dh // 2], x[..., Dh // 2:]) * torch.polar(torch.ones_like(angle), angle)
        return torch.cat([z.real, z.imag], dim=-1)

    def paper_attention(name, xq, xkv, key_padding, causal=None):
        # PyTorch's masks say where *not* to attend: key_padding_mask (B, Tk) True on padding,
        # attn_mask (Tq, Tk) True above the diagonal.
        q, kv = xq.transpose(0, 1), xkv.transpose(0, 1)                # (T, B, D): PyTorch's layout
        out, w = F.multi_head_attention_forward(
            q, kv, kv, D, H, None, torch.cat([P[f"{name}.b_q"], P[f"{name}.b_k"], P[f"{name}.b_v"]]),
            None, None, False, 0.0, P[f"{name}.w_o"].T, P[f"{name}.b_o"], training=False,
            key_padding_mask=key_padding, need_weights=True, attn_mask=causal, use_separate_proj_weight=True,
            q_proj_weight=P[f"{name}.w_q"].T, k_proj_weight=P[f"{name}.w_k"].T, v_proj_weight=P[f"{name}.w_v"].T,
            average_attn_weights=False)
        weights[name] = w
        return out.transpose(0, 1)

    def norm(name, x):
        if cfg.norm_kind == "rms":
            return F.rms_norm(x, (D,), P[f"{name}.gamma"], eps=cfg.ln_eps)
        return F.layer_norm(x, (D,), P[f"{name}.gamma"], P[f"{name}.beta"], eps=cfg.ln_eps)

    def ffn(name, x):
        if cfg.ffn == "swiglu":
            return (F.silu(x @ P[f"{name}.w1"]) * (x @ P[f"{name}.w3"])) @ P[f"{name}.w2"]
        return F.relu(x @ P[f"{name}.w1"] + P[f"{name}.b1"]) @ P[f"{name}.w2"] + P[f"{name}.b2"]

    def residual(name, x, sublayer):
        if cfg.norm_position == "pre":
            return x + sublayer(norm(name, x))
        return norm(name, x + sublayer(x))

    src_pad, tgt_pad = src == PAD_ID, tgt_in == PAD_ID                  # (B, S), (B, T)
    T = tgt_in.shape[1]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # (T, T)

    x = E_src[src] * math.sqrt(D) + positions("src", src.shape[1])
    for i in range(cfg.n_encoder_layers):
        pre = f"encoder.{i}"
        x = residual(f"{pre}.norm1", x, lambda h: attention(f"{pre}.self_attn", h, h, src_pad))
        x = residual(f"{pre}.norm2", x, lambda h: ffn(f"{pre}.ffn", h))
    memory = norm("encoder.norm", x) if cfg.norm_position == "pre" else x

    y = E_tgt[tgt_in] * math.sqrt(D) + positions("tgt", T)
    for i in range(cfg.n_decoder_layers):
        pre = f"decoder.{i}"
        y = residual(f"{pre}.norm1", y, lambda h: attention(f"{pre}.self_attn", h, h, tgt_pad, future))
        y = residual(f"{pre}.norm2", y, lambda h: attention(f"{pre}.cross_attn", h, memory, src_pad))
        y = residual(f"{pre}.norm3", y, lambda h: ffn(f"{pre}.ffn", h))
    if cfg.norm_position == "pre":
        y = norm("decoder.norm", y)
    return y @ E_out.T, weights


def reference_loss(logits, tgt_out, eps):
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), tgt_out.reshape(-1), label_smoothing=eps,
                           ignore_index=PAD_ID, reduction="mean")


def torch_params(model: Transformer) -> dict:
    return {k: torch.tensor(B.to_host(v), dtype=torch.float64, requires_grad=True) for k, v in model.params.items()}


def ids(a):
    return torch.tensor(a, dtype=torch.long)


def rel(a, b) -> float:
    """attn.gradcheck.rel_error of two host arrays (torch tensors are detached first)."""
    conv = lambda x: x.detach().numpy() if isinstance(x, torch.Tensor) else B.to_host(x)  # noqa: E731
    return rel_error(np.asarray(conv(a), dtype=np.float64), np.asarray(conv(b), dtype=np.float64))

# ----------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_attention_loss_and_every_gradient_match_pytorch(backend, variant):
    cfg = dataclasses.replace(CFG, **VARIANTS[variant])
    tgt_in, tgt_out = np.minimum(TGT_IN, cfg.target_vocab_size - 1), np.minimum(TGT_OUT, cfg.target_vocab_size - 1)
    model = Transformer(cfg, seed=11, dtype="float64")
    logits, cache = model.forward(B.to_device(SRC), B.to_device(tgt_in))
    loss, dlogits = cross_entropy(logits, B.to_device(tgt_out), cfg.label_smoothing)
    grads = model.backward(dlogits, cache)

    P = torch_params(model)
    ref_logits, ref_weights = reference_forward(P, cfg, ids(SRC), ids(tgt_in))
    ref_loss = reference_loss(ref_logits, ids(tgt_out), cfg.label_smoothing)
    ref_loss.backward()

    failures = []

    def check(what, err):
        record(what, err)
        if not err < TOL:
            failures.append(f"{what}: {err:.3g}")

    check("logits", rel(logits, ref_logits))
    weights = Transformer.attention_weights(cache)
    assert set(weights) == set(ref_weights)
    for name, w in weights.items():
        check("attention weights", rel(w, ref_weights[name]))
    check("loss", abs(B.to_float(loss) - ref_loss.item()) / abs(ref_loss.item()))
    assert set(grads) == set(P)
    for name, p in P.items():
        assert p.grad is not None, f"{name} takes no part in the PyTorch reference"
        err = rel(grads[name], p.grad)
        record("gradients", err)
        if not err < TOL:
            failures.append(f"gradient of {name}: {err:.3g}")
    assert not failures, f"{variant}: attn and PyTorch disagree (relative error > {TOL:g}): " + ", ".join(failures)


@pytest.mark.parametrize("variant", ["post-shared-sinusoidal", "pre-separate-learned"])
def test_five_adam_steps_match_pytorch(backend, variant):
    """attn.optim.Adam against torch.optim.Adam(betas=(0.9, 0.98), eps=1e-9) with the same warm-up
    schedule (a LambdaLR of noam_lr; warm-up 3 steps, so both the rise and the decay are crossed)."""
    cfg = dataclasses.replace(CFG, **VARIANTS[variant])
    tgt_in, tgt_out = np.minimum(TGT_IN, cfg.target_vocab_size - 1), np.minimum(TGT_OUT, cfg.target_vocab_size - 1)
    model = Transformer(cfg, seed=12, dtype="float64")
    P = torch_params(model)
    opt = Adam(model.params, cfg.d_model, cfg.warmup_steps)
    ref_opt = torch.optim.Adam(list(P.values()), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    # LambdaLR counts from 0; attn's steps are 1-based.
    sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: noam_lr(s + 1, cfg.d_model, cfg.warmup_steps))
    src, t_in, t_out = ids(SRC), ids(tgt_in), ids(tgt_out)

    losses, ref_losses, lrs, ref_lrs = [], [], [], []
    for _ in range(5):
        logits, cache = model.forward(B.to_device(SRC), B.to_device(tgt_in))
        loss, dlogits = cross_entropy(logits, B.to_device(tgt_out), cfg.label_smoothing)
        lrs.append(opt.step(model.backward(dlogits, cache)))
        losses.append(B.to_float(loss))

        ref_opt.zero_grad()
        ref_loss = reference_loss(reference_forward(P, cfg, src, t_in)[0], t_out, cfg.label_smoothing)
        ref_loss.backward()
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        sched.step()
        ref_losses.append(ref_loss.item())

    assert lrs == pytest.approx(ref_lrs, rel=1e-15)
    assert losses[-1] < losses[0]                                        # it learns
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    record("losses over 5 Adam steps", max(errors))
    assert max(errors) < TOL, f"losses {losses} vs PyTorch {ref_losses}"

    # The key bias adds one number to every score of a row, which the softmax ignores: its true
    # gradient is exactly zero and both sides compute rounding noise (~1e-17). Adam divides that
    # by its own root mean square, so b_k moves by up to lr * g / (|g| + eps) ~ 1e-9 in directions
    # the noise picks, differently on each side. Checked for staying at zero, not for agreeing.
    key_bias = [k for k in P if k.endswith(".b_k")]
    assert key_bias
    for k in key_bias:
        assert np.abs(B.to_host(model.params[k])).max() < 1e-7 and P[k].abs().max().item() < 1e-7, k
    param_err = {k: rel(model.params[k], P[k]) for k in P if k not in key_bias}
    worst = max(param_err, key=param_err.get)
    record("parameters after 5 Adam steps", param_err[worst])
    assert param_err[worst] < TOL, f"{worst} after 5 Adam steps: relative error {param_err[worst]:.3g}"


def test_the_reference_is_not_trivially_equal(backend):
    """The comparison can fail: a model whose one layer-norm gain differs disagrees with PyTorch."""
    model = Transformer(CFG, seed=11, dtype="float64")
    P = torch_params(model)
    with torch.no_grad():
        P["decoder.1.norm2.gamma"][3] += 1e-3
    logits, _ = model.forward(B.to_device(SRC), B.to_device(TGT_IN))
    assert rel(logits, reference_forward(P, CFG, ids(SRC), ids(TGT_IN))[0]) > 1e-6
