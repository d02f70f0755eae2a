"""How much of an epoch's batches is padding, for a corpus and recipe given as ``attn-train`` flags.

    python benchmarks/padding.py --data multi30k --src de --tgt en --preset small [--max-tokens 4096]

Builds the vocabulary and the first epoch's batches exactly as ``attn-train`` would (same
recipe, same seed) and prints, per side, the real tokens, the padded positions and their ratio
(the source counts its EOS, the target its BOS/EOS position, as :class:`attn.data.Batch` does).
Padding costs what real tokens cost in every layer of the step; on the target side it also
costs the output projection and the loss.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn.data import encode_pairs, make_batches  # noqa: E402
from attn.training.config import config_from_argv  # noqa: E402
from attn.training.prepare import build_vocab, load_corpus, longest_pair  # noqa: E402


def main(argv=None) -> int:
    config = config_from_argv(argv).with_recipe()
    corpus = load_corpus(config)
    vocab = build_vocab(corpus.train, config.min_freq, config.vocab, config.vocab_size)
    max_len = longest_pair(config, config.model_config(len(vocab)))
    batches = make_batches(encode_pairs(corpus.train, vocab, max_len=max_len), config.max_tokens,
                           shuffle=True, seed=config.seed)
    for side, real, padded in (("source", sum(b.n_src_tokens for b in batches), sum(b.src.size for b in batches)),
                               ("target", sum(b.n_tgt_tokens for b in batches),
                                sum(b.tgt_out.size for b in batches))):
        print(f"{side}: {real:,} real tokens in {padded:,} positions ({1 - real / padded:.1%} padding), "
              f"{len(batches)} batches of at most {config.max_tokens:,} tokens, vocabulary {len(vocab):,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
