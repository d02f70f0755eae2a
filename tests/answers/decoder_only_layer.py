"""A learner's answer to lessons/exercises/decoder_only_layer.py, written from the starter's
docstrings and the library's layers: attn-check must pass it (tests/test_check.py)."""
from attn import layers as L
from attn import masks as M

ATT = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
FFN = ("w1", "b1", "w2", "b2")


def decoder_only_layer_forward(x, params, n_heads, eps=1e-6):
    p = params
    mask = M.causal_mask(x.shape[1])
    a, ca = L.multi_head_attention_forward(x, x, *(p["self_attn." + k] for k in ATT), n_heads, mask)
    h, c1 = L.layer_norm_forward(x + a, p["norm1.gamma"], p["norm1.beta"], eps)
    f, cf = L.feed_forward_forward(h, *(p["ffn." + k] for k in FFN))
    out, c2 = L.layer_norm_forward(h + f, p["norm2.gamma"], p["norm2.beta"], eps)
    return out, (ca, c1, cf, c2)


def decoder_only_layer_backward(dout, cache):
    ca, c1, cf, c2 = cache
    g = {}
    dz, g["norm2.gamma"], g["norm2.beta"] = L.layer_norm_backward(dout, c2)
    dh, *d = L.feed_forward_backward(dz, cf)
    g.update({"ffn." + k: v for k, v in zip(FFN, d)})
    dz, g["norm1.gamma"], g["norm1.beta"] = L.layer_norm_backward(dz + dh, c1)
    dq, dkv, *d = L.multi_head_attention_backward(dz, ca)
    g.update({"self_attn." + k: v for k, v in zip(ATT, d)})
    return dz + dq + dkv, g
