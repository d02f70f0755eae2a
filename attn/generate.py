"""The ``attn-generate`` command: continue a text with a language model that ``attn-train --task lm``
trained (a decoder-only stack of the block: :mod:`attn.model`).

    attn-generate --checkpoint runs/lm/checkpoint.npz --prompt "ROMEO:" --temperature 0.8 --top-k 40

The prompt and its continuation go to standard output. Sampling (:mod:`attn.sample`) feeds each
token back through the layers' key/value cache; ``--seed`` reproduces a text. Problems the user
can fix (no checkpoint, a translator's checkpoint, a flag out of range, a prompt the vocabulary
cannot spell) end with exit code 2 and a one-line message naming the flag.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import backend as B
from . import speculative
from .checkpoint import CheckpointError, load_npz
from .data import BOS, EOS, PAD, UNK, DataError, Vocab, decode_text, encode_text
from .model import Transformer
from .sample import Sampler, generate

#: The most tokens one call may generate.
MAX_TOKENS = 100_000
#: Tokens a --draft proposes a round unless --speculate says, and the most it may.
DEFAULT_SPECULATE, MAX_SPECULATE = 4, 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attn-generate",
        description="Continue a text with a language model trained by attn-train --task lm.",
        epilog="example:\n  attn-generate --checkpoint runs/lm/checkpoint.npz --prompt 'ROMEO:' --top-k 40",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, metavar="PATH",
                   help="the checkpoint attn-train --task lm wrote, e.g. runs/lm/checkpoint.npz")
    p.add_argument("--prompt", default="\n", metavar="TEXT", help="the text to continue (default: a line end)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="divides the logits: below 1 sharper, above 1 flatter, 0 greedy (default 1)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="draw from the K likeliest tokens alone")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="draw from the smallest set of likeliest tokens whose probability reaches P (0 < P <= 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws: the same seed, the same text (default 0)")
    p.add_argument("--max-tokens", type=int, default=200, metavar="N", help="tokens to generate (default 200)")
    p.add_argument("--stop", default=None, metavar="TEXT", help="end the text where TEXT first appears in it")
    p.add_argument("--draft", type=Path, default=None, metavar="PATH",
                   help="a small language model trained on the same vocabulary: speculative decoding, the draft "
                        "proposing tokens that the model checks in one pass; the text is drawn from the model's "
                        "own distribution (with --temperature 0 its very tokens); the acceptance rate goes to "
                        "standard error")
    p.add_argument("--speculate", type=int, default=None, metavar="K",
                   help=f"tokens the --draft proposes a round (default {DEFAULT_SPECULATE}; 0: the model alone)")
    p.add_argument("--backend", choices=["numpy", "cupy", "auto"], default=None,
                   help="array backend (default: $ATTN_BACKEND or numpy)")
    return p


def check_flags(args) -> Sampler:
    """The sampler the flags ask for, or a ValueError naming the flag out of range."""
    try:
        sampler = Sampler(args.temperature, args.top_k, args.top_p).check()
    except ValueError as e:
        raise ValueError(f"--{str(e).split()[0].replace('_', '-')}: {e}") from None
    if not 1 <= args.max_tokens <= MAX_TOKENS:
        raise ValueError(f"--max-tokens must be between 1 and {MAX_TOKENS:,}, got {args.max_tokens}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if not args.prompt:
        raise ValueError("--prompt must hold at least one character")
    if args.stop == "":
        raise ValueError("--stop must hold at least one character")
    if args.draft is None and args.speculate is not None:
        raise ValueError("--speculate needs a --draft checkpoint to propose tokens")
    if args.speculate is not None and not 0 <= args.speculate <= MAX_SPECULATE:
        raise ValueError(f"--speculate must be between 0 and {MAX_SPECULATE}, got {args.speculate}")
    return sampler


def load_language_model(path: Path, flag: str = "--checkpoint"):
    """(model, vocab, char, context) from a checkpoint of ``attn-train --task lm``; a CheckpointError
    naming the file (and its ``flag``) if it is missing, damaged or a translator's."""
    from .model_files import model_members
    if not path.is_file():
        raise CheckpointError(f"{flag} {path}: no such file")
    try:
        arrays, meta = load_npz(path, expect=model_members)
        model = Transformer.from_arrays(arrays, meta, source=str(path))
        vocab = Vocab.from_json(meta["vocab"])
    except (KeyError, DataError) as e:
        raise CheckpointError(f"{flag} {path}: holds no vocabulary ({e})") from None
    if model.block.cross_attention is not None:
        raise CheckpointError(f"{flag} {path} holds a translator (an encoder-decoder): translate with "
                              "attn-translate, or train a language model with attn-train --task lm")
    args = meta.get("args", {}) if isinstance(meta.get("args"), dict) else {}
    return model, vocab, bool(args.get("char")), args.get("context") or model.config.max_len


def run(args) -> str:
    """The prompt and its continuation, as the parsed flags ``args`` ask."""
    sampler = check_flags(args)
    B.set_backend(args.backend or os.environ.get("ATTN_BACKEND", "numpy"))
    model, vocab, char, context = load_language_model(args.checkpoint)
    prompt = encode_text(args.prompt, vocab, char)
    if char and UNK in prompt:
        unknown = sorted({c for c in args.prompt if c not in vocab})
        raise ValueError(f"--prompt: the model's vocabulary has no {', '.join(map(repr, unknown))}")
    if not char and prompt[-1:] == [EOS] and not args.prompt.endswith("\n"):
        prompt = prompt[:-1]                            # the prompt's last line goes on
    stop = None if args.stop is None else (lambda ids: args.stop in decode_text(ids, vocab, char))
    banned = [PAD, BOS, UNK] + ([EOS] if char else [])
    if args.draft is None:
        ids = generate(model, prompt or [EOS], args.max_tokens, sampler, args.seed, stop, banned, window=context)
    else:
        ids = _speculate(args, model, vocab, char, (prompt or [EOS], sampler, stop, banned, context))
    text = decode_text(ids, vocab, char)
    if args.stop is not None and args.stop in text:
        text = text[:text.index(args.stop) + len(args.stop)]
    return args.prompt + text


def _speculate(args, model, vocab, char, how) -> list:
    """The ids that ``--draft`` and the model draw together (``how``: the prompt's ids, the
    sampler, the stop test, the banned ids, the window), the acceptance rate said on stderr."""
    draft, draft_vocab, draft_char, _ = load_language_model(args.draft, "--draft")
    if draft_vocab != vocab or draft_char != char:
        raise CheckpointError(f"--draft {args.draft}: its vocabulary differs from --checkpoint's: a draft must "
                              "be trained on the same vocabulary")
    try:
        speculative.check_pair(model, draft)
    except ValueError as e:
        raise CheckpointError(f"--draft {args.draft}: {e}") from None
    prompt, sampler, stop, banned, window = how
    k = DEFAULT_SPECULATE if args.speculate is None else args.speculate
    ids, acceptance = speculative.generate(model, draft, prompt, args.max_tokens, k, sampler, args.seed, stop,
                                           banned, window=window)
    print(f"attn-generate: {acceptance.line(k)}", file=sys.stderr)
    return ids


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        text = run(args)
    except (ValueError, CheckpointError, B.BackendError) as e:
        print(f"attn-generate: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
