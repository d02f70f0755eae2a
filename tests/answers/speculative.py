"""A learner's answer to lessons/exercises/speculative.py, written from its docstring:
attn-check must pass it."""
from attn import backend as B


def speculative_accept(p, q, drafts, u, v):
    xp = B.get_array_module(p)
    keep = u < p[drafts] / q[drafts]
    residual = xp.maximum(p - q, 0)
    cdf = xp.cumsum(residual / residual.sum()) if residual.sum() > 0 else xp.cumsum(p)
    drawn = (cdf[None, :] > v[:, None]).argmax(axis=1)
    return xp.where(keep, drafts, drawn).astype(drafts.dtype)
