"""Translating text with a trained model, and corpus BLEU (section 6.1) with sacrebleu.

    text ─ vocab.tokenize (words or BPE pieces) ─ vocab ids (UNK for unknown words)
         ─ batches sorted by length ─ greedy_decode / beam_search ─ vocab tokens
         ─ detokenize ─ text

The way back to text loses nothing: tokens carry their spacing (``##`` marks a token
glued to the one before, see :mod:`attn.text`), so ``3.5``, ``1,000``, ``students'``
and „quotes“ come out as written, and a perfect translation of a reference scores
exactly 100. BLEU and chrF are computed by sacrebleu on that text against the raw
reference lines (its own ``13a`` tokenisation, as the WMT tools do), so the numbers
compare with published scores of the same test set; :func:`corpus_scores` also
returns sacrebleu's signatures, which say exactly how they were computed.
"""
from __future__ import annotations

import logging

from typing import NamedTuple

from . import backend as B
from .data import EOS, PAD, detokenize
from .decode import beam_search, greedy_decode


class Translation(NamedTuple):
    """One translated sentence.

    text : the detokenised translation
    src_tokens : the source tokens, one per source position the model saw
        (unknown words as written, the appended end-of-sentence mark included)
    tgt_tokens : the output tokens (no BOS or EOS)
    score : the search's score (greedy: log-probability; beam: length-penalised)
    attention : (len(tgt_tokens), len(src_tokens)) host array or None, the last
        decoder layer's cross-attention averaged over heads
    """
    text: str
    src_tokens: list
    tgt_tokens: list
    score: float
    attention: object = None


class Scores(NamedTuple):
    """Corpus scores of one set of translations (sacrebleu), each 0-100.

    bleu : BLEU, cased (sacrebleu's default: ``13a`` tokenisation, exponential smoothing)
    bleu_lc : the same BLEU on lower-cased text
    chrf : chrF (character 6-grams, beta 2)
    signatures : {"bleu": ..., "bleu_lc": ..., "chrf": ...}, sacrebleu's record of
        how each was computed, e.g. ``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0``
    """
    bleu: float
    bleu_lc: float
    chrf: float
    signatures: dict


def corpus_scores(hypotheses: list[str], references: list[str]) -> Scores:
    """BLEU, lower-cased BLEU and chrF of hypotheses against one reference each (sacrebleu).

    Give the references as they are (the raw lines of the corpus): sacrebleu
    tokenises both sides itself. Empty lists score 0.
    """
    from sacrebleu.metrics import BLEU, CHRF
    if len(hypotheses) != len(references):
        raise ValueError(f"corpus_scores: {len(hypotheses)} hypotheses but {len(references)} references")
    hyps, refs = [str(h) for h in hypotheses], [[str(r) for r in references]]
    metrics = {"bleu": BLEU(), "bleu_lc": BLEU(lowercase=True), "chrf": CHRF()}
    # sacrebleu warns when references look tokenised ("word ." as in the toy corpus); its 13a
    # tokeniser splits the hypotheses' punctuation the same way, so the score is unaffected.
    log = logging.getLogger("sacrebleu")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        if not hyps:
            return Scores(0.0, 0.0, 0.0, {})
        values = {name: float(m.corpus_score(hyps, refs).score) for name, m in metrics.items()}
    finally:
        log.setLevel(level)
    return Scores(values["bleu"], values["bleu_lc"], values["chrf"],
                  {name: str(m.get_signature()) for name, m in metrics.items()})


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (0-100) of detokenised hypotheses against one reference each (sacrebleu)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"corpus_bleu: {len(hypotheses)} hypotheses but {len(references)} references")
    return corpus_scores(hypotheses, references).bleu


def _eos_token(vocab) -> str:
    itos = vocab.itos
    return str(itos[EOS]) if len(itos) > EOS else "</s>"


def source_ids(vocab, tokens) -> list[int]:
    """The ids the encoder sees for a tokenised source sentence: the vocabulary's
    ids (UNK for unknown words) and the end-of-sentence id, as in training."""
    return list(vocab.encode(list(tokens))) + [EOS]


def translate(model, vocab, sentences, beam_size: int = 1, alpha: float = 0.6, batch_size: int = 64,
              max_len=None, use_cache: bool = True, with_attention: bool = False) -> list[Translation]:
    """Translate sentences (str, or lists of tokens) in batches; see :func:`translate_sentences`.

    Returns one :class:`Translation` per sentence, in the input order.
    """
    if batch_size < 1:
        raise ValueError(f"translate: batch_size must be positive, got {batch_size}")
    np, xp = B.host, model.xp
    toks = [vocab.tokenize(s) if isinstance(s, str) else list(s) for s in sentences]
    ids = [source_ids(vocab, t) for t in toks]
    limit = model.config.max_len if model.config.positional == "learned" else None
    if limit is not None:                 # a learned table has no row past max_len
        ids = [x[:limit] for x in ids]
    eos = _eos_token(vocab)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))     # similar lengths share a batch
    out: list = [None] * len(ids)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        S = max(1, max(len(ids[i]) for i in batch))
        src = np.full((len(batch), S), PAD, dtype=np.int64)
        for r, i in enumerate(batch):
            src[r, :len(ids[i])] = ids[i]
        src = xp.asarray(src)
        if beam_size == 1:
            res = greedy_decode(model, src, max_len=max_len, use_cache=use_cache, with_attention=with_attention)
        else:
            res = beam_search(model, src, beam_size=beam_size, alpha=alpha, max_len=max_len,
                              use_cache=use_cache, with_attention=with_attention)
        for r, i in enumerate(batch):
            tgt = list(vocab.decode(res.tokens[r]))
            src_labels = (toks[i] + [eos])[:len(ids[i])]
            att = res.cross_attention[r] if with_attention else None
            out[i] = Translation(detokenize(tgt), src_labels, tgt, res.scores[r], att)
    return out


def translate_sentences(model, vocab, sentences: list[str], beam_size: int = 1, batch_size: int = 64,
                        alpha: float = 0.6, max_len=None, use_cache: bool = True) -> list[str]:
    """Translate text: tokenise (``vocab.tokenize``), map to ids (UNK for unknown words),
    decode in batches of sentences of similar length (greedy for ``beam_size`` 1, beam
    search otherwise), detokenise. Returns the translations in the input order."""
    return [t.text for t in translate(model, vocab, sentences, beam_size, alpha, batch_size,
                                      max_len, use_cache)]


def evaluate_translations(model, vocab, pairs, beam_size: int = 1, alpha: float = 0.6,
                          batch_size: int = 64) -> tuple[Scores, list[str]]:
    """Translate the source side of ``pairs`` and score it against the target side.

    pairs : list of (source, reference); each side a str (the raw line: it is scored
        as it is) or a list of tokens (a token list is detokenised to give the reference text).
    Returns: (:class:`Scores`, the hypotheses as text).
    """
    srcs = [p[0] for p in pairs]
    refs = [p[1] if isinstance(p[1], str) else detokenize(list(p[1])) for p in pairs]
    hyps = translate_sentences(model, vocab, srcs, beam_size=beam_size, batch_size=batch_size, alpha=alpha)
    return corpus_scores(hyps, refs), hyps


def evaluate_bleu(model, vocab, pairs, beam_size: int = 1, alpha: float = 0.6,
                  batch_size: int = 64) -> tuple[float, list[str]]:
    """:func:`evaluate_translations`, BLEU only: (corpus BLEU, the hypotheses as text)."""
    scores, hyps = evaluate_translations(model, vocab, pairs, beam_size, alpha, batch_size)
    return scores.bleu, hyps
