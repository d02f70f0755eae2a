"""``python -m attn.grader``: the ``attn-check`` command."""
import sys

from .cli import console

sys.exit(console())
