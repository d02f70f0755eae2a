"""The stand-in's ``cupy`` answers NumPy's other names (``cupy.any``, ``cupy.sum``...) through
its module ``__getattr__``, which keeps each wrapper it makes. A name that is also one of
Python's builtins must not be kept in the module's globals: the stand-in's own code calls
``any(...)``, ``sum(...)``, ``max(...)`` and means Python's."""
from __future__ import annotations

import builtins

import numpy as np
import pytest

import fakecupy
from fakecupy import cupy as cp

SHADOWING = sorted(n for n in ("any", "all", "sum", "max", "min", "abs", "round") if hasattr(np, n))


@pytest.mark.parametrize("name", SHADOWING)
def test_a_numpy_name_that_is_a_builtin_leaves_the_builtin_alone(name):
    wrapper = getattr(cp, name)                      # the wrapper, made and handed out
    assert callable(wrapper) and getattr(cp, name) is wrapper and wrapper is not getattr(builtins, name)
    assert name not in vars(cp), f"cupy.{name} was kept in the stand-in's globals, hiding Python's {name}"
    a = cp.arange(6)
    assert cp.get_array_module(np.ones(2), a) is cp and cp.get_array_module(np.ones(2)) is np
    assert np.array_equal(cp.asnumpy(wrapper(a)), getattr(np, name)(np.arange(6)))


def test_other_names_are_kept():
    w = cp.cumsum
    assert vars(cp)["cumsum"] is w and cp.cumsum is w
    assert fakecupy.cupy is cp
