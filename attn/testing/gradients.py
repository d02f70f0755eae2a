"""The float64 gradient check the tests run, recording every relative error for the
session's closing summary."""
from __future__ import annotations

from ..gradcheck import check_layer

# ----------------------------------------------------------------------------- gradient checks


#: Every gradient checked this session: (layer, argument, relative error).
GRADIENT_ERRORS: list[tuple[str, str, float]] = []
#: How many times check_gradients ran (one per hypothesis example of a gradient test).
GRADIENT_CHECKS: list[int] = [0]


def check_gradients(name: str, forward, backward, args: dict, wrt, tol: float = 1e-6, **kwargs) -> dict:
    """:func:`attn.gradcheck.check_layer` (float64 central differences against a random
    upstream gradient, AssertionError naming the layer and argument), recording every
    relative error for the closing summary. Returns {argument: relative error}."""
    errors = check_layer(name, forward, backward, args, wrt, tol=tol, **kwargs)
    GRADIENT_CHECKS[0] += 1
    GRADIENT_ERRORS.extend((name, arg, err) for arg, err in errors.items())
    return errors


def gradient_summary() -> str | None:
    """"max relative gradient error: X (layer.argument) over N checks (M gradients)", or None."""
    if not GRADIENT_ERRORS:
        return None
    name, arg, worst = max(GRADIENT_ERRORS, key=lambda e: e[2])
    return (f"max relative gradient error: {worst:.3g} ({name}.{arg}) over {GRADIENT_CHECKS[0]} checks "
            f"({len(GRADIENT_ERRORS)} argument gradients)")
