"""Speculative decoding against plain decoding: tokens per second and acceptance rate, k = 1..8.

    python benchmarks/speculative.py --target runs/toy/checkpoint.npz --draft runs/toy-draft/checkpoint.npz \
        --sources data/toy/test.en --sentences 60 --figure benchmarks/speculative/toy.png
    python benchmarks/speculative.py --lm --target runs/lm/checkpoint.npz --draft runs/lm-draft/checkpoint.npz \
        --prompts 6 --tokens 150 --figure benchmarks/speculative/lm.png

Both models run on ``--engine`` (``readable``, attn-translate's and attn-generate's, the default;
or ``fast``, :mod:`attn.fast`, over the same parameters). A translator decodes the first
``--sentences`` lines of ``--sources``: plain greedy decoding one sentence at a time (what
speculative decoding does: its rounds' lengths differ from row to row) and as one batch, beam
search of ``--beam`` (default 4, the paper's and attn-translate's ``--beam 4``; its default,
``--beam 1``, is greedy) one sentence at a time and as one batch, then speculative decoding for
each k, whose translations must be
the plain ones (counted: a float32 model may break a near tie another way when it reads k + 1
positions in one pass). A language model (``--lm``) continues
``--prompts`` lines of its own text (the first 40 characters of lines spread over its validation
text, as ``attn-train --task lm`` held it out: the last tenth) by ``--tokens`` characters at
``--temperature`` (0: greedy, its texts counted where equal to plain sampling's). k = 0 is the target alone in
the same loop (the prompt read in one pass, then a token a pass): the speed that k > 0 is
measured against. Each setting is timed
``--repeats`` times, the best kept; one JSON object a setting on stdout, and a figure of tokens
per second against k with plain decoding's as lines.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn import backend as B  # noqa: E402
from attn import engine as engines  # noqa: E402
from attn import speculative as S  # noqa: E402
from attn.data import BOS, EOS, PAD, UNK  # noqa: E402
from attn.decode import beam_search, greedy_decode  # noqa: E402
from attn.evaluate import source_ids  # noqa: E402
from attn.generate import load_language_model  # noqa: E402
from attn.sample import Sampler, generate  # noqa: E402
from attn.translate import load_translator  # noqa: E402


def best_of(repeats: int, run):
    """(the result of ``run()``, the least seconds of ``repeats`` calls)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return out, min(times)


def padded(rows: list) -> "B.host.ndarray":
    np = B.host
    out = np.full((len(rows), max(map(len, rows))), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _name(k: int) -> str:
    return "speculative" if k else "the target alone (k=0: the same loop, no draft)"


#: ``--engine``'s names: the engines as :func:`attn.engine.get` knows them.
ENGINES = {"readable": "reference", "fast": "fast"}


def on_engine(model, name: str):
    """``model`` (a readable one, as the loaders give it) on the engine ``--engine`` names, over the
    same parameters."""
    return engines.get(ENGINES[name]).model(model.config, dtype=model.dtype, params=model.params)


def beams(args, target, src, alone, plain) -> list[dict]:
    """Beam search of ``--beam`` one sentence at a time and as one batch: rows as greedy's, its
    tokens its own (``identical``: sentences equal to greedy's)."""
    rows = []
    one = lambda: [beam_search(target, row, args.beam, args.alpha).tokens[0] for row in alone]  # noqa: E731
    batch = lambda: beam_search(target, B.to_device(src), args.beam, args.alpha).tokens      # noqa: E731
    for name, run in (("one sentence at a time", one), (f"one batch of {len(src)}", batch)):
        out, t = best_of(args.repeats, run)
        n = sum(len(x) + 1 for x in out)
        rows.append({"name": f"beam {args.beam}, {name}", "k": 0, "seconds": t, "tokens": n,
                     "tokens_per_second": n / t, "identical": sum(a == b for a, b in zip(out, plain))})
    return rows


def translator(args) -> list[dict]:
    target, vocab = load_translator(args.target)
    draft, draft_vocab = load_translator(args.draft)
    target, draft = on_engine(target, args.engine), on_engine(draft, args.engine)
    assert draft_vocab == vocab, "--draft: another vocabulary"
    lines = args.sources.read_text(encoding="utf-8").splitlines()[:args.sentences]
    src = padded([source_ids(vocab, vocab.tokenize(line)) for line in lines])
    alone = [B.to_device(row[row != PAD][None, :]) for row in src]         # each sentence without padding
    one = lambda: [greedy_decode(target, row).tokens[0] for row in alone]  # noqa: E731
    plain, t_one = best_of(args.repeats, one)
    tokens = sum(len(t) + 1 for t in plain)              # EOS included (a sentence at its limit has none)
    batched, t_batch = best_of(args.repeats, lambda: greedy_decode(target, B.to_device(src)).tokens)
    rows = [{"name": "greedy, one sentence at a time", "k": 0, "seconds": t_one, "tokens": tokens,
             "tokens_per_second": tokens / t_one},
            {"name": f"greedy, one batch of {len(src)}", "k": 0, "seconds": t_batch, "tokens": tokens,
             "tokens_per_second": tokens / t_batch, "same": batched == plain}]
    if args.beam > 1:
        rows += beams(args, target, src, alone, plain)
    for k in args.k:
        (result, acc), t = best_of(args.repeats, lambda: S.translate(target, draft, src, k))
        n = sum(len(t) + 1 for t in result.tokens)
        rows.append({"name": _name(k), "k": k, "seconds": t, "tokens": n, "tokens_per_second": n / t,
                     "acceptance": acc.rate, "tokens_per_pass": acc.tokens / acc.rounds,
                     "identical": sum(a == b for a, b in zip(result.tokens, plain))})
    return rows


def language_model(args) -> list[dict]:
    from attn.data import encode_text, read_text
    from attn.training.lm import VAL_FRACTION
    target, vocab, char, context = load_language_model(args.target)
    draft, draft_vocab, _, _ = load_language_model(args.draft, "--draft")
    target, draft = on_engine(target, args.engine), on_engine(draft, args.engine)
    assert draft_vocab == vocab, "--draft: another vocabulary"
    text = read_text(args.text)
    val = text[int((1 - VAL_FRACTION) * len(text)):]
    starts = [val.index("\n", i * len(val) // args.prompts) + 1 for i in range(args.prompts)]
    prompts = [encode_text(val[s:s + 40], vocab, char) for s in starts]
    banned = [PAD, BOS, UNK] + ([EOS] if char else [])
    sampler = Sampler(args.temperature)
    plain_run = lambda: [generate(target, p, args.tokens, sampler, i, None, banned, context)  # noqa: E731
                         for i, p in enumerate(prompts)]
    plain, t_plain = best_of(args.repeats, plain_run)
    tokens = sum(map(len, plain))
    rows = [{"name": "attn.sample.generate (the prompt read a token a pass)", "k": 0, "seconds": t_plain,
             "tokens": tokens, "tokens_per_second": tokens / t_plain, "temperature": args.temperature}]
    for k in args.k:
        def run():
            acc, texts = S.Acceptance(), []
            for i, p in enumerate(prompts):
                ids, a = S.generate(target, draft, p, args.tokens, k, sampler, i, None, banned, context)
                texts.append(ids)
                acc.add(a)
            return texts, acc
        (texts, acc), t = best_of(args.repeats, run)
        n = sum(map(len, texts))
        rows.append({"name": _name(k), "k": k, "seconds": t, "tokens": n, "tokens_per_second": n / t,
                     "acceptance": acc.rate, "tokens_per_pass": acc.tokens / acc.rounds,
                     "temperature": args.temperature, "identical": sum(a == b for a, b in zip(texts, plain))})
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, each setting's speed over plain decoding's one at a time."""
    base = next(r for r in rows if r["k"] == 0 and "acceptance" in r)["tokens_per_second"]
    lines = ["| decoding | k | tokens | seconds (best) | tokens/s | x the target alone | acceptance | tokens per pass "
             "| outputs identical to plain |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        acc = f"{100 * r['acceptance']:.1f} %" if "acceptance" in r else "-"
        per = f"{r['tokens_per_pass']:.2f}" if "tokens_per_pass" in r else "-"
        lines.append(f"| {r['name']} | {r['k'] if 'acceptance' in r else '-'} | {r['tokens']:,} | {r['seconds']:.2f} | "
                     f"{r['tokens_per_second']:.1f} | {r['tokens_per_second'] / base:.2f} | {acc} | {per} | "
                     f"{r.get('identical', '-')} |")
    return "\n".join(lines)


def figure(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    spec = [r for r in rows if r["name"] == "speculative"]
    rows = [r for r in rows if r["k"] == 0]
    ax.plot([r["k"] for r in spec], [r["tokens_per_second"] for r in spec], "o-", label="speculative")
    for r, style in zip(rows, ("--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 3)))):
        ax.axhline(r["tokens_per_second"], linestyle=style, color="grey", label=r["name"])
    for r in spec:
        ax.annotate(f"{100 * r['acceptance']:.0f} %", (r["k"], r["tokens_per_second"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xticks([r["k"] for r in spec])
    ax.set(xlabel="k, draft tokens a round (labels: acceptance rate)", ylabel="tokens per second", title=title)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight",
                metadata={"Description": f"{title}: tokens per second of speculative decoding against k, "
                                         "with plain decoding's as horizontal lines"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--lm", action="store_true", help="language models (attn-train --task lm), not translators")
    p.add_argument("--engine", choices=sorted(ENGINES), default="readable",
                   help="the engine both models run on (default readable, attn-translate's)")
    p.add_argument("--beam", type=int, default=4,
                   help="a translator's beam search rows (default 4, the paper's; 1: none)")
    p.add_argument("--alpha", type=float, default=0.6, help="their length penalty (default 0.6, the paper's)")
    p.add_argument("--sources", type=Path, default=Path("data/toy/test.en"))
    p.add_argument("--sentences", type=int, default=60)
    p.add_argument("--text", type=Path, default=Path("data/tinyshakespeare/input.txt.gz"))
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=150)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=list(range(9)),
                   help="draft tokens a round, e.g. 0,1,2,4 (default 0..8; 0: the target alone)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--figure", type=Path)
    p.add_argument("--markdown", action="store_true", help="a table, after the JSON lines")
    args = p.parse_args(argv)
    B.set_backend("numpy")
    print(f"load average (1/5/15 min) at the start: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stderr)
    rows = language_model(args) if args.lm else translator(args)
    print(f"load average (1/5/15 min) at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stderr)
    for r in rows:
        print(json.dumps({key: round(v, 4) if isinstance(v, float) else v for key, v in r.items()}), flush=True)
    if args.markdown:
        print(table(rows))
    if args.figure:
        figure(rows, args.figure, f"{'language model' if args.lm else 'translator'}, {args.engine} engine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
