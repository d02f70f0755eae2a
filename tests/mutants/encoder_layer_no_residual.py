"""An encoder layer whose self-attention sub-layer lost its residual connection
(LayerNorm(SelfAttn(x)) instead of LayerNorm(x + SelfAttn(x))), with the backward right for
that forward: the forward is the bug."""
from attn import layers as L

ATT = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
FFN = ("w1", "b1", "w2", "b2")


def encoder_layer_forward(x, mask, params, n_heads, eps=1e-6):
    p = params
    a, ca = L.multi_head_attention_forward(x, x, *(p["self_attn." + k] for k in ATT), n_heads, mask)
    h, cn1 = L.layer_norm_forward(a, p["norm1.gamma"], p["norm1.beta"], eps)          # no x + a
    f, cf = L.feed_forward_forward(h, *(p["ffn." + k] for k in FFN))
    out, cn2 = L.layer_norm_forward(h + f, p["norm2.gamma"], p["norm2.beta"], eps)
    return out, (ca, cn1, cf, cn2)


def encoder_layer_backward(dout, cache):
    ca, cn1, cf, cn2 = cache
    g = {}
    dz, g["norm2.gamma"], g["norm2.beta"] = L.layer_norm_backward(dout, cn2)
    dh, *dffn = L.feed_forward_backward(dz, cf)
    g.update({"ffn." + k: d for k, d in zip(FFN, dffn)})
    dh = dh + dz
    da, g["norm1.gamma"], g["norm1.beta"] = L.layer_norm_backward(dh, cn1)
    dxq, dxkv, *datt = L.multi_head_attention_backward(da, ca)
    g.update({"self_attn." + k: d for k, d in zip(ATT, datt)})
    return dxq + dxkv, g
