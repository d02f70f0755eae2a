"""``import cupyx`` answered by the stand-in (see ``as_cupy/cupy/__init__.py``)."""
import sys

import fakecupy

sys.modules[__name__] = fakecupy.cupyx
fakecupy.install()
