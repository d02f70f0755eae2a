"""A learner's answer to lessons/exercises/the_whole_model.py, written from the starter's
docstrings and the library's layers: attn-check must pass it (tests/test_check.py)."""
import math
from attn import backend as B
from attn import layers as L
from attn import masks as M

ATT = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
FFN = ("w1", "b1", "w2", "b2")


def _add_norm(x, s, p, name, eps):
    return L.layer_norm_forward(x + s, p[name + ".gamma"], p[name + ".beta"], eps)


def encoder_layer_forward(x, mask, params, n_heads, eps=1e-6):
    p = params
    a, ca = L.multi_head_attention_forward(x, x, *(p["self_attn." + k] for k in ATT), n_heads, mask)
    h, c1 = _add_norm(x, a, p, "norm1", eps)
    f, cf = L.feed_forward_forward(h, *(p["ffn." + k] for k in FFN))
    out, c2 = _add_norm(h, f, p, "norm2", eps)
    return out, (ca, c1, cf, c2)


def encoder_layer_backward(dout, cache):
    ca, c1, cf, c2 = cache
    g = {}
    dz, g["norm2.gamma"], g["norm2.beta"] = L.layer_norm_backward(dout, c2)
    dh, *d = L.feed_forward_backward(dz, cf)
    g.update({"ffn." + k: v for k, v in zip(FFN, d)})
    dz, g["norm1.gamma"], g["norm1.beta"] = L.layer_norm_backward(dz + dh, c1)
    dq, dkv, *d = L.multi_head_attention_backward(dz, ca)
    g.update({"self_attn." + k: v for k, v in zip(ATT, d)})
    return dz + dq + dkv, g


def decoder_layer_forward(x, memory, src_mask, tgt_mask, params, n_heads, eps=1e-6):
    p = params
    a, ca = L.multi_head_attention_forward(x, x, *(p["self_attn." + k] for k in ATT), n_heads, tgt_mask)
    h, c1 = _add_norm(x, a, p, "norm1", eps)
    b, cb = L.multi_head_attention_forward(h, memory, *(p["cross_attn." + k] for k in ATT), n_heads, src_mask)
    h2, c2 = _add_norm(h, b, p, "norm2", eps)
    f, cf = L.feed_forward_forward(h2, *(p["ffn." + k] for k in FFN))
    out, c3 = _add_norm(h2, f, p, "norm3", eps)
    return out, (ca, c1, cb, c2, cf, c3)


def decoder_layer_backward(dout, cache):
    ca, c1, cb, c2, cf, c3 = cache
    g = {}
    dz, g["norm3.gamma"], g["norm3.beta"] = L.layer_norm_backward(dout, c3)
    dh, *d = L.feed_forward_backward(dz, cf)
    g.update({"ffn." + k: v for k, v in zip(FFN, d)})
    dz, g["norm2.gamma"], g["norm2.beta"] = L.layer_norm_backward(dz + dh, c2)
    dq, dmem, *d = L.multi_head_attention_backward(dz, cb)
    g.update({"cross_attn." + k: v for k, v in zip(ATT, d)})
    dz, g["norm1.gamma"], g["norm1.beta"] = L.layer_norm_backward(dz + dq, c1)
    dq, dkv, *d = L.multi_head_attention_backward(dz, ca)
    g.update({"self_attn." + k: v for k, v in zip(ATT, d)})
    return dz + dq + dkv, dmem, g


def _layers(params, side):
    return sorted({int(k.split(".")[1]) for k in params if k.startswith(side + ".")})


def _sub(params, prefix):
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def _embed(ids, E, D):
    x, ce = L.embedding_forward(ids, E, math.sqrt(D))
    table = B.to_device(L.sinusoidal_table(ids.shape[1], D, "float64")).astype(E.dtype)
    x, cp = L.positional_forward(x, table)
    return x, (ce, cp)


def transformer_forward(src, tgt_in, params, n_heads, eps=1e-6):
    E = params["embedding.weight"]
    D = E.shape[1]
    src_mask, tgt_mask = M.padding_mask(src), M.decoder_mask(tgt_in)
    x, cs = _embed(src, E, D)
    enc = []
    for i in _layers(params, "encoder"):
        x, c = encoder_layer_forward(x, src_mask, _sub(params, f"encoder.{i}."), n_heads, eps)
        enc.append(c)
    memory = x
    y, ct = _embed(tgt_in, E, D)
    dec = []
    for i in _layers(params, "decoder"):
        y, c = decoder_layer_forward(y, memory, src_mask, tgt_mask, _sub(params, f"decoder.{i}."), n_heads, eps)
        dec.append(c)
    logits = y @ E.T
    return logits, (E, y, cs, ct, enc, dec)


def transformer_backward(dlogits, cache):
    E, y, cs, ct, enc, dec = cache
    D = E.shape[1]
    g = {"embedding.weight": dlogits.reshape(-1, E.shape[0]).T @ y.reshape(-1, D)}
    dy = dlogits @ E
    dmem = 0
    for i in reversed(range(len(dec))):
        dy, dm, gi = decoder_layer_backward(dy, dec[i])
        dmem = dmem + dm
        g.update({f"decoder.{i}.{k}": v for k, v in gi.items()})
    dy, _ = L.positional_backward(dy, ct[1])
    g["embedding.weight"] = g["embedding.weight"] + L.embedding_backward(dy, ct[0])
    dx = dmem
    for i in reversed(range(len(enc))):
        dx, gi = encoder_layer_backward(dx, enc[i])
        g.update({f"encoder.{i}.{k}": v for k, v in gi.items()})
    dx, _ = L.positional_backward(dx, cs[1])
    g["embedding.weight"] = g["embedding.weight"] + L.embedding_backward(dx, cs[0])
    return g
