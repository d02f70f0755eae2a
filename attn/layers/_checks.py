"""Input checks shared by the layers: clear errors that name the layer, the argument and the shapes."""
from __future__ import annotations

from .. import backend as B


def check_float(layer: str, **arrays) -> None:
    """Every array is floating point and all share one dtype."""
    dtypes = {name: a.dtype for name, a in arrays.items() if a is not None}
    for name, dt in dtypes.items():
        if dt.kind != "f":
            raise TypeError(f"{layer}: {name} must be a floating-point array, got dtype {dt}")
    if len(set(dtypes.values())) > 1:
        desc = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"{layer}: arguments must share one dtype, got {desc}")


def check_last_dim(layer: str, name: str, a, size: int, what: str) -> None:
    if a.ndim < 1 or a.shape[-1] != size:
        raise ValueError(f"{layer}: {name} has shape {tuple(a.shape)}, but its last dimension must be {size} ({what})")


def check_ids(layer: str, name: str, ids, V: int) -> None:
    """Token ids are integers in [0, V). CuPy wraps out-of-range indices silently, so check first."""
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{layer}: {name} must be an integer array of token ids, got dtype {ids.dtype}")
    if ids.size:
        lo, hi = (int(v) for v in B.to_host(B.get_array_module(ids).stack([ids.min(), ids.max()])))   # one transfer
        if lo < 0 or hi >= V:
            raise IndexError(
                f"{layer}: {name} (shape {tuple(ids.shape)}) holds ids in [{lo}, {hi}], "
                f"outside the vocabulary [0, {V})"
            )
