"""int8 weights against float32 (issue 48, part 3): quality, bytes, and each matrix's error.

    python benchmarks/int8.py --translator runs/int8-toy/averaged.npz --lm runs/int8-lm/averaged.npz [--engine fast]

For the translator (a checkpoint of attn-train on data/toy, or any corpus given by --data/--src/--tgt):
the validation loss (per-token cross-entropy, no smoothing) and the test split's BLEU (greedy) with
float32 weights and with every matrix in int8 (:func:`attn.quantize.quantize_model`, dequantised on
the fly); the bytes of the checkpoint and of an int8 one (:func:`attn.quantize.save_int8`); the
bytes the page downloads for a float32, float16 and int8 export (model.json and weights.bin); and
each matrix's largest error against the bound the rounding gives (half its largest scale; the
ratio column is the largest error over its own channel's half step, at most 1 up to float32's
rounding). For the language model (attn-train --task lm): the validation loss at float32 and int8.
Both models run on ``--engine`` (:func:`attn.engine.for_inference`: ``fast``, the default, dequantises
each matrix as a layer reads it, as the readable model does; ``reference``, the readable model). On
NumPy the translator's memory is traced too (tracemalloc, which sees NumPy's arrays): the bytes each
model holds once made from the weights, and the peak while it translates the first --memory-sentences
test sentences greedily (its weights included).
Writes the figures as JSON to --json (default benchmarks/out/int8.json) and prints them.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attn.backend as B  # noqa: E402
from attn.data import encode_pairs, make_batches, read_parallel, read_text, encode_text  # noqa: E402
from attn.engine import for_inference  # noqa: E402
from attn.evaluate import evaluate_bleu  # noqa: E402
from attn.model import Transformer  # noqa: E402
from attn.quantize import matrix_errors, quantize_model, save_int8  # noqa: E402
from attn.site.export import export_model  # noqa: E402
from attn.training.evaluation import evaluate_loss  # noqa: E402
from attn.translate import load_translator  # noqa: E402


def _timed(f, *args, **kwargs):
    t = time.perf_counter()
    out = f(*args, **kwargs)
    return out, time.perf_counter() - t


def memory(model, vocab, sentences: list, engine: str) -> dict:
    """For the float32 model and its int8 copy on ``engine``: the bytes traced once it is made from
    ``model``'s weights (``held``), and the peak while it translates ``sentences`` greedily (weights
    included). NumPy only: tracemalloc sees NumPy's arrays, not a GPU's."""
    makers = {"fp32": lambda: Transformer(model.config,
                                          params={k: B.to_host(v).copy() for k, v in model.params.items()}),
              "int8": lambda: quantize_model(model)}
    evaluate_bleu(for_inference(makers["int8"](), engine), vocab, sentences[:1])     # imports and caches: untraced
    out = {}
    for name, make in makers.items():
        tracemalloc.start()
        try:
            m = for_inference(make(), engine)
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            evaluate_bleu(m, vocab, sentences)
            out[name] = {"held": held, "peak": tracemalloc.get_traced_memory()[1]}
        finally:
            tracemalloc.stop()
        del m
    return out


def translator(path: Path, data: Path, src: str, tgt: str, limit: int, engine: str = "fast",
               memory_sentences: int = 0, split: str = "test") -> dict:
    """The translator's figures; ``path`` a checkpoint, or a folder written by attn-export (its
    numbers as the page reads them: web/model is the shipped toy model, float16 widened); both
    models decode and are evaluated on ``engine``."""
    if path.is_dir():
        from attn.site.export import load_export
        model, vocab, _ = load_export(path)
    else:
        model, vocab = load_translator(path)
    int8 = quantize_model(model)
    val = encode_pairs(read_parallel(data, src, tgt, "val"), vocab, max_len=model.config.max_len)
    batches = make_batches(val, 4096, shuffle=False)
    test = [p for p in read_parallel(data, src, tgt, split) if p[0]][:limit or None]
    out = {"checkpoint": str(path), "parameters": model.num_parameters(), "val_pairs": len(val),
           "test_sentences": len(test), "bleu_split": split, "engine": engine}
    if memory_sentences and B.get_backend() == "numpy":
        out["memory"] = memory(model, vocab, test[:memory_sentences], engine)
    for name, m in (("fp32", for_inference(model, engine)), ("int8", for_inference(int8, engine))):
        loss, t_loss = _timed(evaluate_loss, m, batches, 0.0)
        (bleu, _), t_bleu = _timed(evaluate_bleu, m, vocab, test)
        out[name] = {"val_nll": loss["val_nll"], "bleu": bleu, "val_seconds": t_loss, "bleu_seconds": t_bleu}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_int8(int8, tmp / "int8.npz", {"vocab": vocab.to_json()})
        model.save(tmp / "fp32.npz", extra_meta={"vocab": vocab.to_json()})
        out["checkpoint_bytes"] = {"fp32": (tmp / "fp32.npz").stat().st_size,
                                   "int8": (tmp / "int8.npz").stat().st_size}
        out["page_bytes"] = {}
        for dtype in ("float32", "float16", "int8"):
            export_model(model, vocab, tmp / dtype, dtype)
            out["page_bytes"][dtype] = sum(f.stat().st_size for f in (tmp / dtype).iterdir())
    out["matrices"] = {k: {"max_error": e, "bound": b, "max_error_over_own_bound": r}
                       for k, (e, b, r) in matrix_errors(model.params, int8.params).items()}
    return out


def language_model(path: Path, engine: str = "fast") -> dict:
    from attn.generate import load_language_model
    from attn.training.lm import VAL_FRACTION, val_batches, validate
    model, vocab, char, context = load_language_model(path)
    text = read_text(ROOT / "data" / "tinyshakespeare" / "input.txt.gz")
    ids = encode_text(text[int(len(text) * (1 - VAL_FRACTION)):], vocab, char)
    batches = val_batches(B.host.asarray(ids, dtype="int64"), context)
    int8 = quantize_model(model)
    out = {"checkpoint": str(path), "parameters": model.num_parameters(), "engine": engine}
    for name, m in (("fp32", for_inference(model, engine)), ("int8", for_inference(int8, engine))):
        loss, t = _timed(validate, m, batches)
        out[name] = {"val_loss": loss["val_loss"], "seconds": t}
    errs = matrix_errors(model.params, int8.params)
    out["max_error_over_own_bound"] = max(r for _, _, r in errs.values())
    return out


def report(r: dict) -> None:
    if "translator" in r:
        t = r["translator"]
        print(f"translator {t['checkpoint']}: {t['parameters']:,} parameters; {t['val_pairs']} validation pairs, "
              f"{t['test_sentences']} {t.get('bleu_split', 'test')} sentences (greedy); engine {t.get('engine', 'reference')}")
        for k in ("fp32", "int8"):
            print(f"  {k}: val loss {t[k]['val_nll']:.5f}  BLEU {t[k]['bleu']:.2f}  "
                  f"(val {t[k]['val_seconds']:.1f} s, BLEU {t[k]['bleu_seconds']:.1f} s)")
        print(f"  change: val loss {t['int8']['val_nll'] - t['fp32']['val_nll']:+.5f}, "
              f"BLEU {t['int8']['bleu'] - t['fp32']['bleu']:+.2f}")
        cb = t["checkpoint_bytes"]
        print("  checkpoint bytes: " + ", ".join(f"{k} {v:,}" for k, v in cb.items())
              + (f" (int8 / fp32 {cb['int8'] / cb['fp32']:.3f})" if "fp32" in cb else ""))
        pb = t["page_bytes"]
        print("  page download bytes: " + ", ".join(f"{k} {v:,}" for k, v in pb.items())
              + f" (int8 / float32 {pb['int8'] / pb['float32']:.3f}, int8 / float16 {pb['int8'] / pb['float16']:.3f})")
        for k, mem in t.get("memory", {}).items():
            print(f"  memory {k}: {mem['held']:,} bytes held once made, peak {mem['peak']:,} translating "
                  f"(tracemalloc)" + (f"; int8 / fp32: held {mem['held'] / t['memory']['fp32']['held']:.3f}, "
                                      f"peak {mem['peak'] / t['memory']['fp32']['peak']:.3f}" if k == "int8" else ""))
        worst = max(m["max_error_over_own_bound"] for m in t["matrices"].values())
        print(f"  matrices: {len(t['matrices'])}; largest error over its own bound {worst:.6f}")
        for name, m in t["matrices"].items():
            print(f"    {name:30s} max |w - w_hat| {m['max_error']:.3e}  bound {m['bound']:.3e}  "
                  f"ratio {m['max_error_over_own_bound']:.6f}")
    if "lm" in r:
        lm = r["lm"]
        print(f"language model {lm['checkpoint']}: {lm['parameters']:,} parameters; "
              f"engine {lm.get('engine', 'reference')}")
        for k in ("fp32", "int8"):
            print(f"  {k}: val loss {lm[k]['val_loss']:.5f} nats/token ({lm[k]['seconds']:.1f} s)")
        print(f"  change: {lm['int8']['val_loss'] - lm['fp32']['val_loss']:+.5f}; largest error over its own bound "
              f"{lm['max_error_over_own_bound']:.6f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--translator", type=Path, help="a translator's checkpoint, or a folder attn-export wrote")
    p.add_argument("--data", type=Path, default=ROOT / "data" / "toy")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="tk")
    p.add_argument("--limit", type=int, default=1000, help="sentences of --bleu-split to translate (0: all)")
    p.add_argument("--bleu-split", choices=("test", "val"), default="test",
                   help="the split whose sentences BLEU is measured on (default test)")
    p.add_argument("--lm", type=Path, help="a checkpoint of attn-train --task lm")
    p.add_argument("--engine", choices=("fast", "reference"), default="fast",
                   help="the engine that runs both models: fast (attn.fast, the int8 one dequantised as each "
                        "layer reads it) or reference (the readable model)")
    p.add_argument("--memory-sentences", type=int, default=64, metavar="N",
                   help="trace the memory (NumPy) of each model translating the first N test sentences (0: no)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "out" / "int8.json")
    p.add_argument("--show", type=Path, metavar="JSON", help="print the figures a run wrote to JSON, and stop")
    args = p.parse_args(argv)
    if args.show:
        report(json.loads(args.show.read_text()))
        return 0
    result = {}
    if args.translator:
        result["translator"] = translator(args.translator, args.data, args.src, args.tgt, args.limit, args.engine,
                                          args.memory_sentences, args.bleu_split)
    if args.lm:
        result["lm"] = language_model(args.lm, args.engine)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
