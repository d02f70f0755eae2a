"""An int8 model on the fast engine: :class:`Int8Arena`, what :class:`attn.fast.FastTransformer`
holds in place of its :class:`~attn.fast.core.arena.Arena` when its parameters are an
:class:`attn.quantize.Int8Params` (:func:`arena_for` decides, once). docs/ARCHITECTURE.md says what
it keeps: the arena's blocks, each matrix in int8 with one float32 scale an output channel (its
columns: ``w_q | w_k | w_v`` side by side keep their own scales; a table's, its rows), each vector in
float32; a block dequantised when a layer reads it (``arena.block(arena.params, name)``, or
``params[name]`` through the :class:`Int8Params` whose entries are views of the blocks) and dropped
when the layer is done. What the model derives from its weights is made at each read too
(:func:`each_for`), so nothing float32 of the model's size is ever kept. An int8 model is for
inference: its gradient and moment buffers refuse (:func:`attn.quantize.refuse_training`)."""
from __future__ import annotations

from collections.abc import Sequence

from ... import backend as B
from ...model import parameter_shapes
from ...quantize import Int8Params, dequantize_int8, refuse_training, rows_are_channels
from .arena import Arena, layout


def arena_for(params: dict, config, dtype=None):
    """The arena of a model's ``params``: an :class:`Int8Arena` for an :class:`Int8Params` (the
    model then float32), else :meth:`Arena.adopt`'s: where the fast engine tells int8 from float."""
    if not isinstance(params, Int8Params):
        return Arena.adopt(params, config, dtype)
    if dtype is not None and B.host.dtype(dtype) != B.host.float32:
        raise ValueError(f"an int8 model computes in float32 (its scales' dtype), not {B.host.dtype(dtype)}")
    return Int8Arena.adopt(params, config)


class PerUse(Sequence):
    """A sequence whose item ``i`` is ``make(i)``, made each time it is read (never kept)."""

    def __init__(self, n: int, make):
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if not -self.n <= i < self.n:
            raise IndexError(f"PerUse: item {i} of {self.n}")
        return self.make(i % self.n)


def _made_now(n: int, make) -> list:
    return [make(i) for i in range(n)]


def each_for(arena):
    """How a model holds what it derives from its weights (``each(n, make)``): a list made now
    over an :class:`Arena`'s views, a :class:`PerUse` over an :class:`Int8Arena`'s blocks."""
    return PerUse if isinstance(arena, Int8Arena) else _made_now


class Dequantised:
    """The ``params`` of an :class:`Int8Arena`: the token that :meth:`Int8Arena.block` reads its
    blocks from (an int8 arena has no flat float buffer)."""

    def __repr__(self) -> str:
        return "<an int8 arena's blocks, dequantised when read>"


class Int8Arena:
    """The blocks of :func:`attn.fast.core.arena.layout` in int8 (see the module docstring); ``int8``
    is the :class:`Int8Params` whose entries are views of them (:meth:`adopt` makes it so)."""

    def __init__(self, int8: Int8Params, config):
        self.config, self.dtype = config, B.host.dtype("float32")
        self.layout = layout(config)
        self.size = self.layout.size
        first = next(iter(int8.quantized.values()))[0]
        self.xp = xp = B.get_array_module(first)
        self.params = Dequantised()
        shapes = parameter_shapes(config)
        self.q, self.scale, self.vectors, views = {}, {}, {}, {}
        members = {}
        for name, m in self.layout.members.items():
            members.setdefault(m.block, []).append(name)
        for block, names in members.items():
            shape = self.layout.blocks[block].shape
            if len(shapes[names[0]]) == 2:                                   # matrices: int8, a scale a channel
                q = self.q[block] = xp.empty(shape, dtype=B.host.int8)
                rows = rows_are_channels(names[0])
                s = self.scale[block] = xp.empty((shape[0], 1) if rows else (1, shape[1]), dtype=self.dtype)
                for name in names:
                    at = self.layout.members[name].index or (slice(None),)
                    q[at], s[at] = int8.quantized[name]
                    views[name] = (q[at], s[at])
            else:                                                            # vectors: float32
                v = self.vectors[block] = xp.empty(shape, dtype=self.dtype)
                for name in names:
                    at = self.layout.members[name].index or (slice(None),)
                    v[at] = int8.vectors[name]
                    views[name] = v[at]
        self.views_of = views

    @classmethod
    def adopt(cls, int8: Int8Params, config) -> "Int8Arena":
        """An int8 arena holding ``int8``'s numbers; ``int8``'s entries are then replaced by its
        views, in place, so that the readable model that shares ``int8`` shares its bytes."""
        missing = sorted(set(parameter_shapes(config)) - set(int8))
        if missing:
            raise KeyError(f"Int8Arena: no value for {missing[:5]}")
        arena = cls(int8, config)
        for name, view in arena.views_of.items():
            (int8.quantized if name in int8.quantized else int8.vectors)[name] = view
        arena.int8 = int8
        return arena

    def block(self, flat, name: str):
        """Block ``name`` of the model's weights (``flat`` must be :attr:`params`): a matrix block
        as ``q * scale`` in float32, made now; a vector block as it is held."""
        if flat is not self.params:
            refuse_training(self.int8, "Int8Arena.block of a flat buffer")
        if name in self.q:
            return dequantize_int8(self.q[name], self.scale[name])
        return self.vectors[name]

    def holds(self, params) -> bool:
        """Whether ``params`` is the :class:`Int8Params` over this arena's blocks."""
        return params is self.int8

    def load(self, params) -> None:
        raise ValueError("an int8 model's weights are read-only: make a new model from new parameters "
                         "(attn.quantize.quantize_params), not by replacing its params")

    @property
    def param_views(self) -> Int8Params:
        return self.int8

    def nbytes(self) -> int:
        """The bytes it holds: one a matrix's number, four a scale or a vector's number."""
        return sum(int(a.nbytes) for d in (self.q, self.scale, self.vectors) for a in d.values())

    # ---- what training would ask

    grad_buffer = property(lambda self: refuse_training(self.int8, "the gradient buffer"))
    grads = property(lambda self: refuse_training(self.int8, "the gradients"))
    grad_views = property(lambda self: refuse_training(self.int8, "the gradients"))
    m = property(lambda self: refuse_training(self.int8, "Adam's moments"))
    v = property(lambda self: refuse_training(self.int8, "Adam's moments"))

    def new_buffer(self):
        refuse_training(self.int8, "a gradient buffer")

    def views(self, flat):
        refuse_training(self.int8, "the views of a flat buffer")
