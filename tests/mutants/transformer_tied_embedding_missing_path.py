"""The whole model whose backward forgets one of the shared embedding's three gradient
paths: the output projection's (logits = h @ E^T). Built on attn.model with the matrix
untied and copied three ways, so that each path's gradient is at hand."""
import dataclasses

from attn.grader.solutions import _config
from attn.model import Transformer


def transformer_forward(src, tgt_in, params, n_heads, eps=1e-6):
    E = params["embedding.weight"]
    cfg = dataclasses.replace(_config(params, n_heads, eps, int(E.shape[0])), share_embeddings=False)
    untied = {k: v for k, v in params.items() if k != "embedding.weight"}
    untied.update({"src_embedding.weight": E, "tgt_embedding.weight": E, "generator.weight": E})
    m = Transformer(cfg, dtype=E.dtype, params=untied)
    logits, cache = m.forward(src, tgt_in)
    return logits, (m, cache)


def transformer_backward(dlogits, cache):
    m, c = cache
    g = m.backward(dlogits, c)
    g["embedding.weight"] = g.pop("src_embedding.weight") + g.pop("tgt_embedding.weight")
    del g["generator.weight"]                 # the output projection's path, lost
    return g
