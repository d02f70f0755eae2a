"""int8 weights: every matrix stored as one signed byte a number and one float32 scale a channel.

Per-output-channel symmetric quantisation of a row ``w`` (the numbers one output channel reads):

    scale = max|w| / 127            (a row of zeros: scale 0, every q 0)
    q     = clip(round(w / scale), -127, 127)           an int8
    w_hat = q * scale                                   what the model computes with

Rounding to the nearest integer moves ``w / scale`` by at most 1/2, so each number moves by at most
half a step: ``|w - w_hat| <= scale / 2``. The range is symmetric (-127..127, never -128), so ``-w``
quantises to ``-q``; zero stays exactly zero; a row whose numbers are integer multiples of its
scale comes back unchanged. ``round`` is NumPy's (halves to even), itself symmetric in sign.

Which axis holds the channels: the model's linear maps are ``x @ w`` with ``w`` (Din, Dout), so an
output channel is a *column* of ``w`` (one scale per column); its tables (embeddings, the tied
projection, learned positions) give out one *row* per token or position (one scale per row).
:func:`quantize_matrix` stores either in the matrix's own layout, the scales shaped (1, Dout) or
(V, 1) so that ``q * scale`` broadcasts back.

The readable model runs an int8 model by dequantising on the fly: :class:`Int8Params` is the
model's ``params`` mapping, and each lookup of a matrix returns ``q * scale`` in float32, made when
a layer asks for it and dropped after (the bytes held stay int8; the arithmetic is float32's).
Vectors (biases, norms' gains) stay float32: they are a fraction of a percent of the bytes.

    python -m attn.quantize runs/toy/averaged.npz runs/toy/int8.npz

writes an int8 checkpoint that ``attn-translate`` and ``attn-export`` read like any other, and
prints the bytes before and after and each matrix's largest error against its bound.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from . import backend as B
from .checkpoint import CheckpointError, load_npz, save_npz

#: The largest magnitude of q: the range is symmetric, so -128 is never used.
QMAX = 127
#: The checkpoint format of an int8 model (``attn-checkpoint-1``'s meta, its matrices as
#: ``int8/NAME`` and ``scale/NAME``, its vectors as ``param/NAME``).
FORMAT = "attn-checkpoint-int8-1"


def quantize_int8(w):
    """Per-row symmetric int8 quantisation of ``w`` (..., N): one scale per row of the last axis.

    Returns ``(q, scale)``: q (..., N) int8 in [-127, 127]; scale (..., 1) of ``w``'s dtype,
    ``max|row| / 127`` (0 for a row of zeros, whose q are all 0).
    """
    xp = B.get_array_module(w)
    if w.dtype.kind != "f":
        raise TypeError(f"quantize_int8: w must be a floating-point array, got dtype {w.dtype}")
    if w.ndim < 1:
        raise ValueError("quantize_int8: w must have at least one axis (rows along the last)")
    scale = xp.abs(w).max(axis=-1, keepdims=True) / w.dtype.type(QMAX)             # (..., 1)
    safe = xp.where(scale > 0, scale, w.dtype.type(1))                       # a zero row divides by 1
    q = xp.clip(xp.round(w / safe), -QMAX, QMAX).astype(xp.int8)
    return q, scale


def dequantize_int8(q, scale):
    """``q * scale``: q (..., N) int8, scale broadcastable to it -> (..., N) of scale's dtype."""
    return q.astype(scale.dtype) * scale


def int8_round_trip(w):
    """``w`` quantised to int8 a row at a time and back (the numbers an int8 model computes
    with): ``dequantize_int8(*quantize_int8(w))``, of ``w``'s shape and dtype. Each number is
    within ``scale / 2`` of ``w``'s, ``scale = max|row| / 127``."""
    return dequantize_int8(*quantize_int8(w))


def error_bound(w):
    """The bound the rounding gives, ``scale / 2`` for each row of ``w`` (..., N): (..., 1)."""
    return quantize_int8(w)[1] / w.dtype.type(2)


# ----------------------------------------------------------------------------- a model's matrices


def rows_are_channels(name: str) -> bool:
    """Whether the parameter ``name``'s output channels are its rows: a table that gives out a row
    a token or position (``*.weight``: the embeddings, the tied projection, learned positions).
    The linear maps ``x @ w`` give out a column each."""
    return name.endswith(".weight")


def quantize_matrix(name: str, w):
    """``w`` (2-D) quantised a channel at a time in its own layout: (q int8 of w's shape, scale
    float32 (R, 1) for row channels or (1, C) for column ones), ``q * scale`` its dequantised form."""
    if w.ndim != 2:
        raise ValueError(f"quantize_matrix: {name} has shape {tuple(w.shape)}, not a matrix")
    w = w.astype(B.host.float32) if w.dtype != B.host.float32 else w
    if rows_are_channels(name):
        return quantize_int8(w)
    q, scale = quantize_int8(w.T)
    return q.T.copy(), scale.T.copy()


class Int8TrainingError(ValueError):
    """An int8 model asked to train: its matrices are rounded copies that no step can update."""


def refuse_training(params, what: str) -> None:
    """:class:`Int8TrainingError` naming ``what`` (the flag or the call that would train) where
    ``params`` are an :class:`Int8Params`: an int8 model is for inference (the readable engine's
    Adam, the fast engine's optimizer and backward, ``attn-train --resume-from`` all ask here)."""
    if isinstance(params, Int8Params):
        raise Int8TrainingError(f"{what}: an int8 model is for inference (its matrices are rounded copies that "
                                "a step cannot update); train the float32 checkpoint it was quantised from "
                                "(attn-train --resume-from FLOAT32_CHECKPOINT) and quantise it again "
                                "(python -m attn.quantize)")


class Int8Params(Mapping):
    """A model's ``params`` with its matrices in int8: ``params[name]`` is ``q * scale`` in
    float32, computed at each lookup (on the fly; nothing float is kept), or the float32 vector.

    ``quantized`` maps a matrix's name to ``(q, scale)`` (:func:`quantize_matrix`); ``vectors`` the
    other parameters' names to their arrays. Read-only: an int8 model is for inference."""

    def __init__(self, quantized: dict, vectors: dict):
        both = set(quantized) & set(vectors)
        if both:
            raise ValueError(f"Int8Params: {sorted(both)[0]} is both a matrix and a vector")
        self.quantized, self.vectors = dict(quantized), dict(vectors)
        self._names = [*vectors, *quantized]      # a vector first: model.xp's look at it dequantises nothing

    def __getitem__(self, name):
        if name in self.quantized:
            return dequantize_int8(*self.quantized[name])
        return self.vectors[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def nbytes(self) -> int:
        """The bytes its arrays hold: one a matrix's number, four a scale or a vector's number."""
        return sum(int(q.nbytes + s.nbytes) for q, s in self.quantized.values()) + \
            sum(int(v.nbytes) for v in self.vectors.values())


def quantize_params(params) -> Int8Params:
    """Every matrix of ``params`` (name -> array) in int8, every vector in float32, on the device."""
    quantized, vectors = {}, {}
    for name, a in params.items():
        a = B.to_device(B.to_host(a).astype(B.host.float32))
        if a.ndim == 2:
            quantized[name] = quantize_matrix(name, a)
        else:
            vectors[name] = a
    return Int8Params(quantized, vectors)


def quantize_model(model):
    """An int8 copy of ``model`` (a :class:`attn.model.Transformer`): the same config, its params
    an :class:`Int8Params` of ``model``'s."""
    from .model import Transformer
    return Transformer(model.config, dtype="float32", params=quantize_params(model.params))


def matrix_errors(params, int8: Int8Params) -> dict:
    """For each matrix: ``(largest |w - w_hat|, its bound max(scale) / 2, largest ratio of an
    error to its own channel's bound)``; the ratio is at most 1 (up to float32's rounding of
    ``w / scale``)."""
    np = B.host
    out = {}
    for name, (q, scale) in int8.quantized.items():
        w = B.to_host(params[name]).astype(np.float64)
        q, s = B.to_host(q).astype(np.float64), B.to_host(scale).astype(np.float64)
        err = np.abs(w - q * s)
        ratio = np.where(s > 0, err / np.where(s > 0, s / 2, 1.0), 0.0)
        out[name] = (float(err.max(initial=0.0)), float(s.max(initial=0.0)) / 2, float(ratio.max(initial=0.0)))
    return out


# ----------------------------------------------------------------------------- checkpoints


def int8_arrays(int8: Int8Params) -> dict:
    """The members of an int8 checkpoint: ``int8/NAME`` and ``scale/NAME`` a matrix, ``param/NAME``
    a vector, on the host."""
    arrays = {}
    for name, (q, s) in int8.quantized.items():
        arrays[f"int8/{name}"], arrays[f"scale/{name}"] = B.to_host(q), B.to_host(s)
    arrays.update({f"param/{k}": B.to_host(v) for k, v in int8.vectors.items()})
    return arrays


def is_int8(arrays_or_sizes) -> bool:
    """Whether a checkpoint's members (a dict keyed by member name) are an int8 model's."""
    return any(k.startswith("int8/") for k in arrays_or_sizes)


def params_from_arrays(arrays: dict, expected: dict, source: str) -> Int8Params:
    """The :class:`Int8Params` of an int8 checkpoint's ``arrays``, checked against ``expected``
    (name -> shape, :func:`attn.model.parameter_shapes`): every matrix as int8 of its shape with
    finite, non-negative scales of (R, 1) or (1, C) as its name says, every vector a float one."""
    np = B.host
    quantized, vectors, problems = {}, {}, []
    for name, shape in expected.items():
        if len(shape) == 2:
            q, s = arrays.get(f"int8/{name}"), arrays.get(f"scale/{name}")
            want = (shape[0], 1) if rows_are_channels(name) else (1, shape[1])
            if q is None or s is None:
                problems.append(f"missing int8/{name} or scale/{name}")
            elif q.dtype != np.int8 or tuple(q.shape) != tuple(shape):
                problems.append(f"int8/{name} is {q.dtype} {tuple(q.shape)}, expected int8 {tuple(shape)}")
            elif s.dtype.kind != "f" or tuple(s.shape) != want or not (np.isfinite(s).all() and (s >= 0).all()):
                problems.append(f"scale/{name} must be finite non-negative floats of shape {want}, "
                                f"got {s.dtype} {tuple(s.shape)}")
            else:
                quantized[name] = (B.to_device(q), B.to_device(s.astype(np.float32)))
        elif (v := arrays.get(f"param/{name}")) is None or tuple(v.shape) != tuple(shape) or v.dtype.kind != "f":
            problems.append(f"param/{name} is missing or not floats of shape {tuple(shape)}")
        else:
            vectors[name] = B.to_device(v.astype(np.float32))
    known = {f"{p}/{n}" for n in expected for p in ("int8", "scale", "param")}
    problems += [f"unexpected {k}" for k in arrays if k not in known]
    if problems:
        raise CheckpointError(f"{source} does not fit its config: " + "; ".join(problems[:5]))
    return Int8Params(quantized, vectors)


def int8_members(meta: dict, sizes: dict) -> dict:
    """What :func:`attn.checkpoint.load_npz` reads of an int8 checkpoint (its ``expect``): the
    config's matrices and scales and vectors, no more bytes than its float64 parameters."""
    from .model import TransformerConfig, parameter_count
    try:
        cfg = TransformerConfig.from_dict(meta["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"it has no valid config: {e}") from None
    others = sorted(k for k in sizes if not k.startswith(("int8/", "scale/", "param/")))
    if others:
        raise CheckpointError(f"member {others[0]!r} is not part of an int8 model")
    if sum(sizes.values()) > 8 * parameter_count(cfg) + 2**20:
        raise CheckpointError(f"its arrays claim {sum(sizes.values()):,} bytes, more than its config implies")
    return {k: True for k in sizes}


def save_int8(model, path, meta: dict | None = None):
    """Write ``model`` (its params an :class:`Int8Params`, or float ones, quantised here) to ``path``."""
    int8 = model.params if isinstance(model.params, Int8Params) else quantize_params(model.params)
    full = {**(meta or {}), "format": FORMAT, "config": model.config.to_dict()}
    return save_npz(path, int8_arrays(int8), full)


def load_int8(arrays: dict, meta: dict, source: str):
    """The :class:`attn.model.Transformer` of an int8 checkpoint's ``arrays`` and ``meta``."""
    from .model import Transformer, TransformerConfig, parameter_shapes
    try:
        cfg = TransformerConfig.from_dict(meta["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{source} has an invalid config: {e}") from None
    return Transformer(cfg, dtype="float32", params=params_from_arrays(arrays, parameter_shapes(cfg), source))


# ----------------------------------------------------------------------------- the command


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m attn.quantize",
                                description="Write an int8 copy of a checkpoint written by attn-train (every "
                                            "matrix int8 with a float32 scale per output channel) and print the "
                                            "bytes before and after and each matrix's largest error.")
    p.add_argument("checkpoint", type=Path, help="a checkpoint written by attn-train")
    p.add_argument("out", type=Path, help="the int8 checkpoint to write (.npz)")
    args = p.parse_args(argv)
    from .model import Transformer
    from .model_files import model_members
    try:
        arrays, meta = load_npz(args.checkpoint, expect=model_members)      # an int8 one is refused here
        model = Transformer.from_arrays(arrays, meta, source=str(args.checkpoint))
    except CheckpointError as e:
        print(f"attn.quantize: error: {e}", file=sys.stderr)
        return 2
    int8 = quantize_params(model.params)
    keep = {k: meta[k] for k in ("vocab", "step") if k in meta}
    save_int8(model.__class__(model.config, params=int8), args.out, keep)
    fp32 = sum(int(B.to_host(a).astype(B.host.float32).nbytes) for a in model.params.values())
    print(f"parameters: {fp32:,} bytes in float32, {int8.nbytes():,} in int8 ({int8.nbytes() / fp32:.3f}); "
          f"files: {args.checkpoint.stat().st_size:,} -> {args.out.stat().st_size:,} bytes")
    for name, (err, bound, ratio) in matrix_errors(model.params, int8).items():
        print(f"  {name:34s} max |w - w_hat| {err:.3e}  bound max(scale)/2 {bound:.3e}  "
              f"max error/own bound {ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
