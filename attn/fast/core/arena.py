"""One contiguous arena for the fast engine's parameters, gradients and Adam's two moments: four
flat buffers of one layout, so that Adam is one update, the gradient norm one reduction and a
data-parallel all-reduce one buffer. docs/ARCHITECTURE.md ("The fast engine") gives the order of
the blocks (the backward's, stage by stage: :func:`stages`) and the fused blocks.

    arena = Arena(config, dtype, xp)          # or Arena.adopt(params, config): copies them in
    arena.params, arena.grads                 # flat (size,) buffers, one layout
    arena.grad_buffer                         # (size + SLOT,): grads, then the loss and tokens slot
    arena.m, arena.v                          # Adam's moments, the same layout (made on first use)
    arena.views(arena.params)                 # {name: view} for every parameter (the model's params)
    arena.block(arena.grads, "decoder.cross_attn.w_kv")   # a fused block of any buffer
    Arena.find(params)                        # the arena whose views ``params`` holds, or None

Each view keeps its name and shape from :func:`attn.model.parameter_shapes`. Blocks start on
multiples of :data:`ALIGN` elements; the elements between them are zero in every buffer and stay
zero (no gradient is written there, so Adam leaves them and the norm does not see them)."""
from __future__ import annotations

import math
import re
import weakref
from functools import cached_property
from typing import NamedTuple

from ... import backend as B
from ...engine import SLOT
from ...block import parts
from ...model import TransformerConfig, parameter_shapes
from ..gpu.stepmem import outside_step

#: Every block starts at a multiple of this many elements (256 bytes in float32).
ALIGN = 64


class Block(NamedTuple):
    """A block of the layout: where it starts in a flat buffer, and its shape."""
    offset: int
    shape: tuple


class Member(NamedTuple):
    """Where a parameter sits in its block: the block's name, and the index of the view
    (a column slice for the fused projections, a row for layer norm, everything otherwise)."""
    block: str
    index: tuple


def _member(name: str, shape: tuple, cfg: TransformerConfig) -> tuple:
    """(block name, block shape, index in the block) of a parameter."""
    D, L, F = cfg.d_model, cfg.n_decoder_layers, cfg.ffn_width
    KV = cfg.key_value_heads * (D // cfg.n_heads)              # the keys' and the values' width
    m = re.fullmatch(r"((?:encoder|decoder)\.\d+\.self_attn)\.([wb])_([qkv])", name)
    if m:
        pre, kind, j = m.group(1), m.group(2), "qkv".index(m.group(3))
        lo = (0, D, D + KV)[j]
        cols = slice(lo, lo + (D if j == 0 else KV))
        if kind == "w":
            return f"{pre}.w_qkv", (D, D + 2 * KV), (slice(None), cols)
        return f"{pre}.b_qkv", (D + 2 * KV,), (cols,)
    m = re.fullmatch(r"decoder\.(\d+)\.cross_attn\.([wb])_([kv])", name)
    if m:
        i, kind, j = int(m.group(1)), m.group(2), "kv".index(m.group(3))
        cols = slice(2 * KV * i + j * KV, 2 * KV * i + (j + 1) * KV)
        if kind == "w":
            return "decoder.cross_attn.w_kv", (D, 2 * KV * L), (slice(None), cols)
        return "decoder.cross_attn.b_kv", (2 * KV * L,), (cols,)
    m = re.fullmatch(r"((?:encoder|decoder)\.\d+\.ffn)\.(w1|w3)", name)
    if m and parts(cfg).ffn.gated:                        # SwiGLU: W | V one block
        j = ("w1", "w3").index(m.group(2))
        return f"{m.group(1)}.w13", (D, 2 * F), (slice(None), slice(j * F, (j + 1) * F))
    m = re.fullmatch(r"(.*)\.(gamma|beta)", name)
    if m:
        return f"{m.group(1)}.gamma_beta", (len(parts(cfg).norm.names), D), (0 if m.group(2) == "gamma" else 1,)
    return name, tuple(shape), ()


class Layout(NamedTuple):
    """Blocks (name -> Block, in the buffers' order), members (parameter name -> Member, in
    :func:`parameter_shapes` order), the flat size, and the stages (name -> ``(start, stop)``
    in the buffers, in the backward's order; an empty stage has ``start == stop``)."""
    blocks: dict
    members: dict
    size: int
    stages: dict


def stages(cfg: TransformerConfig) -> list:
    """The stages of the fast backward, in the order it finishes them (see the module docstring)."""
    return ["decoder.norm", *(f"decoder.{i}" for i in reversed(range(cfg.n_decoder_layers))),
            "decoder.cross_attn", "tgt_pos", "encoder.norm",
            *(f"encoder.{i}" for i in reversed(range(cfg.n_encoder_layers))), "src_pos", "embeddings"]


def _stage_of(block: str) -> str:
    """The stage whose end makes a block's gradient final."""
    m = re.match(r"((?:encoder|decoder)\.(?:\d+|norm|cross_attn))\.", block)
    if m:
        return m.group(1)
    return block.split(".")[0] if block in ("src_pos.weight", "tgt_pos.weight") else "embeddings"


def layout(cfg: TransformerConfig) -> Layout:
    """The arena's layout for a model configuration (see the module docstring)."""
    shapes, members = {}, {}
    for name, shape in parameter_shapes(cfg).items():
        bname, bshape, index = _member(name, tuple(shape), cfg)
        shapes.setdefault(bname, bshape)
        members[name] = Member(bname, index)
    blocks, ranges, size = {}, {}, 0
    for stage in stages(cfg):
        start = size
        for bname in (b for b in shapes if _stage_of(b) == stage):     # in parameter order within a stage
            blocks[bname] = Block(size, shapes[bname])
            size += -(-math.prod(int(n) for n in shapes[bname]) // ALIGN) * ALIGN
        ranges[stage] = (start, size)
    assert len(blocks) == len(shapes), sorted(set(shapes) - set(blocks))
    return Layout(blocks, members, size, ranges)


class Arena:
    """Flat parameter, gradient and moment buffers of one model (see the module docstring).

    ``params`` is made at construction (zeros); ``grads``, ``m`` and ``v`` on first use,
    so a model that only decodes holds its parameters alone."""

    _live: "weakref.WeakSet[Arena]" = weakref.WeakSet()

    def __init__(self, config: TransformerConfig, dtype, xp):
        self.config, self.dtype, self.xp = config, B.host.dtype(dtype), xp
        self.layout = layout(config)
        self.size = self.layout.size
        self.params = xp.zeros((self.size,), dtype=self.dtype)
        self.param_views = self.views(self.params)
        Arena._live.add(self)

    @classmethod
    def adopt(cls, params: dict, config: TransformerConfig, dtype=None) -> "Arena":
        """An arena holding copies of ``params`` (every parameter of ``config``, one backend);
        the entries of ``params`` are then replaced by the arena's views, in place, so that
        whoever shares the dict (a reference model) shares the arena's memory."""
        first = next(iter(params.values()))
        arena = cls(config, dtype or first.dtype, B.get_array_module(first))
        arena.load(params)
        params.update(arena.param_views)
        return arena

    def load(self, params: dict) -> None:
        """Copy every parameter's values from ``params`` into the arena."""
        shapes = parameter_shapes(self.config)
        missing = [k for k in shapes if k not in params]
        if missing:
            raise KeyError(f"Arena.load: no value for {missing[:5]}")
        for name, view in self.param_views.items():
            a = params[name]
            if a is view:
                continue
            if tuple(a.shape) != tuple(shapes[name]):
                raise ValueError(f"Arena.load: {name} has shape {tuple(a.shape)}, expected {shapes[name]}")
            view[...] = a

    # ---- the buffers made on first use

    @cached_property
    def grad_buffer(self):
        """The gradients and, past them, :data:`SLOT` elements for a data-parallel run's loss and
        token count: (size + SLOT,), the buffer one all-reduce carries."""
        with outside_step():               # kept between steps: never from a step's memory
            return self.xp.zeros((self.size + SLOT,), dtype=self.dtype)

    @cached_property
    def grads(self):
        """The gradients, (size,): the front of :attr:`grad_buffer`."""
        return self.grad_buffer[:self.size]

    @cached_property
    def grad_views(self) -> dict:
        return self.views(self.grads)

    @cached_property
    def m(self):
        return self.new_buffer()

    @cached_property
    def v(self):
        return self.new_buffer()

    def new_buffer(self):
        """A zeroed flat buffer with the arena's layout (a part's gradients, a scratch)."""
        with outside_step():
            return self.xp.zeros((self.size,), dtype=self.dtype)

    def block(self, flat, name: str):
        """Block ``name`` (see the module docstring) of a flat buffer, in its shape."""
        b = self.layout.blocks[name]
        return flat[b.offset:b.offset + math.prod(int(n) for n in b.shape)].reshape(b.shape)

    def views(self, flat) -> dict:
        """{parameter name: view} of a flat buffer with this layout, in parameter order."""
        blocks = {name: self.block(flat, name) for name in self.layout.blocks}
        return {name: blocks[m.block][m.index] if m.index else blocks[m.block]
                for name, m in self.layout.members.items()}

    def holds(self, params: dict) -> bool:
        """Whether ``params`` holds exactly this arena's parameter views (the same objects)."""
        pv = self.param_views
        return len(params) == len(pv) and all(params.get(k) is a for k, a in pv.items())

    @classmethod
    def find(cls, params: dict) -> "Arena | None":
        """The live arena whose parameter views ``params`` holds, or None."""
        return next((arena for arena in list(cls._live) if arena.holds(params)), None)
