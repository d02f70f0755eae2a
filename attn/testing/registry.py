"""Every layer the tests and the grader know, each registered once: the names of its functions,
where the library's own live, a hypothesis strategy of examples (hard inputs included), the
invariants a reader states aloud, the hints at each level (the symptom a check reports, then
``where`` to look, then the formula: ``attn-check --hint 2``, ``--hint 3``), and each
exercise's manifest (what its starter asks for, what it gives).

The tests (``tests/test_registry.py``), the grader (:mod:`attn.grader`) and the book's API
page (``book/api/layers.md``) read :data:`LAYERS` and :data:`EXERCISES`; nothing adds to them
later. Adding a layer: its module in :mod:`attn.layers` (and its names in the package's
``__init__``), its :class:`Layer` here (with its examples and invariants, where no other layer
shares them, as RMSNorm's below, and the typical mistakes the grader should name, each a
:class:`Mistake` whose wrong result :mod:`attn.testing.mistakes` computes), a :class:`Manifest`
if it has a starter of its own, the starter in ``lessons/exercises/``, its answer in
``tests/answers/``, three or more typical mistakes written as a learner would in
``tests/typical_mistakes.py`` (``tests/test_hints.py`` grades them) and a lesson that names it.
"""
from __future__ import annotations

from typing import NamedTuple

from hypothesis import strategies as st

from .. import backend as B
from . import decoding_mistakes as D
from . import explicit as X
from . import mistakes as M
from .exercises import (adam_examples, average_examples, bpe_examples, compare_arrays_by_name, compare_decoded,
                        compare_merges, decoder_layer_examples, decoder_mask_examples, decoding_examples,
                        encoder_layer_examples, explain_tied_embedding, luong_examples, luong_invariants,
                        noam_examples, transformer_examples)
from .flash_attention import FLASH_ATTENTION
from .invariants import InvariantError, _dev, _first, _host, _out
from .decoder_only import DECODER_ONLY_LAYER
from .later_block import LATER_BLOCK
from .quantize import INT8
from .speculative import SPECULATIVE
from .lora import LORA_LAYERS
from .layers import (HINT_RESHAPE, Example, Factor, Layer, Mistake, Term, attention_examples, attention_invariants, causal_invariants,
                     causal_mask_examples, cross_entropy_examples, cross_entropy_invariants, dropout_examples,
                     dropout_invariants, embedding_examples, embedding_invariants, feed_forward_examples,
                     heads_invariants, layer_norm_examples, layer_norm_invariants, linear_examples,
                     merge_heads_examples, mha_invariants, multi_head_attention_examples, padding_mask_examples,
                     positional_examples, positional_invariants, relu_examples, residual_ffn_examples, rnn_examples,
                     rnn_invariants, rnn_step_examples, seeds, sinusoidal_examples, sinusoidal_invariants,
                     softmax_examples, softmax_invariants, split_heads_examples)
from .strategies import SCALE, floats, leading_shapes, normals

np = B.host


# ----------------------------------------------------------------------------- RMSNorm


@st.composite
def rmsnorm_examples(draw):
    lead, D = draw(leading_shapes(1, 3)), draw(st.integers(1, 6 * SCALE[0]))
    if not draw(st.booleans()):      # (hypothesis starts from False: gradient checks first)
        eps = draw(st.sampled_from([1e-6, 1e-3, 0.1]))
        x = draw(normals(lead + (D,), draw(st.sampled_from([1.0, 0.1, 10.0]))))
        gradcheck = True
    else:                            # hard: hypothesis' values, rows of zeros included
        eps = draw(st.sampled_from([1e-6, 1e-2]))
        x = draw(floats(lead + (D,), bound=100.0))
        gradcheck = False
    return Example((("x", x), ("gamma", draw(normals((D,)))), ("eps", eps)), ("x", "gamma"), gradcheck=gradcheck,
                   seed=draw(seeds))


def assert_rmsnorm_properties(forward, backward, x, eps: float, gamma, dout) -> None:
    """Scaling a row leaves the output unchanged (with ``eps = 0``, rows not near zero); with
    gamma = 1 each row's mean square is ``ms / (ms + eps)``; and, with ``backward``,
    ``sum(dx * x) = sum(g * xhat) * eps / (ms + eps)`` with ``g = dout * gamma`` (zero without
    eps: the scale has no gradient)."""
    D = x.shape[-1]
    ones = np.ones(D)
    live = (x * x).mean(axis=-1) > 1e-100                  # rows whose mean square is a normal number
    if live.any():
        a, b = (_host(_out(forward(_dev(c * x[live]), _dev(ones), 0.0))) for c in (1.0, 3.0))
        if not np.allclose(a, b, rtol=1e-10, atol=1e-12):
            raise InvariantError("with eps = 0, scaling a row by 3 changed the output: the row's scale leaks through",
                                 "divide each row by its own root mean square over the last axis")
    ms = (x * x).mean(axis=-1)
    got, want = (_host(_out(forward(_dev(x), _dev(ones), eps))) ** 2).mean(axis=-1), ms / (ms + eps)
    if not (np.abs(got - want) <= 1e-8 + 1e-8 * want).all():
        i = _first(~(np.abs(got - want) <= 1e-8 + 1e-8 * want))
        raise InvariantError(f"with gamma = 1, row {i} of the output has mean square {got[i]:.10g}, expected "
                             f"ms / (ms + eps) = {want[i]:.10g}", "the mean of x**2 over D, eps inside the square root")
    if backward is None:                                   # the forward's checks: the backward comes later
        return
    _, cache = forward(_dev(x), _dev(gamma), eps)
    dx = _host(backward(_dev(dout), cache)[0])
    xhat = x / np.sqrt(ms + eps)[..., None]
    lhs, rhs = (dx * x).sum(axis=-1), (dout * gamma * xhat).sum(axis=-1) * eps / (ms + eps)
    scale = np.abs(dx * x).sum(axis=-1) + np.abs(dout * gamma * xhat).sum(axis=-1)
    if not (np.abs(lhs - rhs) <= 1e-9 * scale + 1e-12).all():
        i = _first(~(np.abs(lhs - rhs) <= 1e-9 * scale + 1e-12))
        raise InvariantError(f"row {i}: sum(dx * x) is {lhs[i]:.6g}, expected sum(g * xhat) * eps / (ms + eps) = "
                             f"{rhs[i]:.6g}: the gradient of the row's scale is wrong",
                             "the root mean square depends on every x of the row: dx = rrms * (g - xhat * "
                             "mean(g * xhat))")


def rmsnorm_invariants(f, ex):
    x = ex.get("x")
    assert_rmsnorm_properties(f["rmsnorm_forward"], f.get("rmsnorm_backward"), x, ex.get("eps"), ex.get("gamma"),
                              B.host_rng(ex.seed).standard_normal(x.shape))


RMSNORM = Layer("rmsnorm", "pair", ("rmsnorm_forward", "rmsnorm_backward"), rmsnorm_examples(), rmsnorm_invariants,
                {"forward": "out = gamma * x / sqrt(mean(x**2) + eps) over the last axis: no mean subtracted, no beta",
                 "dx": "dx = rrms * (g - xhat * mean(g * xhat)), g = dout * gamma, rrms = 1/sqrt(mean(x**2) + eps)",
                 "dgamma": "dgamma = sum(dout * xhat) over every row (every axis but the last)"},
                where={"forward": "the mean square (over which axis?) and where eps goes",
                       "dx": "the root mean square depends on every x of the row: one term besides the direct one",
                       "dgamma": "which axes dgamma is summed over, and what multiplies dout"}, mistakes=(
        Mistake("forward", M.rmsnorm_mean_subtracted, "layer norm: the mean subtracted",
                "RMSNorm divides by the root mean square of x itself: no mean subtracted, no beta"),
        Mistake("forward", M.rmsnorm_eps_outside, "x / (sqrt(mean(x**2)) + eps): eps outside the square root",
                "eps goes inside the square root: x / sqrt(mean(x**2) + eps)"),
        Mistake("dx", M.rmsnorm_dx_direct_only, "rrms * g alone: the root mean square's own term is missing",
                "the root mean square depends on every x of the row: dx = rrms * (g - xhat * mean(g * xhat))")),
                explicit=X.rmsnorm())


#: Where the terms of layer norm's dx and softmax's come from, and the scale of attention's
#: scores (hint 2), for each layer that has them.
LN_MEAN = "mean of the row depends on every x of the row: its gradient takes mean(g) from every entry"
LN_VARIANCE = "rstd = 1/sqrt(var + eps) depends on every x of the row too: it is not a constant of the backward"
NORMALISER = ("each output depends on every logit of its row through the normaliser (the sum in the denominator), "
              "not only on its own logit")
SCORES_SCALE = "the scale of the scores, 1/sqrt(d_k), applies to their gradient: ds is multiplied by it too"

LAYERS: dict[str, Layer] = {layer.name: layer for layer in [
    Layer("linear", "pair", ("linear_forward", "linear_backward"), linear_examples(), None, {
        "forward": "out = x @ w + b over the last axis (flatten the leading axes to (N, Din) first)",
        "dx": "dx = dout @ w.T",
        "dw": "dw = x.T @ dout with x and dout flattened to (N, Din) and (N, Dout): summed over every leading axis",
        "db": "db = dout summed over every axis but the last"},
          where={"forward": "the affine map over the last axis, with any number of leading axes",
                 "dx": "which matrix multiplies dout, and whether it is transposed",
                 "dw": "which two arrays are multiplied, in which order, and the leading axes: every position "
                      "contributes to dw",
                 "db": "which axes the bias gradient is summed over"}, mistakes=(
        Factor(("dw", "db"), M.one_over_rows, "1/{inverse}, one over the number of rows: a mean over the rows "
               "instead of their sum", False, ""),), explicit=X.linear()),
    Layer("relu", "pair", ("relu_forward", "relu_backward"), relu_examples(), None, {
        "forward": "out = max(x, 0)",
        "dx": "dx = dout * (x > 0): the mask comes from the forward's input, not from dout"},
          where={"forward": "where the output is zero",
                 "dx": "which array decides where the gradient passes"}, mistakes=(
        Mistake("dx", lambda ex, dout: dout, "dout itself: the ReLU's mask (x > 0) is missing",
                "which array decides where the gradient passes: the forward's input x"),
        Mistake("dx", lambda ex, dout: dout * (dout > 0), "dout * (dout > 0): the mask comes from dout instead of x",
                "the mask is the forward's: where x > 0, whatever the sign of dout"),
        Mistake("dx", lambda ex, dout: dout * (ex.get("x") <= 0), "dout * (x <= 0): the mask is inverted",
                "which side of 0 passes the gradient")), explicit=X.relu()),
    Layer("dropout", "pair", ("dropout_forward", "dropout_backward"), dropout_examples(), dropout_invariants, {
        "forward": "keep a unit where rng.random(x.shape) >= p and scale kept units by 1/(1-p); identity when "
                   "p == 0 or rng is None",
        "dx": "dx = dout * mask with the forward's scaled mask, kept in the cache (never a new draw)"},
          where={"forward": "what happens to a kept unit, and when dropout is off",
                 "dx": "which mask the backward applies, and where it comes from"}, explicit=X.dropout()),
    Layer("embedding", "pair", ("embedding_forward", "embedding_backward"), embedding_examples(),
          embedding_invariants, {
        "forward": "out = W[ids] * scale",
        "dW": "repeated ids must accumulate (np.add.at / attn.backend.scatter_add), and the scale applies to dW too"},
          where={"forward": "the row lookup and the scale",
                 "dW": "what happens when an id occurs twice, and whether the scale reaches dW"}, mistakes=(
        Mistake("dW", M.embedding_ids_overwrite, "dW[ids] += g: a repeated id keeps one position's gradient",
                "what happens when an id occurs twice: dW[ids] += g writes each row once; accumulate with "
                "np.add.at (attn.backend.scatter_add)"),
        Mistake("dW", M.embedding_unscaled_grad, "the expected without the factor scale",
                "the forward multiplied the rows by the scale: dW gets the scale too")), explicit=X.embedding()),
    Layer("positional", "pair", ("positional_forward", "positional_backward"), positional_examples(),
          positional_invariants, {
        "forward": "out = x + table[:T]",
        "dx": "out = x + table[:T], so dx = dout",
        "dtable": "dtable[:T] = dout summed over the batch axis; rows T.. are zero"},
          where={"forward": "which rows of the table are added",
                 "dx": "what the addition passes back to x",
                 "dtable": "every sentence of the batch adds the same rows: what does each row receive?"}, mistakes=(
        Mistake("dtable", M.positional_first_sentence, "the first sentence's dout alone",
                "every sentence of the batch adds the same rows: each row receives the sum over the batch"),
        Mistake("dtable", M.positional_batch_mean, "a mean over the batch instead of its sum",
                "every sentence of the batch adds the same rows: their gradients add up, none is divided")),
          explicit=X.positional()),
    Layer("sinusoidal_table", "function", ("sinusoidal_table",), sinusoidal_examples(), sinusoidal_invariants, {
        "sinusoidal_table": "column 2i is sin(pos / 10000^(2i/d_model)), column 2i+1 the cos of the same angle"},
          where={"sinusoidal_table": "which columns hold sines and which cosines, and the exponent of 10000"},
          mistakes=(
        Mistake("sinusoidal_table", M.sinusoidal_halves, "sines in the first half of the columns, cosines in the "
                "second", "the columns interleave: 2i the sine, 2i+1 the cosine of the same angle"),
        Mistake("sinusoidal_table", M.sinusoidal_column_exponent, "each column's angle from its own index j, "
                "pos / 10000^(j/d_model)", "columns 2i and 2i+1 share one angle: the exponent of 10000 is 2i/d_model "
                "for both")), explicit=X.sinusoidal_table()),
    Layer("softmax", "pair", ("softmax_forward", "softmax_backward"), softmax_examples(), softmax_invariants, {
        "forward": "subtract the row max before exp; masked logits -> the dtype's most negative finite value before "
                   "exp, masked outputs -> 0 after",
        "dx": "dx = y * (dy - sum(dy * y, axis=-1, keepdims=True))"},
          where={"forward": "large logits (overflow), masked logits, and a row whose keys are all masked",
                 "dx": "each output depends on every logit of its row through the normaliser"}, mistakes=(
        Term("dx", M.softmax_normaliser_term, "the normaliser's term -y * sum(dy * y)", NORMALISER),),
          explicit=X.softmax()),
    Layer("layer_norm", "pair", ("layer_norm_forward", "layer_norm_backward"), layer_norm_examples(),
          layer_norm_invariants, {
        "forward": "gamma * (x - mean) / sqrt(var + eps) + beta over the last axis, biased variance",
        "dx": "dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * gamma: the mean and the variance "
              "both depend on every x of the row",
        "dgamma": "dgamma = sum(dout * xhat) over every row (every axis but the last)",
        "dbeta": "dbeta = sum(dout) over every row (every axis but the last)"},
          where={"forward": "the mean, the variance (which divisor?) and where eps goes",
                 "dx": "the mean and the variance both depend on every x of the row: two terms besides the direct one",
                 "dgamma": "which axes dgamma is summed over, and what multiplies dout",
                 "dbeta": "which axes dbeta is summed over"}, mistakes=(
        Term("dx", M.layer_norm_mean_term, "the mean term -rstd * mean(g)", "the " + LN_MEAN),
        Term("dx", M.layer_norm_variance_term, "the variance term -rstd * xhat * mean(g * xhat)", LN_VARIANCE)),
          explicit=X.layer_norm()),
    Layer("feed_forward", "pair", ("feed_forward_forward", "feed_forward_backward"), feed_forward_examples(), None, {
        "forward": "out = relu(x @ w1 + b1) @ w2 + b2: one ReLU, between the two linear maps",
        "dx": "backward runs the steps in reverse: linear 2, dropout, ReLU (mask from its input), linear 1",
        "dw1": "dw1 = x.T @ dh with dh the gradient after the ReLU's mask (flatten leading axes)",
        "dw2": "dw2 = a.T @ dout with a the ReLU's (dropped-out) output (flatten leading axes)"},
          where={"forward": "the order of the steps: linear, ReLU, (dropout), linear",
                 "dx": "the steps in reverse order, the ReLU's mask from its own input",
                 "dw1": "the gradient reaching the first linear map: after the ReLU's mask",
                 "dw2": "the activation that entered the second linear map"}, mistakes=(
        Mistake("forward", M.ffn_no_relu, "(x @ w1 + b1) @ w2 + b2: the ReLU is missing",
                "the ReLU between the two linear maps: without it the two are one linear map"),
        Mistake("forward", M.ffn_relu_last, "relu((x @ w1 + b1) @ w2 + b2): the ReLU after the second linear map",
                "the order of the steps: the ReLU acts on the hidden layer, before the second linear map"),
        Mistake("dx", M.ffn_dx_no_mask, "dout @ w2.T @ w1.T: the ReLU's mask is missing in the backward",
                "the gradient reaching the first linear map passes the ReLU's mask (h > 0) on its way back"),
        Mistake("dw2", M.ffn_dw2_before_relu, "h.T @ dout with h = x @ w1 + b1 before the ReLU",
                "the activation that entered the second linear map: the ReLU's output, not its input")),
          explicit=X.feed_forward()),
    Layer("residual_ffn", "pair", ("residual_ffn_forward", "residual_ffn_backward"), residual_ffn_examples(), None, {
        "forward": "out = layer_norm(x + FFN(x)): the sub-layer's input added to its output, then the norm",
        "dx": "z = x + FFN(x) reaches x by two paths: dx = dz + (FFN's dx of dz); without dz the skip path is gone"},
          where={"forward": "what is added before the norm",
                 "dx": "x reaches the output by two paths: the skip path and the network"}, mistakes=(
        Term("dx", M.residual_skip_term, "the skip path's dz", "x reaches z = x + FFN(x) by two paths: the skip "
             "path passes dz to x unchanged"),
        Term("dx", M.residual_norm_mean_term, "the layer norm's mean term -rstd * mean(g)", "the layer norm's "
             + LN_MEAN),
        Term("dx", M.residual_norm_variance_term, "the layer norm's variance term -rstd * xhat * mean(g * xhat)",
             "the layer norm's " + LN_VARIANCE)), explicit=X.residual_ffn()),
    Layer("attention", "pair", ("attention_forward", "attention_backward"), attention_examples(),
          attention_invariants, {
        "forward": "out = softmax(q @ k.T / sqrt(d_k), mask) @ v: the mask goes into the softmax, before it "
                   "normalises",
        "dq": "ds = softmax_backward(dout @ v.T) * (1/sqrt(d_k)); dq = ds @ k: the scale of the scores applies "
              "to their gradient",
        "dk": "dk = ds.T @ q with ds already scaled by 1/sqrt(d_k)",
        "dv": "dv = weights.T @ dout (the dropped-out weights when dropout is on)"},
          where={"forward": "where the mask is applied (before or after the normalisation) and the scale of the scores",
                 "dq": "the scale of the scores applies to their gradient too",
                 "dk": "the scale of the scores, and which side of the product k is on",
                 "dv": "which weights multiplied v in the forward (after dropout)"}, mistakes=(
        Term(("dq", "dk"), M.attention_normaliser_term, "the softmax's normaliser's term -y * sum(dy * y)",
             "the softmax inside: " + NORMALISER),
        Factor(("dq", "dk"), M.scores_scale, "1/sqrt(d_k) of the scores", True, SCORES_SCALE)), explicit=X.attention()),
    Layer("split_heads", "function", ("split_heads",), split_heads_examples(), heads_invariants,
          {"split_heads": HINT_RESHAPE},
          where={"split_heads": "the order of reshape and transpose: which columns go to which head"}, mistakes=(
        Mistake("split_heads", M.split_interleaved, "x.reshape(B, T, D/H, H): the heads interleaved, head h "
                "taking every H-th column", "head h takes the columns h*Dh .. (h+1)*Dh - 1: reshape to (B, T, H, Dh)"),
        Mistake("split_heads", M.split_reshaped_only, "x.reshape(B, H, T, Dh) with no transpose: the positions "
                "mixed into the heads", "reshape to (B, T, H, Dh) first, so that each position keeps its own "
                "features, then swap the T and H axes"),
        Mistake("split_heads", M.split_untransposed, "x.reshape(B, T, H, Dh) without the transpose to (B, H, T, Dh)",
                "the heads' axis comes before the positions': transpose(0, 2, 1, 3) after the reshape")),
          explicit=X.split_heads()),
    Layer("merge_heads", "function", ("merge_heads",), merge_heads_examples(), heads_invariants,
          {"merge_heads": "transpose (B, H, T, Dh) to (B, T, H, Dh), then reshape to (B, T, H*Dh)"},
          where={"merge_heads": "the inverse of split_heads: transpose back before reshaping"}, mistakes=(
        Mistake("merge_heads", M.merge_reshaped_only, "x.reshape(B, T, H*Dh) with no transpose: the heads' "
                "positions mixed", "transpose (B, H, T, Dh) to (B, T, H, Dh) before the reshape"),
        Mistake("merge_heads", M.merge_interleaved, "the heads interleaved: each head's features spread H "
                "columns apart", "transpose to (B, T, H, Dh), heads before features, so that head h's features "
                "are the columns h*Dh .. (h+1)*Dh - 1"),
        Mistake("merge_heads", M.merge_features_first, "x.reshape(B, H*Dh, T) then swapped: features and "
                "positions mixed", "the reshape keeps each position's features together only after the "
                "transpose to (B, T, H, Dh)")), explicit=X.merge_heads()),
    Layer("multi_head_attention", "pair", ("multi_head_attention_forward", "multi_head_attention_backward"),
          multi_head_attention_examples(), mha_invariants, {
        "forward": "project q, k, v; split_heads; attention with the mask; merge_heads; output projection. "
                   + HINT_RESHAPE,
        "dx_kv": "x_kv feeds both the keys and the values: dx_kv = dx_k + dx_v",
        "dx_q": "split the gradient into heads the same way as the forward, attention backward, merge, then "
                "the query projection's backward"},
          where={"forward": "split_heads: which columns of every position go to each head",
                 "dx_kv": "x_kv feeds two projections",
                 "dx_q": "the query path, through the heads"}, mistakes=(
        Mistake("forward", M.heads_scaled_by_d_model, "the scores divided by sqrt(d_model) instead of sqrt(Dh)",
                "each head's scores are scaled by its own width: 1/sqrt(d_k) with d_k = d_model / n_heads"),
        Mistake("forward", M.heads_no_output_projection, "the merged heads without the output projection w_o, b_o",
                "the last step: merge_heads, then the output projection"),
        Mistake("dx_kv", M.dx_kv_keys_only, "the keys' path alone: the values' gradient is missing",
                "x_kv feeds both the keys and the values: dx_kv = dx_k + dx_v"),
        Mistake("dx_kv", M.dx_kv_values_only, "the values' path alone: the keys' gradient is missing",
                "x_kv feeds both the keys and the values: dx_kv = dx_k + dx_v")), explicit=X.multi_head_attention()),
    Layer("rnn_step", "pair", ("rnn_step_forward", "rnn_step_backward"), rnn_step_examples(), None, {
        "forward": "h = tanh(x @ w_x + h_prev @ w_h + b)",
        "dx": "da = dh * (1 - h**2) (tanh' from its output), then dx = da @ w_x.T",
        "dw_x": "dw_x = x.T @ da, not da.T @ x"},
          where={"forward": "the two products and the nonlinearity",
                 "dx": "tanh's derivative, from its output",
                 "dw_x": "the order of the product"}, mistakes=(
        Mistake(M.STEP_GRADIENTS, M.step_no_tanh_derivative, "the gradient without tanh's derivative: da = dh",
                "the gradient passes tanh on its way back: da = dh * (1 - h**2)"),
        Mistake(M.STEP_GRADIENTS, M.step_tanh_derivative_unsquared, "the gradient of da = dh * (1 - h): tanh's "
                "derivative without the square", "tanh' = 1 - tanh**2 = 1 - h**2: the square of the output"),
        Mistake(M.STEP_GRADIENTS, M.step_tanh_derivative_of_preactivation, "the gradient of da = dh * (1 - a**2), "
                "with a the pre-activation", "tanh' = 1 - tanh(a)**2 is written with the output h = tanh(a), not "
                "with a"),
        Mistake("forward", M.step_tanh_by_exp, "NaN where a is large: tanh written (exp(2a) - 1) / (exp(2a) + 1), "
                "inf / inf once exp(2a) overflows (a > 44 in float32)", "write tanh without exp of a large number: "
                "xp.tanh(a), or 1 - 2 / (exp(2a) + 1)")), explicit=X.rnn_step()),
    Layer("rnn", "pair", ("rnn_forward", "rnn_backward"), rnn_examples(), rnn_invariants, {
        "forward": "h_t = tanh(x_t @ w_x + h_{t-1} @ w_h + b), and h_t = h_{t-1} where the mask is False",
        "dx": "walking t backwards, the gradient reaching h_t is dhs[:, t] plus what step t+1 sent back "
              "(da_{t+1} @ w_h.T); then da_t = g_t * (1 - h_t**2) and dx_t = da_t @ w_x.T",
        "dh0": "walking t backwards, the gradient reaching h_t is dhs[:, t] plus what step t+1 sent back "
               "(da_{t+1} @ w_h.T)",
        "dw_h": "the weights are shared by every step: dw_h = sum over t of h_{t-1}.T @ da_t"},
          where={"forward": "what a masked step does to the state",
                 "dx": "the gradient reaching h_t comes from two places: its own output and the next step",
                 "dh0": "what the first step sends back to the initial state",
                 "dw_h": "the weights are shared by every step"}, mistakes=(
        Mistake("forward", M.rnn_mask_ignored, "every step taken: the mask is ignored",
                "where the mask is False the step is skipped and the state carried: h_t = h_{t-1}"),
        Mistake("dx", M.rnn_no_carry, "each step's gradient from its own output alone: nothing is carried back "
                "from step t+1", "the gradient reaching h_t comes from two places: dhs[:, t] and what step t+1 "
                "sent back, da_{t+1} @ w_h.T"),
        Mistake("dw_h", M.rnn_dw_h_of_h_t, "sum of h_t.T @ da_t: each step's own state instead of the one "
                "before it", "w_h multiplied the state before the step: dw_h = sum over t of h_{t-1}.T @ da_t")),
          explicit=X.rnn()),
    Layer("cross_entropy", "loss", ("cross_entropy",), cross_entropy_examples(), cross_entropy_invariants, {
        "cross_entropy": "loss = mean over real targets of -(1-eps) log p_y - eps mean_v log p_v (log-softmax with "
                         "the row max subtracted)",
        "dlogits": "dlogits = (softmax(logits) - q) / n_real, q = (1-eps) onehot + eps/V, zero rows at padding"},
          where={"cross_entropy": "the smoothing term, padded targets, and what the mean is over",
                 "dlogits": "the gradient of the smoothed loss, and what it is divided by"}, library="attn.loss",
          mistakes=(
        Mistake("dlogits", M.loss_over_every_token, "the gradient of a mean over every position, padding "
                "included", "the mean is over the real targets: divide by their number, not by every position"),
        Mistake("cross_entropy", M.loss_value_over_every_token, "a mean over every position, padding included",
                "the mean is over the real targets: divide by their number, not by every position"),
        Mistake("dlogits", M.loss_without_smoothing, "the gradient without label smoothing",
                "the target distribution q = (1-eps) onehot + eps/V: the smoothing moves eps of the target's "
                "probability to every word"),
        Mistake("cross_entropy", M.loss_value_without_smoothing, "the loss without label smoothing",
                "the smoothed loss: -(1-eps) log p_y - eps mean_v log p_v"),
        Mistake("dlogits", M.loss_gradient_of_the_sum, "the gradient of the sum over the targets, not of their "
                "mean", "the loss is a mean: its gradient is divided by the number of real targets")),
          explicit=X.cross_entropy()),
    Layer("causal_mask", "function", ("causal_mask",), causal_mask_examples(), causal_invariants, {
        "causal_mask": "query i sees keys 0..i, itself included: tril with the diagonal, shape (1, 1, T, T)"},
          where={"causal_mask": "the diagonal: may a position see itself?"}, library="attn.masks", mistakes=(
        Mistake("causal_mask", M.causal_without_diagonal, "tril(ones, -1): the diagonal excluded",
                "a position may see itself: tril with the diagonal (k=0)"),
        Mistake("causal_mask", M.causal_one_ahead, "tril(ones, 1): each position sees the next one too",
                "query i sees keys 0..i and no later one: tril with k=0, not k=1"),
        Mistake("causal_mask", M.causal_upper, "triu: each position sees the future and not the past",
                "the lower triangle (tril) is the past: query i, row i, sees the keys up to column i"),
        Mistake("causal_mask", M.causal_without_axes, "(T, T), without the batch and head axes",
                "the mask broadcasts over the batch and the heads: [None, None] makes it (1, 1, T, T)")),
          explicit=X.causal_mask()),
    Layer("padding_mask", "function", ("padding_mask",), padding_mask_examples(), None, {
        "padding_mask": "(ids != pad_id)[:, None, None, :], shape (B, 1, 1, S)"},
          where={"padding_mask": "the shape that broadcasts over heads and queries"}, library="attn.masks",
          mistakes=(
        Mistake("padding_mask", M.padding_inverted, "(ids == pad_id): True at the padding, the mask inverted",
                "True marks what may be attended to: the real tokens, ids != pad_id"),
        Mistake("padding_mask", M.padding_on_queries, "(B, 1, S, 1): the padding on the queries' axis",
                "a padded key must be hidden from every query: the keys are the last axis, [:, None, None, :]")),
          explicit=X.padding_mask()),
    Layer("luong_attention", "pair", ("luong_attention_forward", "luong_attention_backward"), luong_examples(),
          luong_invariants, {
              "forward": "out = tanh([a @ e ; s] @ w_c + b_c), a = softmax(s @ e^T) with the source mask",
              "ds": "s is used twice (the query of the scores, and half of the concatenation): ds is the sum of both",
              "de": "e is used twice (the keys of the scores, and the values of the context): de is the sum"},
          {"forward": "the scores (which product), the mask, and the order of [context ; state]",
           "ds": "every place s is used", "de": "every place e is used", "dw_c": "the concatenation it multiplied"},
          library="attn.grader.solutions", mistakes=(
        Mistake("forward", M.luong_state_first, "tanh([s ; context] @ w_c + b_c): the state first",
                "the order of the concatenation: [context ; state], the context first"),
        Mistake("ds", M.luong_ds_concatenation_only, "the concatenation's half alone: the scores' path is missing",
                "s is used twice, as the query of the scores and as half of the concatenation: ds is the sum"),
        Mistake("de", M.luong_de_context_only, "the context's path alone: the scores' path is missing",
                "e is used twice, as the keys of the scores and as the values of the context: de is the sum")),
          explicit=X.luong_attention()),
    Layer("decoder_mask", "function", ("decoder_mask",), decoder_mask_examples(), None, {
        "decoder_mask": "causal_mask(T) & padding_mask(tgt_ids): (B, 1, T, T)"},
        {"decoder_mask": "both masks at once: the future and the padded keys"}, library="attn.masks", mistakes=(
        Mistake("decoder_mask", M.decoder_causal_only, "the look-ahead mask alone: padded keys visible",
                "both masks at once: the padding mask of tgt_ids too"),
        Mistake("decoder_mask", M.decoder_padding_only, "the padding mask alone: the future visible",
                "both masks at once: the look-ahead (causal) mask too"),
        Mistake("decoder_mask", M.decoder_either, "causal | padding: a key visible if either mask allows it",
                "a key is visible where both masks allow it: & (and), not | (or)"),
        Mistake("decoder_mask", M.decoder_padding_on_queries, "the padding applied to the queries' axis",
                "the padded keys are hidden: the padding mask on the last axis, [:, None, None, :]")),
          explicit=X.decoder_mask()),
    Layer("encoder_layer", "pair", ("encoder_layer_forward", "encoder_layer_backward"), encoder_layer_examples(),
          None, {"forward": "h = LayerNorm1(x + SelfAttn(x, x, mask)); out = LayerNorm2(h + FFN(h))",
                 "dx": "each Add & Norm: dz from the norm, then dz + (sub-layer backward of dz)"},
          {"forward": "the residual additions and the order of the two sub-layers",
           "dx": "each sub-layer's input reaches its output by two paths: the residual and the sub-layer"},
          library="attn.grader.solutions", mistakes=(
        Mistake("forward", M.encoder_no_residual, "LayerNorm1(SelfAttn(x)): the residual x is not added",
                "each sub-layer is LayerNorm(x + sublayer(x)): the input is added to the attention's output"),
        Mistake("forward", M.encoder_pre_norm, "x + SelfAttn(LayerNorm(x)): the norm before the sub-layer "
                "(pre-norm)", "the paper's layer normalises after the addition: LayerNorm(x + sublayer(x))"),
        Mistake("dx", M.encoder_dx_without_skip, "the attention's dx_q + dx_kv alone: the first residual's path "
                "is missing", "x reaches the first Add & Norm by two paths: dz passes straight back too, "
                "dx = dz + dx_q + dx_kv")), explicit=X.encoder_layer()),
    Layer("decoder_layer", "pair", ("decoder_layer_forward", "decoder_layer_backward"), decoder_layer_examples(),
          None, {"forward": "masked self-attention, cross-attention (queries from x, keys and values from memory, "
                            "src_mask), FFN, each as LayerNorm(x + sublayer(x))",
                 "dmemory": "memory gives the cross-attention its keys and its values: dmemory = dx_kv"},
          {"forward": "which mask each attention uses, and where the queries, keys and values come from",
           "dx": "the three residual paths", "dmemory": "the cross-attention's keys and values"},
          library="attn.grader.solutions", mistakes=(
        Mistake("forward", M.decoder_cross_from_itself, "cross-attention whose keys and values come from the "
                "decoder, not from memory", "the cross-attention's queries come from the decoder, its keys and "
                "values from the encoder's output, memory"),
        Mistake("forward", M.decoder_cross_unmasked, "cross-attention without src_mask: padded source words "
                "attended to", "which mask each attention uses: src_mask hides the padded source words from "
                "the cross-attention"),
        Mistake("forward", M.decoder_self_unmasked, "self-attention without tgt_mask: each word sees the future",
                "the decoder's self-attention takes tgt_mask, the look-ahead mask")), explicit=X.decoder_layer()),
    Layer("transformer", "pair", ("transformer_forward", "transformer_backward"), transformer_examples(), None, {
        "forward": "logits = decoder(embed(tgt_in), encoder(embed(src))) @ E^T with E = embedding.weight, the "
                   "embeddings scaled by sqrt(d_model) plus the sinusoids",
        "dembedding.weight": "dE = (source embedding's dW) + (target embedding's dW) + dlogits^T @ h"},
        {"forward": "the scale of the embeddings, the positions, the masks (padding, look-ahead), the shared "
                    "output projection",
         "dembedding.weight": "embedding.weight is used three times: every use sends back a gradient"},
        explain=explain_tied_embedding, library="attn.grader.solutions", explicit=X.transformer()),
    DECODER_ONLY_LAYER,
    Layer("noam_lr", "function", ("noam_lr",), noam_examples(), None, {
        "noam_lr": "factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)"},
        {"noam_lr": "the two branches of the min, and the 1-based step"}, library="attn.optim", mistakes=(
        Mistake("noam_lr", M.noam_without_d_model, "the schedule without its factor d_model^-0.5",
                "the rate is scaled by d_model^-0.5 as well as by factor"),
        Mistake("noam_lr", M.noam_max, "the larger of the two branches: max instead of min",
                "the rate rises linearly during warmup, then decays: the smaller of the two branches, min"),
        Mistake("noam_lr", M.noam_warmup_square_root, "step * warmup_steps^-0.5 during warmup",
                "the warmup branch is step * warmup_steps^-1.5: it meets step^-0.5 at step = warmup_steps")),
          explicit=X.noam_lr()),
    Layer("adam", "steps", ("adam_step",), adam_examples(), None, {
        "adam_step": "m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) "
                     "+ eps)"},
        {"adam_step": "the bias correction of both moments, and where eps goes"}, library="attn.grader.solutions",
        mistakes=(
        Mistake("adam_step", M.adam_no_bias_correction, "a step without the bias correction of either moment",
                "the moments start at zero: divide m by 1 - beta1^t and v by 1 - beta2^t"),
        Mistake("adam_step", M.adam_v_uncorrected, "a step with m corrected and v not",
                "the bias correction of both moments: v too, by 1 - beta2^t"),
        Mistake("adam_step", M.adam_eps_inside, "a step with eps inside the square root",
                "eps is added after the square root: sqrt(v_hat) + eps")), explicit=X.adam()),
    Layer("greedy_decode", "function", ("greedy_decode",), decoding_examples(False), None, {
        "greedy_decode": "encode, then from BOS: the most probable token at every step (PAD and BOS never), until "
                         "EOS or max_len; the score sums the chosen tokens' log-probabilities, EOS included"},
        {"greedy_decode": "the stopping rule, and the tokens banned from generation"}, compare=compare_decoded,
        library="attn.grader.solutions", mistakes=(
        Mistake("greedy_decode", D.greedy_pad_bos_allowed, "the decoding with PAD and BOS allowed as outputs",
                "PAD and BOS are never generated: set their log-probabilities to -inf before the argmax"),
        Mistake("greedy_decode", D.greedy_eos_unscored, "the decoding whose score leaves out EOS's log-probability",
                "the score sums the chosen tokens' log-probabilities, EOS included"),
        Mistake("greedy_decode", D.greedy_no_stop, "the decoding that goes on after EOS",
                "a sentence ends at EOS: stop there, EOS itself not in the tokens")), explicit=X.decoding(False)),
    Layer("beam_search", "function", ("beam_search",), decoding_examples(True), None, {
        "beam_search": "keep the K best unfinished beams by summed log-probability; a beam that ends in EOS is "
                       "finished with score logP / ((5 + len) / 6)^alpha; stop when no live beam can beat the "
                       "best finished one (or at max_len)"},
        {"beam_search": "when a sentence's search may stop: a finished hypothesis is not the end while a live "
                        "beam could still beat it"}, compare=compare_decoded, library="attn.grader.solutions",
        mistakes=(
        Mistake("beam_search", D.beam_stops_at_first_finished, "the search that stops at the first finished "
                "hypothesis", "a finished hypothesis is not the end while a live beam could still beat it: stop "
                "when the best live score, penalised at max_len, cannot"),
        Mistake("beam_search", D.beam_without_length_penalty, "the search without the length penalty",
                "a finished hypothesis scores logP / ((5 + len) / 6)^alpha"),
        Mistake("beam_search", D.beam_pad_bos_allowed, "the search with PAD and BOS allowed as outputs",
                "PAD and BOS are never generated: their log-probabilities -inf before choosing")),
          explicit=X.decoding(True)),
    Layer("average_checkpoints", "function", ("average_checkpoints",), average_examples(), None, {
        "average_checkpoints": "mean over the checkpoints of each parameter, summed in float64, cast back"},
        {"average_checkpoints": "the precision of the sum and the dtype of the result"},
        compare=compare_arrays_by_name, library="attn.grader.solutions", mistakes=(
        Mistake("average_checkpoints", M.average_sum, "the sum of the checkpoints, not their mean",
                "divide the sum by the number of checkpoints"),
        Mistake("average_checkpoints", M.average_last, "the last checkpoint alone", "every checkpoint enters the "
                "mean: sum them all, then divide by their number"),
        Mistake("average_checkpoints", M.average_over_parameters, "the sum divided by the number of parameters",
                "the mean is over the checkpoints: divide by len(checkpoints), not by the number of keys")),
          explicit=X.average_checkpoints()),
    Layer("bpe", "function", ("learn_merges",), bpe_examples(), None, {
        "learn_merges": "count adjacent pairs over all words, times each word's count; merge the most frequent "
                        "(ties: the alphabetically first pair) everywhere; repeat"},
        {"learn_merges": "the tie-break, the counts weighted by word frequency, and when to stop"},
        compare=compare_merges, library="attn.grader.solutions", mistakes=(
        Mistake("learn_merges", M.bpe_unweighted, "the merges of pairs counted once per word",
                "a pair in a word seen n times occurs n times: add the word's count, not 1"),
        Mistake("learn_merges", M.bpe_first_found, "the merges with ties going to the pair counted first",
                "ties go to the alphabetically first pair: min over (-count, pair), not the first found"),
        Mistake("learn_merges", M.bpe_merges_singletons, "the merges going on with pairs that occur once",
                "stop when the most frequent pair occurs fewer than twice: a merge must save something")),
          explicit=X.bpe()),
    RMSNORM,
    *LATER_BLOCK,
    FLASH_ATTENTION,
    INT8,
    SPECULATIVE,
    *LORA_LAYERS,
]}


class Manifest(NamedTuple):
    """One exercise: the functions its starter asks for, in its order, the library modules
    its file may import (what it gives; the names it asks for withheld from them), the
    forwards it gives (used, not graded, with the learner's backward), and the functions of
    the given modules that would hand in its answer, withheld too."""
    name: str
    asks: tuple
    gives: tuple = ()
    given_forwards: tuple = ()
    withholds: tuple = ()


EXERCISES = {m.name: m for m in (
    Manifest("01_seq2seq", ("linear_forward", "linear_backward", "embedding_forward", "embedding_backward",
                            "rnn_step_forward", "rnn_step_backward", "rnn_forward", "rnn_backward")),
    Manifest("03_positional_encoding", ("sinusoidal_table", "positional_forward", "positional_backward")),
    Manifest("04_attention", ("softmax_forward", "softmax_backward", "attention_forward", "attention_backward")),
    Manifest("05_masks", ("padding_mask", "causal_mask", "decoder_mask")),
    Manifest("06_multi_head_attention", ("split_heads", "merge_heads", "multi_head_attention_forward",
                                         "multi_head_attention_backward"), ("attn.layers",)),
    Manifest("07_feed_forward_layer_norm", ("relu_forward", "relu_backward", "feed_forward_forward",
                                            "feed_forward_backward", "layer_norm_forward", "layer_norm_backward",
                                            "residual_ffn_forward", "residual_ffn_backward"), ("attn.layers",)),
    Manifest("08_backprop_by_hand", ("softmax_backward", "layer_norm_backward", "attention_backward"),
             ("attn.layers",), ("softmax_forward", "layer_norm_forward", "attention_forward")),
    Manifest("11_training_recipe", ("cross_entropy", "noam_lr", "adam_step")),
    Manifest("12_dropout", ("dropout_forward", "dropout_backward")),
    Manifest("bpe", ("learn_merges",), ("attn.bpe",)),
    Manifest("decoding", ("greedy_decode", "beam_search", "average_checkpoints"), ("attn.masks", "attn.model")),
    Manifest("rmsnorm", ("rmsnorm_forward", "rmsnorm_backward")),
    Manifest("rope", ("rope_forward", "rope_backward")),
    Manifest("swiglu", ("swiglu_forward", "swiglu_backward")),
    Manifest("grouped_query_attention", ("grouped_query_attention_forward", "grouped_query_attention_backward"),
             ("attn.layers",), (), ("multi_head_attention_forward", "multi_head_attention_backward", "repeat_kv",
                                    "sum_kv_groups")),
    Manifest("flash_attention", ("flash_attention_forward", "flash_attention_backward")),
    Manifest("lora", ("lora_forward", "lora_backward", "lora_merge")),
    Manifest("speculative", ("speculative_accept",)),
    Manifest("int8", ("int8_round_trip",)),
    Manifest("luong_attention", ("luong_attention_forward", "luong_attention_backward"), ("attn.layers",)),
    Manifest("the_whole_model", ("encoder_layer_forward", "encoder_layer_backward", "decoder_layer_forward",
                                 "decoder_layer_backward", "transformer_forward", "transformer_backward"),
             ("attn.layers", "attn.masks")),
    Manifest("decoder_only_layer", ("decoder_only_layer_forward", "decoder_only_layer_backward"),
             ("attn.layers", "attn.masks")),
)}
