"""The fast engine's one decoder layer: :func:`decoder_layer`, which training's forward, the
NumPy step and the CuPy step all run (the readable model's :func:`attn.model.decoder_layer_forward`).
What differs between them is the object handed in as ``run`` that computes the sub-layers: its
``model``, ``self_attn(i, h)``, ``cross_attn(i, h)``, ``ffn(pre, h)`` and ``residual(norm, x, sub,
bias)``, which runs ``sub`` in the residual connection and returns (out, cache or None):
:class:`Sequences` (training, and inference over a whole prefix), :class:`attn.fast.decoding.host.HostRows`
(one new row per sentence against its key/value cache) and :class:`attn.fast.decoding.device.DeviceRows`
(the same around fused kernels). Each keeps its own arithmetic (the recorded searches and the training
step stay bit for bit); the layer's order, its norms' and biases' names, are written here once."""
from __future__ import annotations


def decoder_layer(run, i: int, x):
    """Decoder layer i on x (section 3.1): masked self-attention (a step's: its new row against
    the key/value cache ``run`` holds), attention over the encoder's output, then the
    feed-forward network, each in its residual connection with its output bias. Returns x,
    (c1, c2, c3) the sub-layers' caches (None where ``run`` keeps none)."""
    pre, model = f"decoder.{i}", run.model
    p = model.params
    x, c1 = run.residual(pre + ".norm1", x, lambda h: run.self_attn(i, h), p[pre + ".self_attn.b_o"])
    c2 = None                                       # a decoder-only block (a language model): no cross-attention
    if model.block.cross_attention is not None:
        x, c2 = run.residual(pre + ".norm2", x, lambda h: run.cross_attn(i, h), p[pre + ".cross_attn.b_o"])
    x, c3 = run.residual(pre + ".norm3", x, lambda h: run.ffn(pre + ".ffn", h), model.ffn.bias(pre))
    return x, (c1, c2, c3)


def decoder_layer_backward(model, dy, dec: list, i: int, dk, dv, G, keys=None):
    """Backward of :func:`decoder_layer` in training: the sub-layers in reverse, layer i's caches
    taken from ``dec`` (and let go there), each freed as its backward is done. dk, dv (B, KV, S, Dh)
    receive the cross-attention keys' and values' gradients (``keys``: the keys' QK-norm cache, or
    None), ``G`` the parameters'. Returns dx (N_t, D)."""
    c1, c2, c3 = dec[i]
    dec[i] = None
    residuals, mha = model.residuals, model.mha
    dy = residuals.backward(dy, c3, model.ffn.backward, G)
    del c3
    if c2 is not None:
        dy = residuals.backward(dy, c2, lambda d, c, g, into: mha.cross_attn_backward(d, c, dk, dv, g, into, keys), G)
    del c2
    return residuals.backward(dy, c1, mha.self_attn_backward, G)

class Sequences:
    """Training's sub-layers: whole sequences of ``T`` positions for ``Bsz`` rows, the masks ``tgt``
    and ``src`` (:func:`attn.fast.core.attention.mask_bias`'s pairs), the fused weights ``F``, dropout
    from ``rng`` (None: none). ``kv_heads``: every layer's cross-attention keys and values (2L
    views), or None to project layer i's from ``memory`` when it runs; ``keep_cache``: the caches
    kept for the backward; ``weights``: a list that receives each cross-attention's weights, or None."""

    def __init__(self, model, F, Bsz, T, tgt, src, rng, kv_heads, memory, keep_cache, weights):
        self.model, self.F, self.Bsz, self.T, self.tgt, self.src = model, F, Bsz, T, tgt, src
        self.rng, self.kv_heads, self.memory, self.keep_cache, self.weights = rng, kv_heads, memory, keep_cache, weights

    def residual(self, norm, x, sub, bias):
        out, cache = self.model.residuals.residual(norm, x, sub, bias, self.rng)
        return out, cache if self.keep_cache else None

    def self_attn(self, i, h):
        W, b = self.F.dec_qkv[i]
        return self.model.mha.self_attn(f"decoder.{i}.self_attn", W, b, h, self.Bsz, self.T, *self.tgt, self.rng)

    def cross_attn(self, i, h):
        mha, Wq, bq = self.model.mha, *self.F.cross_q[i]
        kv = (self.kv_heads[2 * i:2 * i + 2] if self.kv_heads is not None else
              mha.cross_kv_layer(self.memory, self.F, i, self.Bsz, self.memory.shape[0] // max(self.Bsz, 1)))
        s, cache = mha.cross_attn(f"decoder.{i}.cross_attn", Wq, bq, h, kv, self.Bsz, self.T, *self.src,
                                  self.rng)
        if self.weights is not None:
            self.weights.append(cache.att.w)
        return s, cache

    def ffn(self, pre, h):
        return self.model.ffn.forward(pre, h, self.rng)
