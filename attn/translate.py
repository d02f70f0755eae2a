"""The ``attn-translate`` command: translate sentences with a trained checkpoint.

    attn-translate --checkpoint runs/toy/checkpoint.npz "the old friend laughed ."
    echo "he carries red girls ." | attn-translate --checkpoint runs/toy/checkpoint.npz --beam 4

One translation per line on standard output; everything else (where a figure
was written) goes to standard error. Problems the user can fix (no checkpoint,
a damaged one, an unusable backend) end with exit code 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import backend as B
from .checkpoint import CheckpointError, load_npz

EXAMPLES = """\
examples:
  attn-translate --checkpoint runs/toy/checkpoint.npz "the old friend laughed ."
  attn-translate --checkpoint runs/toy/checkpoint.npz --beam 4 < sentences.txt > translations.txt
  attn-translate --checkpoint runs/toy/checkpoint.npz --attention att.png "he carries red girls ."
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attn-translate",
        description="Translate sentences with a Transformer checkpoint written by attn-train. "
                    "Sentences come from the arguments, or one per line from standard input when "
                    "none are given; one translation per line is printed to standard output.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sentences", nargs="*", metavar="SENTENCE",
                   help='a sentence to translate, e.g. "the old friend laughed ." '
                        "(quote each one; none: read standard input, one sentence per line)")
    p.add_argument("--checkpoint", required=True, type=Path, metavar="PATH",
                   help="the checkpoint written by attn-train, e.g. --checkpoint runs/toy/checkpoint.npz")
    p.add_argument("--beam", type=int, default=1, metavar="K",
                   help="beam size: 1 (default) decodes greedily, the paper uses --beam 4")
    p.add_argument("--alpha", type=float, default=0.6, metavar="A",
                   help="length penalty of beam search, ((5+|Y|)/6)**A (default 0.6, the paper's), "
                        "e.g. --alpha 0 for none; ignored by greedy decoding")
    p.add_argument("--attention", type=Path, metavar="PNG",
                   help="draw the last decoder layer's cross-attention (averaged over heads) of the first "
                        "sentence to this image, e.g. --attention att.png; with several sentences, one "
                        "file per sentence: att-1.png, att-2.png, ...")
    p.add_argument("--backend", choices=("numpy", "cupy", "auto"),
                   default=os.environ.get("ATTN_BACKEND", "auto").strip().lower() or "auto",
                   help="array backend: numpy (CPU), cupy (GPU), or auto (cupy where a GPU is usable); "
                        "default $ATTN_BACKEND or auto, e.g. --backend numpy")
    p.add_argument("--batch-size", type=int, default=64, metavar="N",
                   help="sentences decoded together (default 64)")
    return p


def attention_paths(path: Path, n: int) -> list[Path]:
    """``att.png`` for one sentence; ``att-1.png``, ``att-2.png``, ... for several."""
    if n <= 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix or '.png'}") for i in range(1, n + 1)]


def load_translator(checkpoint):
    """Load (model, vocab) from a checkpoint written by ``attn-train`` onto the selected backend.

    Raises CheckpointError if the file is missing or corrupt, does not fit its
    config, or holds no vocabulary.
    """
    from .data import Vocab
    from .model import Transformer
    arrays, meta = load_npz(checkpoint)
    if not meta.get("vocab"):
        raise CheckpointError(f"checkpoint {checkpoint} holds no vocabulary (meta 'vocab'): "
                              "was it written by attn-train?")
    try:
        vocab = Vocab.from_json(meta["vocab"])
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {checkpoint} has an unreadable vocabulary ({e})") from None
    model = Transformer.from_arrays(arrays, meta, source=str(checkpoint))
    if len(vocab) != model.config.target_vocab_size:
        raise CheckpointError(f"checkpoint {checkpoint}: the vocabulary has {len(vocab)} tokens, "
                              f"the model {model.config.target_vocab_size}")
    return model, vocab


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _fail(msg: str) -> int:
    print(f"attn-translate: error: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.beam < 1:
        return _fail(f"--beam must be at least 1, got {args.beam}")
    if args.batch_size < 1:
        return _fail(f"--batch-size must be at least 1, got {args.batch_size}")
    try:
        B.set_backend(args.backend)
        notice = B.auto_fallback_notice()          # auto with CuPy installed but unusable: one line
        if notice:
            print(f"attn-translate: {notice}", file=sys.stderr)
        model, vocab = load_translator(args.checkpoint)
    except (CheckpointError, B.BackendError) as e:
        return _fail(str(e))

    sentences = args.sentences if args.sentences else [line.rstrip("\r\n") for line in sys.stdin]
    from .evaluate import translate
    results = translate(model, vocab, sentences, beam_size=args.beam, alpha=args.alpha,
                        batch_size=args.batch_size, with_attention=args.attention is not None)
    for r in results:
        print(r.text)
    sys.stdout.flush()

    if args.attention is not None and results:
        from .plot import plot_attention
        for path, r in zip(attention_paths(args.attention, len(results)), results):
            try:
                plot_attention(r.attention, r.src_tokens, r.tgt_tokens, path,
                               title=_short(" ".join(r.src_tokens)) + "\n→ " + _short(r.text))
            except OSError as e:
                return _fail(f"cannot write the attention figure {path}: {e}")
            print(f"attn-translate: attention written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
