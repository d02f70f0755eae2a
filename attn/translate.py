"""The ``attn-translate`` command: translate sentences with a trained checkpoint.

    attn-translate --checkpoint runs/toy/checkpoint.npz "the old friend laughed ."
    echo "he carries red girls ." | attn-translate --checkpoint runs/toy/checkpoint.npz --beam 4

One line out per line in (an empty line for an empty one): each line is cut at its
sentence ends and its sentences translated one by one; everything else (where a figure
was written) goes to standard error. Standard input is read as it comes, at most
``--batch-size`` lines at a time, and each batch's translations are written and flushed
before more is read: memory does not grow with the input, a line piped in is translated
without waiting for the end of the input, and an interrupt (exit code 130) keeps every
translation written so far. A sentence may have at most ``--max-length``
tokens (default 512, at most 4,096) and at most the model's ``max_len``, the longest it
was trained on: one over the limit is refused, since attention's memory and time grow
with the square of the length. A line may have at most :data:`MAX_LINE_BYTES` (1 MiB):
it is held whole while its sentences are translated. Problems the user can fix (no
checkpoint, a damaged one, an unusable backend, a bad flag, input that is not
UTF-8 or too long) end with exit code 2 and a one-line message, before any
translating of the batch of lines that holds them (the batches before it are written).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import select
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from . import backend as B
from .checkpoint import CheckpointError, load_npz
from .engine import for_inference
from .evaluate import MAX_ALPHA, MAX_BEAM, MAX_SOURCE_TOKENS, MAX_SOURCE_TOKENS_LIMIT

#: Tokens a --draft proposes a round unless --speculate says, and the most it may.
DEFAULT_SPECULATE, MAX_SPECULATE = 4, 64
#: The longest line of standard input, in bytes (1 MiB: a novel's chapter, tens of thousands of
#: sentences): a line is held whole, and tokenised whole, while its sentences are translated, so a
#: longer one, or a file without line ends, is refused as soon as it grows past this, not after
#: gigabytes; a line of 1 MiB without a sentence end is refused in seconds.
MAX_LINE_BYTES = 2**20

EXAMPLES = """\
examples:
  attn-translate --checkpoint runs/toy/checkpoint.npz "the old friend laughed ."
  attn-translate --checkpoint runs/toy/checkpoint.npz --beam 4 < sentences.txt > translations.txt
  attn-translate --checkpoint runs/toy/checkpoint.npz --attention att.png "he carries red girls ."
  attn-translate --checkpoint runs/toy/checkpoint.npz --draft runs/draft/checkpoint.npz --speculate 4 < in.txt
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
                   help="the checkpoint written by attn-train, e.g. --checkpoint runs/toy/checkpoint.npz, or "
                        "a run's folder, e.g. --checkpoint runs/toy: the model its test used (averaged.npz "
                        "where the average of the last snapshots was tested, else checkpoint.npz)")
    p.add_argument("--adapter", type=Path, metavar="PATH",
                   help="LoRA adapters written by attn-train --resume-from CHECKPOINT --lora RANK (OUT/adapter.npz), "
                        "merged into the checkpoint's weights; --checkpoint must be the one they were trained from")
    p.add_argument("--beam", type=int, default=1, metavar="K",
                   help="beam size: 1 (default) decodes greedily, the paper uses --beam 4")
    p.add_argument("--alpha", type=float, default=0.6, metavar="A",
                   help="length penalty of beam search, ((5+|Y|)/6)**A (default 0.6, the paper's), "
                        "e.g. --alpha 0 for none; ignored by greedy decoding")
    p.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                   help="never repeat an N-gram of subword pieces within one translation, e.g. "
                        "--no-repeat-ngram 3 against loops such as 'snow snow snow' (default 0: off)")
    p.add_argument("--attention", type=Path, metavar="PNG",
                   help="draw the last decoder layer's cross-attention (averaged over heads) of the first "
                        "sentence to this image, e.g. --attention att.png; with several sentences, one "
                        "file per sentence: att-1.png, att-2.png, ...")
    p.add_argument("--draft", type=Path, metavar="PATH",
                   help="a small translator trained on the same vocabulary, e.g. --draft runs/draft/checkpoint.npz: "
                        "speculative decoding, the draft proposing tokens that the model checks in one pass; "
                        "the translations are greedy decoding's, token for token; the acceptance rate goes to "
                        "standard error")
    p.add_argument("--speculate", type=int, default=None, metavar="K",
                   help="tokens the --draft proposes a round (default 4; 0: the model alone)")
    p.add_argument("--reference", action="store_true",
                   help="decode an int8 checkpoint with the readable model (attn.model), not the attn.fast engine "
                        "(its default for int8: each matrix dequantised as a layer reads it); a float32 "
                        "checkpoint decodes with the readable model either way")
    p.add_argument("--backend", choices=("numpy", "cupy", "auto"),
                   default=os.environ.get("ATTN_BACKEND", "numpy").strip().lower() or "numpy",
                   help="array backend: numpy (CPU), cupy (GPU), or auto (cupy where a GPU is usable); "
                        "default $ATTN_BACKEND or numpy, as for attn-train, e.g. --backend auto")
    p.add_argument("--batch-size", type=int, default=64, metavar="N",
                   help="sentences decoded together (default 64)")
    p.add_argument("--max-length", type=int, default=MAX_SOURCE_TOKENS, metavar="N",
                   help=f"the most tokens a sentence may have, its end mark included (default {MAX_SOURCE_TOKENS}, "
                        f"at most {MAX_SOURCE_TOKENS_LIMIT:,}, and never more than the model's max_len, the "
                        "longest it was trained on). Every line is cut at its sentence ends (. ! ?) and its "
                        "sentences translated one by one; a sentence over the limit is refused, and so is "
                        f"a line over {MAX_LINE_BYTES // 2**20} MiB. Memory and time grow with the square of "
                        "the length: on a two-core CPU the toy model took 0.8 s and 66 MB at 512 tokens, "
                        "3 s and 0.9 GB at 3,000 (benchmarks/RESULTS.md, Bounded input)")
    return p


def attention_paths(path: Path, n: int) -> list[Path]:
    """``att.png`` for one sentence; ``att-1.png``, ``att-2.png``, ... for several."""
    if n <= 1:
        return [path]
    return [_numbered(path, i) for i in range(1, n + 1)]


def _numbered(path: Path, i: int) -> Path:
    return path.with_name(f"{path.stem}-{i}{path.suffix or '.png'}")


def run_model(path: Path) -> Path:
    """``path``; or, for a run's folder (what ``attn-train --out`` writes), the model its test used:
    ``averaged.npz`` where its ``metrics.json`` says the average of the last snapshots was tested,
    else ``checkpoint.npz`` (the last model, and a run that has not been tested yet)."""
    if not path.is_dir():
        return path
    try:
        metrics = json.loads((path / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        metrics = {}
    count = metrics.get("averaged_checkpoints") if isinstance(metrics, dict) else None
    averaged = isinstance(count, int) and not isinstance(count, bool) and count > 1
    return path / ("averaged.npz" if averaged else "checkpoint.npz")


def load_translator(checkpoint, adapter=None):
    """Load (model, vocab) from a checkpoint written by ``attn-train`` onto the selected backend;
    with ``adapter`` (a file written by ``attn-train --lora``), its LoRA adapters merged into the
    weights (:mod:`attn.lora`).

    Raises CheckpointError if the file is missing or corrupt, holds more than its config implies,
    does not fit its config, holds NaN or infinite weights, or holds no vocabulary.
    """
    from .data import Vocab
    from .model import Transformer
    from .model_files import model_members
    from .quantize import int8_members, is_int8, load_int8
    arrays, meta = load_npz(checkpoint, expect=lambda m, s: (int8_members if is_int8(s) else model_members)(m, s))
    if not meta.get("vocab"):
        raise CheckpointError(f"checkpoint {checkpoint} holds no vocabulary (meta 'vocab'): "
                              "was it written by attn-train?")
    try:
        vocab = Vocab.from_json(meta["vocab"])
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {checkpoint} has an unreadable vocabulary ({e})") from None
    model = (load_int8 if is_int8(arrays) else Transformer.from_arrays)(arrays, meta, source=str(checkpoint))
    not_finite = next((k for k, a in model.params.items() if not bool(B.host.isfinite(B.to_host(a)).all())), None)
    if not_finite is not None:
        raise CheckpointError(f"checkpoint {checkpoint}: parameter {not_finite} holds NaN or infinite numbers "
                              "(a run that diverged, or a damaged file): translate with an earlier checkpoint")
    if len(vocab) != model.config.target_vocab_size:
        raise CheckpointError(f"checkpoint {checkpoint}: the vocabulary has {len(vocab)} tokens, "
                              f"the model {model.config.target_vocab_size}")
    if adapter is not None:
        from .lora import load_adapter
        model = load_adapter(adapter, model).merged()
    return model, vocab


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _fail(msg: str) -> int:
    print(f"attn-translate: error: {msg}", file=sys.stderr)
    return 2


def _check_attention_path(path: Path) -> str | None:
    """Why the figure cannot be written to ``path`` (a format matplotlib lacks, a folder that is
    missing or not writable), or None."""
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in formats:
        return (f"--attention {path}: {'.' + suffix if suffix else 'no extension'} is not an image format; "
                f"use one of {', '.join('.' + f for f in sorted(formats))}, e.g. --attention att.png")
    if path.is_dir():
        return f"--attention {path} is a folder; give a file name such as {path / 'att.png'}"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:      # the figure's folder is made if need be
        folder = folder.parent
    if not folder.is_dir():
        return f"--attention {path}: {folder} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"--attention {path}: cannot write into {folder} ({e.strerror})"
    return None


def _check_args(args) -> str | None:
    """The first flag that is out of range, in words, or None."""
    if args.backend not in ("numpy", "cupy", "auto"):          # argparse checks no default: $ATTN_BACKEND's
        return f"ATTN_BACKEND must be numpy, cupy or auto (or pass --backend), got {args.backend!r}"
    if not 1 <= args.beam <= MAX_BEAM:
        return f"--beam must be between 1 and {MAX_BEAM}, got {args.beam}"
    if not (math.isfinite(args.alpha) and 0 <= args.alpha <= MAX_ALPHA):
        return f"--alpha must be a number between 0 and {MAX_ALPHA:g}, got {args.alpha}"
    if args.no_repeat_ngram < 0:
        return f"--no-repeat-ngram must be 0 (off) or a positive n-gram length, got {args.no_repeat_ngram}"
    problem = _check_speculation(args)
    if problem:
        return problem
    if args.batch_size < 1:
        return f"--batch-size must be at least 1, got {args.batch_size}"
    if not 2 <= args.max_length <= MAX_SOURCE_TOKENS_LIMIT:
        return (f"--max-length must be between 2 (a token and the end mark) and {MAX_SOURCE_TOKENS_LIMIT:,}, "
                f"got {args.max_length}")
    for i, s in enumerate(args.sentences, start=1):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"sentence argument {i} is not valid UTF-8 (at character {e.start + 1})"
    return _check_attention_path(args.attention) if args.attention is not None else None


def _check_speculation(args) -> str | None:
    """What --draft and --speculate cannot go with, in words, or None."""
    if args.draft is None:
        return "--speculate needs a --draft checkpoint to propose tokens" if args.speculate is not None else None
    if args.speculate is not None and not 0 <= args.speculate <= MAX_SPECULATE:
        return f"--speculate must be between 0 and {MAX_SPECULATE}, got {args.speculate}"
    for flag, off in (("--beam", args.beam != 1), ("--no-repeat-ngram", args.no_repeat_ngram != 0),
                      ("--attention", args.attention is not None)):
        if off:
            return f"--draft decodes greedily, one sentence at a time, without {flag}: drop one of them"
    return None


def _load_draft(args, model, vocab):
    """The --draft translator, or None; a CheckpointError if its vocabulary is not --checkpoint's."""
    if args.draft is None:
        return None
    from .speculative import check_pair
    draft, draft_vocab = load_translator(run_model(args.draft))
    if draft_vocab != vocab:
        raise CheckpointError(f"--draft {args.draft}: its vocabulary differs from --checkpoint's: a draft must "
                              "be trained on the same vocabulary")
    try:
        check_pair(model, draft)
    except ValueError as e:
        raise CheckpointError(f"--draft {args.draft}: {e}") from None
    return draft


def _decode_line(raw: bytes, number: int) -> str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"standard input line {number} is not valid UTF-8 (byte {raw[e.start]:#04x} "
                         f"at position {e.start + 1}); convert it, e.g. with iconv -t UTF-8") from None
    return (line.lstrip("\ufeff") if number == 1 else line).rstrip("\r\n")


def read_stdin_lines(stream) -> Iterator[str]:
    """The lines of a binary stream as text, one at a time as they are read, each decoded as UTF-8
    (a byte-order mark at the start is dropped); raises ValueError naming the first line that is
    not UTF-8."""
    for number, raw in enumerate(stream, start=1):
        yield _decode_line(raw, number)


def _waiting(fd: int) -> bool:
    """Whether input is waiting on ``fd`` now (True where that cannot be told)."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return True


class LineTooLong(ValueError):
    """A line of standard input is longer than :data:`MAX_LINE_BYTES`; the message names it."""


def _too_long(number: int) -> LineTooLong:
    return LineTooLong(f"standard input line {number:,} is longer than {MAX_LINE_BYTES // 2**20} MiB: put each "
                       f"sentence (or each paragraph) on a line of its own; a sentence may have at most "
                       f"--max-length tokens")


def _fd_lines(fd: int, block: int = 1 << 16) -> Iterator[tuple[bytes, bool]]:
    """The lines of file descriptor ``fd`` as they are read, each with whether more input is
    already waiting (False: the next read would wait for the writer). A line that grows past
    :data:`MAX_LINE_BYTES` is a :class:`LineTooLong` as soon as it does, before more is read."""
    partial: list[bytes] = []
    held, number = 0, 1                       # bytes of the unfinished line; its number
    while True:
        data = os.read(fd, block)
        if not data:
            if partial:
                yield b"".join(partial), False
            return
        lines = data.split(b"\n")
        partial.append(lines.pop())
        held += len(lines[0]) if lines else len(data)        # the unfinished line, as far as it is read
        if held > MAX_LINE_BYTES:
            raise _too_long(number)
        if not lines:
            continue
        number, held = number + len(lines), len(partial[-1])
        lines[0] = b"".join(partial[:-1]) + lines[0]
        partial = partial[-1:] if partial[-1] else []
        for k, line in enumerate(lines, start=1):
            yield line, k < len(lines) or _waiting(fd)


def stdin_batches(stream, size: int) -> Iterator[tuple[int, list[str]]]:
    """The lines of a binary stream as text (see :func:`read_stdin_lines`), read lazily and handed
    out ``size`` at a time as (number of the first line, lines). A batch ends early when no more
    input is waiting, so that a line piped in is translated at once, not when ``size`` more come."""
    try:
        raw = _fd_lines(stream.fileno())
    except (AttributeError, OSError, ValueError):         # not a file (io.UnsupportedOperation is both)
        raw = ((line, True) for line in stream)
    batch: list[str] = []
    number = 0
    for number, (line, more) in enumerate(raw, start=1):
        if len(line) > MAX_LINE_BYTES:                   # a stream without a file descriptor, read whole
            raise _too_long(number)
        batch.append(_decode_line(line, number))
        if len(batch) >= size or not more:
            yield number - len(batch) + 1, batch
            batch = []
    if batch:
        yield number - len(batch) + 1, batch


class _Figures:
    """Draws each translation's cross-attention as it comes: to ``att.png`` when there is one
    sentence in all, to ``att-1.png``, ``att-2.png``, ... when there are several (the first is kept
    until the second comes or the input ends)."""

    def __init__(self, path: Path | None):
        self.path, self.count, self.first = path, 0, None

    def add(self, results) -> None:
        if self.path is None:
            return
        for r in results:
            self.count += 1
            if self.count == 1:
                self.first = r
                continue
            if self.first is not None:
                self._draw(self.first, _numbered(self.path, 1))
                self.first = None
            self._draw(r, _numbered(self.path, self.count))

    def close(self) -> None:
        if self.first is not None:
            self._draw(self.first, self.path)
            self.first = None

    @staticmethod
    def _draw(r, path: Path) -> None:
        """Raises ValueError when the figure cannot be written."""
        from .plot import plot_attention
        if r.attention is None or not r.attention.size:
            why = ("it is empty" if not r.src_tokens else "its translation is empty" if r.attention is not None
                   else "it was cut into sentences translated one by one")
            print(f"attn-translate: no attention figure {path}: {why}", file=sys.stderr)
            return
        try:
            plot_attention(r.attention, r.src_tokens, r.tgt_tokens, path,
                           title=_short(" ".join(r.src_tokens)) + "\n→ " + _short(r.text))
        except OSError as e:
            raise ValueError(f"cannot write the attention figure {path}: {e}") from None
        print(f"attn-translate: attention written to {path}", file=sys.stderr)


def _translate_stream(args, model, vocab, batches, figures, draft=None) -> int:
    """Translate each batch of lines, write and flush its translations, draw its figures; 0, or
    the exit code of the problem that stopped it (said in one line). With a ``draft``,
    speculative decoding, its acceptance rate said on standard error at the end."""
    from .decode import Decoding
    from .evaluate import InputTooLong, translate
    from .speculative import Speculative
    if draft is not None:
        decoding = Speculative(draft, DEFAULT_SPECULATE if args.speculate is None else args.speculate)
    else:
        decoding = Decoding(beam_size=args.beam, alpha=args.alpha, no_repeat_ngram=args.no_repeat_ngram,
                            with_attention=args.attention is not None)       # once, for every batch
    written, lines = 0, []
    try:
        for first, lines in batches:
            results = translate(model, vocab, lines, decoding, batch_size=args.batch_size,
                                max_source_tokens=args.max_length, first_line=first)
            sys.stdout.write("".join(r.text + "\n" for r in results))
            sys.stdout.flush()
            written += len(results)
            figures.add(results)
        figures.close()
        if draft is not None:
            print(f"attn-translate: {decoding.acceptance.line(decoding.k)}", file=sys.stderr)
    except InputTooLong as e:
        return _fail(str(e).replace("max_source_tokens, attn-translate --max-length", "--max-length"))
    except ValueError as e:
        return _fail(str(e))
    except MemoryError:
        return _fail(f"out of memory translating {len(lines)} lines: lower --batch-size "
                     f"({args.batch_size}), --max-length ({args.max_length}) or --beam ({args.beam})")
    except KeyboardInterrupt:
        print(f"attn-translate: interrupted; the translations of the first {written:,} lines were written",
              file=sys.stderr)
        return 130
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    try:
        B.set_backend(args.backend)
        notice = B.auto_fallback_notice()          # auto with CuPy installed but unusable: one line
        if notice:
            print(f"attn-translate: {notice}", file=sys.stderr)
        model, vocab = load_translator(run_model(args.checkpoint), args.adapter)
        draft = _load_draft(args, model, vocab)
        model, draft = (None if m is None else for_inference(m, "reference" if args.reference else None)
                        for m in (model, draft))
    except (CheckpointError, B.BackendError) as e:
        return _fail(str(e))
    batches = iter([(1, args.sentences)]) if args.sentences else stdin_batches(sys.stdin.buffer, args.batch_size)
    return _translate_stream(args, model, vocab, batches, _Figures(args.attention), draft)


if __name__ == "__main__":
    sys.exit(main())
