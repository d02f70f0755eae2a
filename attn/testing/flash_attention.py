"""The registration of FlashAttention (lesson 27): its examples (tile sizes that do not divide
the lengths, padding, the causal flag, fully masked rows, large scores), the invariants a reader
states aloud and its hints, read from :data:`attn.testing.registry.LAYERS` like every other."""
from __future__ import annotations

from hypothesis import strategies as st

from .. import backend as B
from .invariants import InvariantError, _dev, _host, _out
from . import mistakes as M
from . import explicit as X
from .layers import Example, Factor, Layer, Mistake, seeds
from .strategies import leading_shapes, normals, padding_masks

np = B.host


@st.composite
def flash_attention_examples(draw):
    lead = draw(leading_shapes(0, 2, max_side=2))
    Tq, Tk, Dk, Dv = (draw(st.integers(1, n)) for n in (7, 7, 3, 3))
    hard = draw(st.booleans())       # scores in the hundreds: exp() overflows without the running maximum
    q = draw(normals(lead + (Tq, Dk), 30.0 if hard else 1.0))
    k, v = draw(normals(lead + (Tk, Dk), 10.0 if hard else 1.0)), draw(normals(lead + (Tk, Dv)))
    mask = None
    if draw(st.booleans()):          # padding; with lead == () one row of keys, possibly all masked
        mask = draw(padding_masks(lead[0], Tk)) if lead else np.array(draw(st.lists(st.booleans(), min_size=Tk,
                                                                                       max_size=Tk)))
        mask = mask.reshape(lead[:1] + (1,) * (len(lead) - 1) + (1, Tk)) if lead else mask[None]
    return Example((("q", q), ("k", k), ("v", v), ("mask", mask), ("q_tile", draw(st.integers(1, 4))),
                    ("k_tile", draw(st.integers(1, 4))), ("causal", draw(st.booleans()))),
                   ("q", "k", "v"), gradcheck=not hard, seed=draw(seeds))


def _differs(a, b) -> float:
    a, b = _host(a), _host(b)
    return float(np.abs(a - b).max(initial=0.0)) if a.shape == b.shape else float("inf")


def _weights_kept(cache, shape: tuple, depth: int = 0) -> bool:
    """Whether a cache made of tuples, lists and dicts holds a float array of ``shape``: the
    weights or the scores of every query and key. (A cache that stayed in the grader's child
    process, an object of the learner's own class, cannot be looked into.)"""
    if depth > 4:
        return False
    if isinstance(cache, (tuple, list, dict)):
        return any(_weights_kept(x, shape, depth + 1) for x in (cache.values() if isinstance(cache, dict) else cache))
    return tuple(getattr(cache, "shape", ())) == shape and getattr(cache, "dtype", None) is not None \
        and cache.dtype.kind == "f"


def _skips_the_causal_tiles(fwd, q, k, v, mask, tiles) -> None:
    """With causal=True the first query tile skips the key tiles after every key it may see.
    Their values are made NaN and the mask hides them from every query: skipped, they leave
    that tile's output as it is with zeros there; computed and masked, 0 * NaN reaches it."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    i1 = min(tiles[0], Tq)
    skipped = [j0 for j0 in range(0, Tk, tiles[1]) if j0 > i1 - 1 + Tk - Tq]
    if not skipped:
        return
    J = skipped[0]
    hide = (np.arange(Tk) < J)[None, :]
    hide = hide if mask is None else np.asarray(mask) & hide
    runs = []
    for fill in (np.nan, 0.0):
        v2 = v.copy()
        v2[..., J:, :] = fill
        runs.append(_host(_out(fwd(_dev(q), _dev(k), _dev(v2), _dev(hide), *tiles, True)))[..., :i1, :])
    if not np.isfinite(runs[0]).all() or _differs(*runs) > 1e-9 * (np.abs(runs[1]).max(initial=0.0) + 1):
        raise InvariantError(f"with causal=True and tiles of {tiles[0]} queries and {tiles[1]} keys, NaN in the values "
                             f"of keys {J} to {Tk - 1}, after every key the first query tile may see and hidden from "
                             "every query by the mask, reaches that tile's output: its key tiles were computed and "
                             "masked, not skipped",
                             "skip a key tile when its first key j0 lies after every key the query tile's last query "
                             "may see (j0 > i1 - 1 + Tk - Tq): a masked tile costs as much as a visible one")


def flash_attention_invariants(f, ex):
    """``causal=True`` is the same attention as the look-ahead mask given as a mask (query i sees
    keys up to i + Tk - Tq), with the example's tiles and with one tile; the cache keeps no array
    of Tq x Tk; and the tiles change nothing: one tile of every query and key gives the same
    output and gradients."""
    fwd, bwd = f["flash_attention_forward"], f.get("flash_attention_backward")
    q, k, v, mask, causal = (ex.get(n) for n in ("q", "k", "v", "mask", "causal"))
    Tq, Tk = q.shape[-2], k.shape[-2]
    tiles = ex.get("q_tile"), ex.get("k_tile")
    runs = {t: fwd(_dev(q), _dev(k), _dev(v), _dev(mask), *t, causal) for t in (tiles, (Tq, Tk))}
    tiled, whole = runs[tiles], runs[(Tq, Tk)]
    scale = 1e-9 * (np.abs(_host(_out(whole))).max(initial=0.0) + 1)
    look_ahead = np.tril(np.ones((Tq, Tk), dtype=bool), k=Tk - Tq)
    for t, run in runs.items() if causal else ():
        given = _out(fwd(_dev(q), _dev(k), _dev(v), _dev(look_ahead if mask is None else mask & look_ahead), *t,
                         False))
        if _differs(_out(run), given) > scale:
            raise InvariantError(f"with causal=True and tiles of {t[0]} queries and {t[1]} keys the output differs "
                                 "from the same attention given the look-ahead mask as its mask: a tile a query may "
                                 "see was skipped, or a key it may not see was read",
                                 "skip a key tile only when its first key j0 lies after every key the query tile's "
                                 "last query may see (j0 > i1 - 1 + Tk - Tq); mask the keys after each query's own "
                                 "in the tiles that cross the diagonal")
    if causal:
        _skips_the_causal_tiles(fwd, q, k, v, mask, tiles)
    Dk, Dv = q.shape[-1], v.shape[-1]
    if Tk not in (1, Dk, Dv) and _weights_kept(tiled[1], q.shape[:-1] + (Tk,)):   # else q, v, out or lse look alike
        raise InvariantError(f"the forward's cache holds an array of shape {q.shape[:-1] + (Tk,)}, one number for "
                             "every query and key: the weights or the scores, which are what the tiles avoid keeping",
                             "keep the inputs, the output and one log-sum-exp per query; the backward recomputes "
                             "each tile's weights as exp(s - lse)")
    if _differs(_out(tiled), _out(whole)) > scale:
        raise InvariantError(f"tiles of {tiles[0]} queries and {tiles[1]} keys give an output that differs from one "
                             f"tile of all {Tq} queries and {Tk} keys by {_differs(_out(tiled), _out(whole)):.3g}",
                             "when a tile raises a query's running maximum from m_old to m_new, multiply its "
                             "running sum l and its accumulated output by exp(m_old - m_new)")
    if bwd is None:
        return
    dout = B.host_rng(ex.seed).standard_normal(_host(_out(whole)).shape)
    for name, g, w in zip(("dq", "dk", "dv"), bwd(_dev(dout), tiled[1]), bwd(_dev(dout), whole[1])):
        if _differs(g, w) > 1e-9 * (np.abs(_host(w)).max(initial=0.0) + 1):
            raise InvariantError(f"{name} with tiles of {tiles[0]} queries and {tiles[1]} keys differs from {name} "
                                 f"with one tile by {_differs(g, w):.3g}: the backward depends on the tiles",
                                 "recompute each tile's weights as exp(s - lse) from the forward's log-sum-exp "
                                 "of the whole row, and D = rowsum(dout * out) of the whole row")


FLASH_ATTENTION = Layer(
    "flash_attention", "pair", ("flash_attention_forward", "flash_attention_backward"), flash_attention_examples(),
    flash_attention_invariants,
    {"forward": "per query tile, over the key tiles: s = q_i @ k_j.T / sqrt(d_k) (-inf where masked); "
                "m_new = max(m, rowmax(s)); p = exp(s - m_new); l = exp(m - m_new) * l + rowsum(p); "
                "acc = exp(m - m_new) * acc + p @ v_j; at the end out = acc / l, lse = m + log(l) (a row with "
                "no visible key: out = 0, lse = +inf)",
     "dq": "p = exp(s - lse); dp = dout_i @ v_j.T; ds = p * (dp - D) / sqrt(d_k) with D = rowsum(dout * out); "
           "dq_i += ds @ k_j",
     "dk": "dk_j += ds.T @ q_i, ds as for dq, summed over every query tile that reads key tile j",
     "dv": "dv_j += p.T @ dout_i with p = exp(s - lse), summed over every query tile that reads key tile j"},
    where={"forward": "what happens to the running sum and the accumulated output when the maximum grows; "
                      "which key tiles a causal query tile may skip",
           "dq": "D replaces rowsum(p * dp): which two arrays give it, and is it the whole row's",
           "dk": "the scale 1/sqrt(d_k) of the scores applies to their gradient",
           "dv": "the weights recomputed from the log-sum-exp, not from a tile's own maximum"},
    mistakes=(Mistake("forward", M.flash_first_tile_unseen, "zero for the queries whose first key tile has no key "
                      "they may see (keys padded on the left): a running maximum of -inf made exp(s - m) NaN",
                      "while a query's running maximum is still -inf (no visible key yet), subtract 0 instead: "
                      "exp(-inf - 0) = 0 leaves its l and acc at zero until a tile shows it a key"),
              Mistake(("dq", "dk"), M.flash_tile_d, "the gradient with D = rowsum(p * dp) of each key tile",
                      "D = rowsum(dout * out) of the whole row: a tile's p does not sum to one over the row"),
              Factor(("dq", "dk"), M.scores_scale, "1/sqrt(d_k) of the scores", True,
                     "the scale of the scores, 1/sqrt(d_k), applies to their gradient: ds is multiplied by it "
                     "too")), explicit=X.flash_attention())
