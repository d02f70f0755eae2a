"""What a model file may hold, told to :func:`attn.checkpoint.load_npz` before it decompresses
anything: the parameters of the config in its ``__meta__`` record (and a run's optimizer state),
no more bytes than that config implies, and nothing else."""
from __future__ import annotations

from .checkpoint import CheckpointError
from .model import TransformerConfig, parameter_count


def model_members(meta: dict, sizes: dict, optimizer: bool = False) -> dict:
    """What :func:`attn.checkpoint.load_npz` reads of a model file (its ``expect``): the parameters,
    and a run's optimizer moments and loss history if ``optimizer`` (else they are left unread),
    nothing else; and, before any is decompressed, no more bytes than the config in ``meta``
    implies in float64 (its parameters, their two moments, a loss a step)."""
    if "config" not in meta:
        raise CheckpointError("it holds no model config")
    try:
        cfg = TransformerConfig.from_dict(meta["config"])
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"it has an invalid config: {e}") from None
    wanted = {k: optimizer or k.startswith("param/") for k in sizes
              if k.startswith(("param/", "adam.m/", "adam.v/")) or k == "history/train_loss"}
    others = sorted(set(sizes) - set(wanted))
    if others:
        raise CheckpointError(f"member {others[0]!r} is not part of a model"
                              + (f" (nor are {len(others) - 1} more)" if len(others) > 1 else ""))
    steps = meta.get("step") if isinstance(meta.get("step"), int) and optimizer else 0
    implied = 8 * parameter_count(cfg) * (3 if optimizer else 1) + 8 * steps + 2**20
    claimed = sum(sizes[k] for k in wanted if wanted[k])
    if claimed > implied:
        raise CheckpointError(f"its arrays claim {claimed:,} bytes, more than the {implied:,} its config implies")
    return wanted
