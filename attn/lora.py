"""LoRA on the model: an adapter on chosen linear maps of the block's attentions, the trained
weights frozen (:mod:`attn.layers.lora` is the layer; lesson 29).

    targets   which projections of every attention are adapted: "q", "k", "v", "o" (default q, v,
              the paper's choice for GPT-3, section 7.1)
    rank      r, the width of the narrow path
    alpha     the update is scaled by alpha / r (default 2 r)

:class:`Adapter` is a part, as the block's are (:mod:`attn.block`): it carries its parameters'
names and shapes, derived from the attention parts the config has (the encoder's and the
decoder's self-attention, the cross-attention where there is one), and its readable forward and
backward. Its parameters are named after the weight they adapt: ``decoder.0.self_attn.w_q.lora_a``
(D_in, r) and ``.lora_b`` (r, D_out).

The readable model trains through the merged weight. Forward: each adapted ``w`` becomes
``lora_merge(w, a, b, alpha) = w + s a b`` (s = alpha / r) and the model runs as it always does,
decoding, QK-norm and grouped-query attention included. Backward: the model's backward gives
``dW' = x^T dout`` for the merged weight, and the chain rule through ``W' = w + s a b`` gives the
adapter's gradients (:meth:`Adapter.backward`), the same numbers as :func:`attn.layers.lora_backward`'s.
The frozen w is never handed to the optimizer. With b = 0, ``w + s a 0`` is w to the last bit, so
a new adapter changes no output at all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from . import backend as B
from .block import parts
from .checkpoint import CheckpointError, load_npz, save_npz
from .layers import lora_init, lora_merge
from .model import Transformer, parameter_shapes

#: The projections an attention has, each a weight ``w_<name>``.
PROJECTIONS = ("q", "k", "v", "o")
FORMAT = "attn-lora-1"


def parse_targets(text: str) -> tuple:
    """``"q,v"`` -> ("q", "v"); ValueError naming --lora-targets for anything else."""
    targets = tuple(t.strip() for t in str(text).split(",") if t.strip())
    bad = [t for t in targets if t not in PROJECTIONS]
    if not targets or bad or len(set(targets)) != len(targets):
        raise ValueError(f"lora_targets (--lora-targets) must be a comma-separated list of distinct projections "
                         f"among {', '.join(PROJECTIONS)}, got {text!r}")
    return targets


@dataclass(frozen=True)
class Adapter:
    """LoRA adapters of ``rank`` on the projections ``targets`` of every attention, scaled by
    ``alpha / rank``."""
    rank: int
    targets: tuple = ("q", "v")
    alpha: float | None = None           # None: 2 * rank

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora (--lora) must be a positive integer rank, got {self.rank!r}")
        parse_targets(",".join(self.targets))
        if self.alpha is not None and not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"lora_alpha (--lora-alpha) must be a positive number, got {self.alpha!r}")

    @property
    def scale_alpha(self) -> float:
        return float(2 * self.rank if self.alpha is None else self.alpha)

    def weights(self, cfg) -> dict:
        """The adapted weights of a model of config ``cfg``: name -> shape (D_in, D_out), one per
        target of every attention part the block has."""
        block, shapes = parts(cfg), parameter_shapes(cfg)
        cross = ("cross_attn",) if block.cross_attention is not None else ()
        stacks = (("encoder", cfg.n_encoder_layers, ("self_attn",)), ("decoder", cfg.n_decoder_layers,
                                                                     ("self_attn",) + cross))
        return {f"{stack}.{i}.{sub}.w_{t}": shapes[f"{stack}.{i}.{sub}.w_{t}"]
                for stack, n, sublayers in stacks for i in range(n) for sub in sublayers for t in self.targets}

    def shapes(self, cfg) -> dict:
        """The adapter's parameters: ``<weight>.lora_a`` (D_in, r) and ``<weight>.lora_b`` (r, D_out)."""
        out = {}
        for name, (d_in, d_out) in self.weights(cfg).items():
            out[f"{name}.lora_a"], out[f"{name}.lora_b"] = (d_in, self.rank), (self.rank, d_out)
        return out

    def init(self, cfg, seed: int = 0, dtype="float32") -> dict:
        """New adapter parameters on the selected backend: every a random, every b zero."""
        params = {}
        for i, (name, (d_in, d_out)) in enumerate(self.weights(cfg).items()):
            a, b = lora_init(d_in, d_out, self.rank, seed=seed * 1_000_003 + i, dtype=dtype)
            params[f"{name}.lora_a"], params[f"{name}.lora_b"] = B.to_device(a), B.to_device(b)
        return params

    def forward(self, base: dict, adapter: dict, cfg) -> dict:
        """The model's parameters with every adapted weight merged (``lora_merge``); the others
        are ``base``'s own arrays. ``base`` is not changed."""
        merged = dict(base)
        for name in self.weights(cfg):
            merged[name] = lora_merge(base[name], adapter[f"{name}.lora_a"], adapter[f"{name}.lora_b"],
                                      self.scale_alpha)
        return merged

    def backward(self, grads: dict, adapter: dict, cfg) -> dict:
        """Forward was ``W' = w + s a b`` (s = alpha / r), so from the merged weight's gradient
        ``dW'`` (D_in, D_out): ``da = s dW' b^T``, ``db = s a^T dW'``. With ``dW' = x^T dout`` these
        are ``lora_backward``'s ``x^T (s dout b^T)`` and ``s (x a)^T dout``. The frozen weights'
        gradients are dropped. Returns: the adapter's gradients, keyed as its parameters."""
        s = self.scale_alpha / self.rank
        out = {}
        for name in self.weights(cfg):
            a, b, dw = adapter[f"{name}.lora_a"], adapter[f"{name}.lora_b"], grads[name]
            out[f"{name}.lora_a"] = dw.dtype.type(s) * (dw @ b.T)
            out[f"{name}.lora_b"] = dw.dtype.type(s) * (a.T @ dw)
        return out

    def to_dict(self) -> dict:
        return {"rank": self.rank, "targets": list(self.targets), "alpha": self.scale_alpha}


class LoraModel:
    """A frozen :class:`~attn.model.Transformer` (``base``) with an :class:`Adapter`: ``params``
    are the adapter's alone, what an optimizer trains; ``forward`` and ``backward`` are the
    model's, through the merged weights. ``merged()`` is a plain Transformer for decoding."""

    def __init__(self, base: Transformer, adapter: Adapter, params: dict | None = None, seed: int = 0):
        self.base, self.adapter, self.config, self.dtype = base, adapter, base.config, base.dtype
        self.params = params if params is not None else adapter.init(base.config, seed, base.dtype)
        self._inner = Transformer(base.config, dtype=base.dtype, params=dict(base.params))

    def merged(self) -> Transformer:
        """The base model with the adapter merged into its weights (the base's arrays untouched)."""
        self._inner.params = self.adapter.forward(self.base.params, self.params, self.config)
        return self._inner

    def forward(self, src, tgt_in, rng=None):
        return self.merged().forward(src, tgt_in, rng)

    def backward(self, dlogits, cache) -> dict:
        return self.adapter.backward(self._inner.backward(dlogits, cache), self.params, self.config)

    def num_parameters(self) -> int:
        return sum(int(v.size) for v in self.params.values())

    def save(self, path, meta: dict | None = None) -> Path:
        """The adapter alone: its parameters, its settings and the base model's config."""
        return save_npz(path, {f"lora/{k}": v for k, v in self.params.items()},
                        {"format": FORMAT, "adapter": self.adapter.to_dict(), "config": self.config.to_dict(),
                         **(meta or {})})


def adapter_bytes(model: LoraModel) -> int:
    """The bytes of the adapter's numbers (what its file holds, before compression and the header)."""
    return sum(int(v.size) * v.dtype.itemsize for v in model.params.values())


def load_adapter(path, base: Transformer) -> LoraModel:
    """An adapter file written by :meth:`LoraModel.save`, on ``base`` (whose config it must have
    been trained on). Raises CheckpointError naming the file and what does not fit."""
    def expect(meta, sizes):
        if meta.get("format") != FORMAT or "adapter" not in meta:
            raise CheckpointError(f"it is not a LoRA adapter written by attn-train --lora (format "
                                  f"{meta.get('format')!r})")
        return {k: k.startswith("lora/") for k in sizes}
    arrays, meta = load_npz(path, expect=expect)
    if meta.get("config") != base.config.to_dict():
        raise CheckpointError(f"adapter {path} was trained on a model of another config than the checkpoint's: "
                              "give the checkpoint it was trained from")
    try:
        spec = meta["adapter"]
        adapter = Adapter(int(spec["rank"]), tuple(spec["targets"]), float(spec["alpha"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"adapter {path}: its settings are unreadable ({e})") from None
    shapes = adapter.shapes(base.config)
    found = {k[len("lora/"):]: v for k, v in arrays.items()}
    problems = [f"missing {k}" for k in shapes if k not in found]
    problems += [f"unexpected {k}" for k in found if k not in shapes]
    problems += [f"{k} has shape {tuple(found[k].shape)}, expected {shapes[k]}" for k in shapes
                 if k in found and tuple(found[k].shape) != shapes[k]]
    if problems:
        raise CheckpointError(f"adapter {path} does not fit its settings: " + "; ".join(problems))
    bad = next((k for k, a in found.items() if not bool(B.host.isfinite(a).all())), None)
    if bad is not None:
        raise CheckpointError(f"adapter {path}: {bad} holds NaN or infinite numbers")
    return LoraModel(base, adapter, {k: B.to_device(found[k], base.dtype) for k in shapes})


def trained_fraction(model: LoraModel) -> float:
    """The adapter's numbers as a fraction of the base model's."""
    return model.num_parameters() / max(1, sum(math.prod(v.shape) for v in model.base.params.values()))
