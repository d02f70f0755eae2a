"""The loss curves of one training run at each precision (``--precision fp32|tf32|bf16``), on
any backend: on NumPy the products' inputs are rounded as a GPU's tensor cores read them
(:mod:`attn.precision`), so a CPU run shows how far bf16 and tf32 training strays from fp32.

    python -m attn.bench.precision --steps 300 --plot docs/precision.png

trains the toy translator (``attn-train``'s defaults: the toy corpus, the toy preset, seed 0) for
``--steps`` steps once per precision, from the same weights, on the same batches with the same
dropout masks, and prints per precision the loss at the last step and the largest and mean
difference from the fp32 curve (both curves smoothed over :data:`SMOOTH` steps, as the figure
draws them: a single step's loss is one batch's, and two runs' batches differ in their noise
once their weights have). ``tests/test_precision.py`` holds the tolerance at a cheap size.
Nothing here is timed.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from .. import backend as B
from ..data import make_batches
from ..precision import PRECISIONS
from ..training.config import TrainConfig

#: Steps of the running mean the curves are compared and drawn with.
SMOOTH = 20


def loss_curves(config: TrainConfig, precisions=PRECISIONS, progress=None) -> dict:
    """{precision: the training loss of every step} for ``config.steps`` steps of the run ``config``
    asks for (its preset, seed, data; its own precision is ignored), once per precision, each from
    the same initial weights with the same batches and dropout masks; no evaluation, nothing written.
    The data and the vocabulary are prepared once. ``progress(precision, steps_done)``."""
    from ..model import Transformer
    from ..fast.training.loop import train_step
    from ..training.prepare import make_engine, prepare
    with tempfile.TemporaryDirectory() as tmp:
        config = dataclasses.replace(config.with_recipe(), minutes=0, out=Path(tmp), quiet=True, precision="fp32")
        B.set_backend(config.backend)
        run = prepare(config, None, None, say=lambda message: None)
    first = {k: v.copy() for k, v in run.model.params.items()}         # the weights every run starts from
    smoothing, curves = run.model.config.label_smoothing, {}
    for precision in precisions:
        model = Transformer(run.model.config, dtype=run.model.dtype, params={k: v.copy() for k, v in first.items()})
        model, opt = make_engine(model, "fast", run.opt.lr_factor, precision)
        losses, epoch = [], 0
        while len(losses) < config.steps:
            for batch in make_batches(run.train_enc, config.max_tokens, shuffle=True, seed=config.seed, epoch=epoch):
                seed = config.seed * 1_000_003 + len(losses)          # as attn-train seeds each step
                loss, _ = train_step(model, opt, batch, B.DeviceRNG(seed), smoothing, config.clip, run.loss_fn)
                losses.append(B.to_float(loss))
                if progress is not None:
                    progress(precision, len(losses))
                if len(losses) == config.steps:
                    break
            epoch += 1
        curves[precision] = losses
    return curves


def smooth(losses, k: int = SMOOTH):
    """The running mean of ``k`` steps (``len(losses) - k + 1`` values)."""
    np = B.host
    y = np.asarray(losses, dtype=float)
    k = max(1, min(k, len(y)))
    return np.convolve(y, np.ones(k) / k, mode="valid")


def compare(curves: dict, k: int = SMOOTH) -> dict:
    """Per precision: the last step's loss, the last smoothed loss, and the largest and mean absolute
    difference of its smoothed curve from fp32's."""
    np = B.host
    ref = smooth(curves["fp32"], k)
    out = {}
    for p, losses in curves.items():
        d = np.abs(smooth(losses, k) - ref)
        out[p] = {"last_loss": float(losses[-1]), "last_smoothed": float(smooth(losses, k)[-1]),
                  "max_diff": float(d.max()), "mean_diff": float(d.mean())}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m attn.bench.precision", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps per precision (default 300)")
    p.add_argument("--preset", default="toy", help="attn-train's model preset (default toy)")
    p.add_argument("--seed", type=int, default=0, help="weights, batches and dropout (default 0)")
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy", "auto"], help="default numpy")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated (default all; fp32 first)")
    p.add_argument("--plot", type=Path, help="write the figure of the curves here (PNG)")
    args = p.parse_args(argv)
    wanted = [s.strip() for s in args.precisions.split(",") if s.strip()]
    if not wanted or wanted[0] != "fp32" or any(w not in PRECISIONS for w in wanted):
        p.error(f"--precisions must start with fp32 (the reference) and name only {', '.join(PRECISIONS)}")
    from tqdm import tqdm
    config = TrainConfig(preset=args.preset, seed=args.seed, steps=args.steps, backend=args.backend)
    with tqdm(total=args.steps * len(wanted), unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        def progress(precision, n):
            bar.set_description(precision, refresh=False)
            bar.update(1)
        curves = loss_curves(config, wanted, progress)
    print(f"python -m attn.bench.precision {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"{args.preset} preset, seed {args.seed}, {args.steps} steps on {B.describe()}; curves smoothed over "
          f"{SMOOTH} steps")
    print(f"{'precision':<10} {'last loss':>10} {'smoothed':>10} {'max |diff|':>11} {'mean |diff|':>12}")
    for precision, r in compare(curves).items():
        print(f"{precision:<10} {r['last_loss']:>10.4f} {r['last_smoothed']:>10.4f} {r['max_diff']:>11.4f} "
              f"{r['mean_diff']:>12.4f}")
    if args.plot:
        from ..plot import plot_precision_curves
        print(f"figure: {plot_precision_curves(curves, args.plot, SMOOTH, f'{args.preset} preset, seed {args.seed}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
