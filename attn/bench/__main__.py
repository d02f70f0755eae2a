"""``python -m attn.bench``: see :mod:`attn.bench`."""
import sys

from .cli import main

sys.exit(main())
