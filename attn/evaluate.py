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
import re
import sys
from typing import NamedTuple

from . import backend as B
from . import block
from .data import EOS, PAD, detokenize
from .decode import Decoding

#: The most tokens one source sentence may have (the end-of-sentence mark included) by default.
#: Attention's memory and time grow with the square of the length: on the CPU the toy model
#: translates a sentence of this length in about a second and a few hundred MB (benchmarks/RESULTS.md,
#: "Bounded input"), where 10,000 words need over 9 GB. A model is never asked for more positions
#: than it was trained on either (its ``max_len``): input is cut at its sentence ends
#: (:func:`split_sentences`), and a single sentence over the limit is an :class:`InputTooLong`.
MAX_SOURCE_TOKENS = 512
#: The largest limit a user may set (``--max-length``): attention over this many positions already
#: takes gigabytes.
MAX_SOURCE_TOKENS_LIMIT = 4096
#: The largest beam (``--beam``): a beam search keeps K hypotheses of every sentence, each a row of every step.
MAX_BEAM = 256
#: The largest length penalty exponent (``--alpha``; the paper's is 0.6, GNMT's best at most 1.4): far
#: above it ((5+|Y|)/6)**alpha overflows a float for long translations.
MAX_ALPHA = 10.0
#: What ends a sentence (when a space follows), for cutting text into the sentences the model was trained on.
_SENTENCE_END = re.compile(r"(?<=[.!?…。！？])\s+")


class InputTooLong(ValueError):
    """A source sentence is longer than the translation's limit; the message names the line, the
    sentence within it, its length and the limit."""


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


class _Lines:
    """A stream that writes each of a progress bar's redraws as a line of its own (tqdm redraws in
    place with a carriage return, which a file or a CI log would keep as one ever longer line)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar_options() -> dict:
    """tqdm's options for a bar on standard error: redrawn in place on a terminal; else (a file, a
    pipe, a CI log) a line of its own at most every 30 seconds."""
    if sys.stderr.isatty():
        return {"file": sys.stderr, "dynamic_ncols": True}
    return {"file": _Lines(sys.stderr), "mininterval": 30.0, "ncols": 100}


def _eos_token(vocab) -> str:
    itos = vocab.itos
    return str(itos[EOS]) if len(itos) > EOS else "</s>"


def source_ids(vocab, tokens) -> list[int]:
    """The ids the encoder sees for a tokenised source sentence: the vocabulary's
    ids (UNK for unknown words) and the end-of-sentence id, as in training."""
    return list(vocab.encode(list(tokens))) + [EOS]


def split_sentences(text: str) -> list[str]:
    """``text`` cut after each sentence end (``.``, ``!``, ``?``, ...) that a space follows."""
    return [part for part in _SENTENCE_END.split(text.strip()) if part]


def _pieces(vocab, line, limit: int | None, number: int) -> list[list]:
    """The token lists one input is translated as: a text's sentences (cut after each sentence end,
    whatever its length), or a list of tokens whole, each at most ``limit`` tokens with its end
    mark; None: the whole input, without a limit."""
    if limit is None:
        return [vocab.tokenize(line) if isinstance(line, str) else list(line)]
    parts = [vocab.tokenize(p) for p in split_sentences(line)] if isinstance(line, str) else [list(line)]
    for k, part in enumerate(parts, start=1):
        if len(part) + 1 > limit:
            where = f"line {number}" + (f", sentence {k} of {len(parts)}," if len(parts) > 1 else "")
            raise InputTooLong(f"{where} has {len(part) + 1:,} tokens (its end mark included), more than the "
                               f"limit of {limit:,} (the model's max_len, or max_source_tokens, attn-translate "
                               f"--max-length): split it into shorter sentences")
    return parts


def decoding_of(decoding: Decoding | None, settings: dict, caller: str) -> Decoding:
    """``decoding``, or a :class:`~attn.decode.Decoding` of the ``settings`` given by name
    (``beam_size=4``): one or the other, a TypeError naming ``caller`` if both."""
    if decoding is None:
        return Decoding(**settings)
    if settings:
        raise TypeError(f"{caller}: give a Decoding or its settings ({', '.join(sorted(settings))}), not both")
    return decoding


def translate(model, vocab, sentences, decoding: Decoding | None = None, *, batch_size: int = 64,
              max_source_tokens: int | None = MAX_SOURCE_TOKENS, progress: bool = False, first_line: int = 1,
              **settings) -> list[Translation]:
    """Translate sentences (str, or lists of tokens) in batches; see :func:`translate_sentences`.

    ``decoding`` says how (:class:`attn.decode.Decoding`: greedy or beam search, its length
    penalty, length limit, n-grams it may not repeat, cross-attention kept); or its fields are
    given by name instead (``translate(model, vocab, lines, beam_size=4)``).

    Each input text is cut after its sentence ends (:func:`split_sentences`, whatever its length);
    its sentences are translated one by one and their translations joined with a space, so a line
    of three sentences gives one line of three translations (without ``attention``); a list of
    tokens is one sentence, as the caller cut it. A sentence
    of more than ``max_source_tokens`` tokens (its end-of-sentence mark included), or than the
    model's ``max_len``, the longest it was trained on, raises :class:`InputTooLong` before
    anything is decoded: the limit bounds each sentence's memory and time, which grow with the
    square of its length. None: each input is translated whole, as it is, without a limit (a
    learned table's model then sees the first ``max_len`` tokens). An empty input translates
    to an empty one.
    ``progress``: a progress bar on standard error.
    ``first_line``: the line number an :class:`InputTooLong` gives the first input (a caller
    translating a stream a batch of lines at a time passes where the batch starts).

    Returns one :class:`Translation` per sentence, in the input order.
    """
    decoding = decoding_of(decoding, settings, "translate")
    if batch_size < 1:
        raise ValueError(f"translate: batch_size must be positive, got {batch_size}")
    if max_source_tokens is not None and (isinstance(max_source_tokens, bool) or
                                          not isinstance(max_source_tokens, int) or max_source_tokens < 2):
        raise ValueError(f"translate: max_source_tokens must be an integer of at least 2 or None, "
                         f"got {max_source_tokens!r}")
    limit = None if max_source_tokens is None else min(max_source_tokens, model.config.max_len)
    pieces = [_pieces(vocab, s, limit, n) for n, s in enumerate(sentences, start=first_line)]
    flat = [(i, toks) for i, ps in enumerate(pieces) for toks in ps if toks]
    done = _translate_pieces(model, vocab, [t for _, t in flat], decoding, batch_size, progress)
    by_sentence: list = [[] for _ in pieces]
    for (i, _), t in zip(flat, done):
        by_sentence[i].append(t)
    empty = B.host.zeros((0, 0), dtype="float32") if decoding.with_attention else None
    return [parts[0] if len(parts) == 1 else
            Translation("", [], [], 0.0, empty) if not parts else
            Translation(" ".join(p.text for p in parts), sum((p.src_tokens for p in parts), []),
                        sum((p.tgt_tokens for p in parts), []), sum(p.score for p in parts), None)
            for parts in by_sentence]


def _translate_pieces(model, vocab, toks, decoding: Decoding, batch_size: int, progress: bool = False):
    from tqdm import tqdm
    np, xp = B.host, model.xp
    ids = [source_ids(vocab, t) for t in toks]
    if block.parts(model.config).positions.learned:
        ids = [x[:model.config.max_len] for x in ids]
    eos = _eos_token(vocab)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))     # similar lengths share a batch
    out: list = [None] * len(ids)
    bar = tqdm(total=len(ids), desc="test", unit="sentence", disable=not progress, **progress_bar_options())
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        S = max(1, max(len(ids[i]) for i in batch))
        src = np.full((len(batch), S), PAD, dtype=np.int64)
        for r, i in enumerate(batch):
            src[r, :len(ids[i])] = ids[i]
        src = xp.asarray(src)
        res = decoding.search(model, src)
        for r, i in enumerate(batch):
            tgt = list(vocab.decode(res.tokens[r]))
            src_labels = (toks[i] + [eos])[:len(ids[i])]
            att = res.cross_attention[r] if decoding.with_attention else None
            out[i] = Translation(detokenize(tgt), src_labels, tgt, res.scores[r], att)
        bar.update(len(batch))
    bar.close()
    return out


def translate_sentences(model, vocab, sentences: list[str], decoding: Decoding | None = None, *,
                        batch_size: int = 64, max_source_tokens: int | None = MAX_SOURCE_TOKENS,
                        **settings) -> list[str]:
    """Translate text: tokenise (``vocab.tokenize``), map to ids (UNK for unknown words),
    decode in batches of sentences of similar length (greedy for ``beam_size`` 1, beam
    search otherwise), detokenise. Returns the translations in the input order, one per input,
    each input cut at its sentence ends (see :func:`translate`; ``decoding`` or its settings by name)."""
    decoding = decoding_of(decoding, settings, "translate_sentences")
    return [t.text for t in translate(model, vocab, sentences, decoding, batch_size=batch_size,
                                      max_source_tokens=max_source_tokens)]


def evaluate_translations(model, vocab, pairs, decoding: Decoding | None = None, *, batch_size: int = 64,
                          progress: bool = False, **settings) -> tuple[Scores, list[str]]:
    """Translate the source side of ``pairs`` as ``decoding`` (or its settings by name) says and
    score it against the target side (``progress``: a progress bar on standard error while it translates).

    pairs : list of (source, reference); each side a str (the raw line: it is scored
        as it is) or a list of tokens (a token list is detokenised to give the reference text).
    Returns: (:class:`Scores`, the hypotheses as text).
    """
    srcs = [p[0] for p in pairs]
    refs = [p[1] if isinstance(p[1], str) else detokenize(list(p[1])) for p in pairs]
    decoding = decoding_of(decoding, settings, "evaluate_translations")
    hyps = [t.text for t in translate(model, vocab, srcs, decoding, batch_size=batch_size,
                                      max_source_tokens=None,      # a test set is scored line by line, as it is
                                      progress=progress)]
    return corpus_scores(hyps, refs), hyps


def evaluate_bleu(model, vocab, pairs, decoding: Decoding | None = None, *, batch_size: int = 64,
                  **settings) -> tuple[float, list[str]]:
    """:func:`evaluate_translations`, BLEU only: (corpus BLEU, the hypotheses as text)."""
    scores, hyps = evaluate_translations(model, vocab, pairs, decoding_of(decoding, settings, "evaluate_bleu"),
                                         batch_size=batch_size)
    return scores.bleu, hyps
