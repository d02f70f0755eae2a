"""The fallback's probes (:mod:`attn.fast.gpu.fallback`), run in a child process of ``attn-train``:
``python -m attn.fast.gpu.probe REQUEST`` (a JSON object: :func:`attn.fast.gpu.fallback.request_of`'s,
and the probes already decided) probes each undecided feature in :data:`ORDER` on a tiny model of
the run's block against its reference (docs/GPU.md, "A run on a GPU always trains"), prints one
JSON line per probe (``{"probe": name, "why": null or why}``) and stops at the first failure."""
from __future__ import annotations

import contextlib
import json
import sys
from functools import partial

from ... import backend as B
from ...model import Transformer, TransformerConfig
from ...precision import Precision
from ..model import FastTransformer
from ..training.loss import cross_entropy
from . import cublas, stepmem
from .graph import REPLAY_TOLERANCE, GraphedTrainStep

#: The probes in the order they run; each needs those before it that it builds on.
ORDER = ("fast engine", "cuBLAS through ctypes", "step memory", "tiled attention", "captured step", "precision")

#: Steps each probe takes.
STEPS = 3

#: The embedding tables' scale in a probe's model: its logits then spread as a trained model's do
#: (tests/test_fallback.py holds the most likely token's mean probability above one half).
EMBED_SCALE = 4.0

#: What the block of the run's model is, of its config's fields, for the probe's model.
BLOCK_FIELDS = ("positional", "norm_position", "norm_kind", "ffn", "rope_base", "share_embeddings", "attention_dropout")


def probe_config(block: dict | None = None, dropout: float = 0.1):
    """The tiny model every probe trains (and the GPU report's preflight), of the run's ``block``
    (a dict of :data:`BLOCK_FIELDS` and ``grouped``: whether its key/value heads are fewer than its
    query heads, ``multi_query``: one key/value head, ``head_dim``: the run's head size where the
    tensor-core attention is compiled for it, so that the probe's heads take the same kernels)."""
    block = dict(block or {})
    heads = 4 if block.pop("grouped", False) else 2
    kv = 1 if block.pop("multi_query", False) else (2 if heads == 4 else None)
    head_dim = block.pop("head_dim", None)
    return TransformerConfig(vocab_size=23, d_model=heads * head_dim if head_dim else 16, n_heads=heads, d_ff=24, n_encoder_layers=1,
                             n_decoder_layers=1, dropout=dropout, label_smoothing=0.1, max_len=32, warmup_steps=8,
                             kv_heads=kv, **{k: v for k, v in block.items() if k in BLOCK_FIELDS})


def block_of(model_config) -> dict:
    """The run's block, as :func:`probe_config` takes it."""
    from .kernels.flash_mma import HEAD_SIZES
    block = {k: getattr(model_config, k) for k in BLOCK_FIELDS}
    kv, Dh = model_config.key_value_heads, model_config.d_model // model_config.n_heads
    return block | {"grouped": kv < model_config.n_heads, "multi_query": kv == 1 and model_config.n_heads > 1} \
        | ({"head_dim": Dh} if Dh in HEAD_SIZES else {})


def trained_looking(cfg) -> dict:
    """The probe model's weights on the host: drawn from seed 0, the embedding tables (the logits'
    projection) scaled by :data:`EMBED_SCALE`."""
    params = Transformer(cfg, seed=0).params
    return {k: B.to_host(v) * (EMBED_SCALE if k in ("embedding.weight", "generator.weight") else 1.0)
            for k, v in params.items()}


#: Units of roundoff of the products' inputs a narrowed precision's loss and gradients may be off
#: fp32's by (relative; the gradients as one vector, norm-wise).
UNITS = {"loss": 4, "grads": 32}


def tolerance(precision: str, what: str = "loss") -> float:
    """How far (relative) a probe's ``what`` (``loss`` or ``grads``) may be from its reference's. At fp32,
    :data:`attn.fast.gpu.graph.REPLAY_TOLERANCE`. At bf16 and tf32, :data:`UNITS` units of roundoff
    ``u = 2**-(m + 1)`` of the products' inputs (``m`` stored significand bits): rounding a product's
    inputs moves it by at most 2u of its terms' sizes, the loss by about as much (4u); the gradients
    pass through the backward's chain of products (32u, which ``tests/test_fallback.py`` holds above
    what the probe model gives, and far below a product off by half)."""
    if precision == "fp32":
        return REPLAY_TOLERANCE["rtol"]
    return UNITS[what] * 2.0 ** -(Precision.of(precision).mantissa_bits + 1)


def one_step(cfg, weights: dict, precision: str, attention: str = "plain") -> tuple:
    """The fast engine's loss and gradients (on the host, one vector in the parameters' order) of
    one forward and backward from ``weights``, without dropout, at ``precision``."""
    model = FastTransformer(cfg, params={k: B.to_device(v.copy()) for k, v in weights.items()},
                            precision=Precision.of(precision), check_ids=False, attention=attention)
    batch = batches(1)[0]
    src, tgt_in, tgt_out = (B.to_device(a) for a in (batch.src, batch.tgt_in, batch.tgt_out))
    logits, cache = model.forward(src, tgt_in, None)
    loss, dlogits = cross_entropy(logits, tgt_out, cfg.label_smoothing, inplace=True)
    grads = model.backward(dlogits, cache)
    return float(loss), B.host.concatenate([B.to_host(grads[k]).ravel() for k in sorted(grads)])


def precision_disagreement(cfg, weights: dict, precision: str, attention: str = "plain") -> str | None:
    """Why one step at ``precision`` is not fp32's within :func:`tolerance` (loss, then gradients), or None."""
    want, dwant = one_step(cfg, weights, "fp32", attention)
    got, dgot = one_step(cfg, weights, precision, attention)
    rtol = tolerance(precision)
    if not abs(got - want) <= rtol * abs(want):
        return f"the loss {got!r}, fp32's {want!r} (within {rtol:.3g} relative)"
    err = float(B.host.linalg.norm(dgot - dwant) / B.host.linalg.norm(dwant))
    if not err <= tolerance(precision, "grads"):
        return f"the gradients {err:.3g} from fp32's, relative (within {tolerance(precision, 'grads'):.3g})"
    return None


def batches(n: int = STEPS) -> list:
    from ...data import _pad_batch, pad_to_bucket
    rng = B.host.random.default_rng(0)
    return [pad_to_bucket(_pad_batch([(rng.integers(4, 23, rng.integers(1, 7)).tolist(),
                                       rng.integers(4, 23, rng.integers(1, 7)).tolist()) for _ in range(6)]))
            for _ in range(n)]


@contextlib.contextmanager
def switched(module, name: str, value):
    """``module.name`` set to ``value`` (None: left as it is) for the ``with``."""
    before = getattr(module, name)
    setattr(module, name, before if value is None else value)
    try:
        yield
    finally:
        setattr(module, name, before)


def fast_losses(cfg, weights: dict, direct=None, memory=None, graph: bool = False, attention: str = "plain") -> list:
    """The fast engine's losses over :data:`STEPS` steps from ``weights`` with the features given
    (``direct``, ``memory``: None for the switches as they are)."""
    from ..training.loop import train_step
    from ..training.optim import FastAdam
    with switched(cublas, "DIRECT", direct), switched(stepmem, "ENABLED", memory):
        params = {k: B.to_device(v.copy()) for k, v in weights.items()}
        model = FastTransformer(cfg, params=params, check_ids=False, attention=attention)
        opt = FastAdam(model.params, cfg.d_model, cfg.warmup_steps)           # the fast engine's, as it trains
        loss_fn = partial(cross_entropy, inplace=True, validate=False, check_finite=False)
        if graph:
            step = GraphedTrainStep(model, opt, cfg.label_smoothing, 1.0, loss_fn)
            losses = [float(step(b, i)[0]) for i, b in enumerate(batches())]
            if step.graphs != 1:
                raise RuntimeError(f"the step was not captured: {step.refusals}")
            return losses
        return [float(train_step(model, opt, b, B.DeviceRNG(i), cfg.label_smoothing, 1.0, loss_fn)[0])
                for i, b in enumerate(batches())]


def readable_losses(cfg, weights: dict) -> list:
    """The readable model's losses over :data:`STEPS` steps from ``weights``, on the device."""
    from ...engine import get
    from ...train import train_step
    eng = get("reference")
    model = eng.model(cfg, params={k: B.to_device(v.copy()) for k, v in weights.items()})
    opt = eng.optimizer(model)
    return [float(train_step(model, opt, b, B.DeviceRNG(i), cfg.label_smoothing, 1.0)[0])
            for i, b in enumerate(batches())]


def disagreement(got: list, want: list) -> str | None:
    """Why ``got`` (losses) is not ``want`` within :data:`attn.fast.gpu.graph.REPLAY_TOLERANCE`, or None."""
    atol, rtol = REPLAY_TOLERANCE["atol"], REPLAY_TOLERANCE["rtol"]
    for i, (g, w) in enumerate(zip(got, want)):
        if not abs(g - w) <= atol + rtol * abs(w):
            return f"step {i}'s loss {g!r}, the reference's {w!r} (within {rtol:.3g} relative)"
    return None


def asked(request: dict) -> list:
    """The probes ``request`` asks for, in :data:`ORDER`."""
    optional = {"tiled attention": request.get("tiled"), "captured step": request.get("cuda_graph"),
                "precision": request.get("precision", "fp32") != "fp32"}
    return [p for p in ORDER if optional.get(p, True)]


def _checks(request: dict, decided: dict) -> dict:
    """{probe: () -> why or None} for the probes ``request`` asks for (:func:`asked`); the captured
    step and the precision are probed with the attention the run takes (``decided`` may have
    switched the tiled one off)."""
    cfg = probe_config(request.get("block"))
    still = probe_config(request.get("block"), dropout=0.0)
    weights, still_weights = trained_looking(cfg), trained_looking(still)
    plain = lambda: fast_losses(cfg, weights, direct=False, memory=False)          # noqa: E731
    attention = "flash" if request.get("attention") == "flash" and not decided.get("tiled attention") else "plain"
    checks = {
        "fast engine": lambda: disagreement(fast_losses(still, still_weights, direct=False, memory=False),
                                            readable_losses(still, still_weights)),
        "cuBLAS through ctypes": lambda: disagreement(fast_losses(cfg, weights, memory=False), plain()),
        "step memory": lambda: disagreement(fast_losses(cfg, weights), plain()),
        "tiled attention": lambda: disagreement(fast_losses(cfg, weights, attention="flash"),
                                                fast_losses(cfg, weights)),
        "captured step": lambda: (
            "it needs cuBLAS through ctypes and the step memory" if not (cublas.DIRECT and stepmem.ENABLED) else
            disagreement(fast_losses(cfg, weights, graph=True, attention=attention),
                         fast_losses(cfg, weights, attention=attention))),
        "precision": lambda: (
            "it needs cuBLAS through ctypes" if not cublas.DIRECT else
            precision_disagreement(still, still_weights, request["precision"], attention))}
    return {p: checks[p] for p in asked(request)}


def apply(decided: dict) -> None:
    """The process-wide switches as the probes ``decided`` ({probe: why or None}) leave them."""
    if decided.get("cuBLAS through ctypes"):
        cublas.DIRECT = False
    if decided.get("step memory"):
        stepmem.ENABLED = False


def run(request: dict, out=sys.stdout) -> None:
    """Probe what ``request`` asks for and has not decided, one JSON line each to ``out``, until
    the first that fails."""
    decided = dict(request.get("decided", {}))
    apply(decided)
    for name, check in _checks(request, decided).items():
        if name in decided:
            continue
        try:
            why = check()
        except Exception as e:                  # noqa: BLE001 (a feature that fails in any way is switched off)
            why = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps({"probe": name, "why": why}), file=out, flush=True)
        if why is not None:
            return
        decided[name] = None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m attn.fast.gpu.probe REQUEST (a JSON object; see attn.fast.gpu.fallback)", file=sys.stderr)
        return 2
    B.set_backend("cupy")
    run(json.loads(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
