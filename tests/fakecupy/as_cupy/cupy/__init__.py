"""``import cupy`` answered by the stand-in, for child processes (see ``fakecupy.child_env``).

With ``tests/fakecupy/as_cupy`` and ``tests`` on ``PYTHONPATH``, a process that imports ``cupy``
gets :mod:`fakecupy.cupy` (the module replaces itself in ``sys.modules``), and attn is told to
use it (:func:`fakecupy.install`), so ``ATTN_BACKEND=cupy`` selects the stand-in there and in
every process it starts.
"""
import sys

import fakecupy

sys.modules[__name__] = fakecupy.cupy
fakecupy.install()
