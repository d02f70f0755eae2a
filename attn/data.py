"""Text in, padded id arrays out: readers, tokeniser, vocabulary, token-budget batches.

The pipeline, in the order the trainer calls it::

    pairs = read_parallel("data/toy", "en", "tk", "train")   # [(src text, tgt text), ...]
    vocab = Vocab.build([tokenize(s) for s, _ in pairs] + [tokenize(t) for _, t in pairs])
    # or subword pieces: vocab = Vocab.build_bpe([s for s, _ in pairs] + [t for _, t in pairs], 8000)
    enc = encode_pairs(pairs, vocab, max_len=100)            # [(src ids, tgt ids), ...]
    batches = make_batches(enc, max_tokens=2000, shuffle=True, seed=0, epoch=0)
    batches[0].src, batches[0].tgt_in, batches[0].tgt_out    # (B, S), (B, T), (B, T) int64

One vocabulary serves both languages (the paper shares it, section 3.4, so the
embedding and the output projection can be tied). Ids 0-3 are the specials
``<pad> <s> </s> <unk>``; ``PAD`` equals :data:`attn.masks.PAD_ID`.

Batches follow section 5.1: "Sentence pairs were batched together by approximate
sequence length." Pairs are sorted by length and cut so that each padded batch
holds at most ``max_tokens`` positions; only the order of the batches is random,
seeded by ``(seed, epoch)`` so that a resumed run rebuilds the same list.

Everything here runs on the host (``backend.host``, i.e. NumPy); the trainer moves
the arrays to the device. Bad input raises :class:`DataError` naming the file and
line; skipped pairs are counted in one :class:`DataWarning`.
"""
from __future__ import annotations

import codecs
import gzip
import warnings
from collections import Counter
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

from . import backend as B
from .bpe import BPE, BYTE_TOKENS
from .masks import PAD_ID
from .text import detokenize, normalize, tokenize  # noqa: F401  (re-exported: the pipeline's first step)

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
assert PAD == PAD_ID, "attn.masks.PAD_ID and attn.data.PAD must agree"

#: The toy corpus that ``python data/make_toy.py`` writes (in a source checkout).
TOY_DIR = Path(__file__).resolve().parent.parent / "data" / "toy"


class DataError(ValueError):
    """A corpus file is missing, misaligned, not UTF-8, or not in the expected format."""


class DataWarning(UserWarning):
    """Some input was skipped (empty or over-long lines); the message gives the count."""


# --------------------------------------------------------------------------
# Tokeniser
# --------------------------------------------------------------------------
#
# attn.text splits text into words and marks without loss (a token glued to the one
# before it carries "##"), and attn.bpe cuts words into subword pieces; both are
# re-exported here, where the pipeline starts. A Vocab knows which of the two it uses:
# ``vocab.tokenize(text)``.

# --------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------


class Vocab:
    """Token <-> id. ``itos[i]`` is the token with id ``i``; ids 0-3 are :data:`SPECIALS`.

    A word vocabulary (``Vocab.build``) holds the tokens of :func:`tokenize`; a
    subword vocabulary (``Vocab.build_bpe``) also holds the learned merges
    (``vocab.bpe``). Either way ``vocab.tokenize(text)`` splits text into its tokens
    and :func:`detokenize` joins them back.
    """

    def __init__(self, itos: Sequence[str], bpe: BPE | None = None):
        itos = list(itos)
        if tuple(itos[:len(SPECIALS)]) != SPECIALS:
            raise DataError(f"a vocabulary must start with {list(SPECIALS)}, got {itos[:len(SPECIALS)]}")
        dupes = [t for t, n in Counter(itos).items() if n > 1]
        if dupes:
            raise DataError(f"a vocabulary lists each token once; repeated: {dupes[:10]}")
        self.itos: list[str] = itos
        self.stoi: dict[str, int] = {tok: i for i, tok in enumerate(itos)}
        if bpe is not None:
            missing = [t for t in bpe.vocabulary() if t not in self.stoi]
            if missing:
                raise DataError(f"a BPE vocabulary holds every piece its merges can make; missing: {missing[:10]}")
        self.bpe = bpe

    @classmethod
    def build(cls, token_lists: Iterable[Sequence[str]], min_freq: int = 1,
              max_size: int | None = None) -> "Vocab":
        """Count tokens; keep those seen at least ``min_freq`` times.

        Order is deterministic: specials, then by frequency (most frequent first),
        ties alphabetical. ``max_size`` caps the whole vocabulary, specials included.
        """
        if max_size is not None and max_size < len(SPECIALS):
            raise ValueError(f"max_size must be at least {len(SPECIALS)} (the specials), got {max_size}")
        counts = Counter(tok for tokens in token_lists for tok in tokens)
        for s in SPECIALS:
            counts.pop(s, None)
        kept = sorted((t for t, n in counts.items() if n >= min_freq), key=lambda t: (-counts[t], t))
        if max_size is not None:
            kept = kept[:max_size - len(SPECIALS)]
        return cls(SPECIALS + tuple(kept))

    @classmethod
    def build_bpe(cls, texts: Iterable[str], vocab_size: int, min_count: int = 2) -> "Vocab":
        """Learn byte-pair merges on ``texts`` (both languages: one shared vocabulary,
        section 5.1) until the vocabulary, specials and byte tokens included, has
        ``vocab_size`` entries (fewer if no pair is seen ``min_count`` times any more).

        Order: specials, the alphabet, the merged symbols in the order learned, the
        512 byte tokens (see :mod:`attn.bpe`).
        """
        smallest = len(SPECIALS) + len(BYTE_TOKENS) + 1
        if vocab_size < smallest:
            raise ValueError(f"a BPE vocabulary needs at least {smallest} entries ({len(SPECIALS)} specials, "
                             f"{len(BYTE_TOKENS)} byte tokens, some characters), got vocab_size={vocab_size}")
        bpe = BPE.learn(texts, max_symbols=vocab_size - len(SPECIALS) - len(BYTE_TOKENS), min_count=min_count)
        if len(SPECIALS) + len(bpe.vocabulary()) > vocab_size:
            raise ValueError(f"vocab_size={vocab_size} is too small for this text: its {len(bpe.alphabet)} "
                             f"characters alone need {len(SPECIALS) + len(BYTE_TOKENS) + len(bpe.alphabet)} "
                             f"entries, with the specials and byte tokens")
        return cls(SPECIALS + tuple(bpe.vocabulary()), bpe=bpe)

    def tokenize(self, text: str) -> list[str]:
        """The tokens of ``text`` in this vocabulary: words (:func:`tokenize`) or BPE pieces."""
        return self.bpe.encode(text) if self.bpe is not None else tokenize(text)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of the tokens; a token not in the vocabulary becomes ``UNK``. No BOS/EOS added."""
        return [self.stoi.get(tok, UNK) for tok in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Tokens of the ids, up to (not including) the first ``EOS``; ``PAD`` and ``BOS`` dropped.

        Accepts a list or a 1-d host array. An id outside the vocabulary is an error.
        """
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i in (PAD, BOS):
                continue
            if not 0 <= i < len(self.itos):
                raise ValueError(f"id {i} is outside the vocabulary (size {len(self.itos)})")
            out.append(self.itos[i])
        return out

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, token: str) -> bool:
        return token in self.stoi

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.itos == other.itos and self.bpe == other.bpe

    def __repr__(self) -> str:
        kind = f"BPE, {len(self.bpe.merges)} merges" if self.bpe is not None else "words"
        return f"Vocab({len(self)} tokens, {kind}: {self.itos[4:9]}...)"

    def to_json(self) -> list[str] | dict:
        """JSON-ready: a word vocabulary is the list ``itos``; a BPE vocabulary is
        ``{"itos": [...], "bpe": {"alphabet": [...], "merges": [[a, b], ...]}}``, so the
        merges travel in the checkpoint with it. :meth:`from_json` inverts both."""
        if self.bpe is None:
            return list(self.itos)
        return {"itos": list(self.itos), "bpe": self.bpe.to_json()}

    @classmethod
    def from_json(cls, obj) -> "Vocab":
        bpe = None
        if isinstance(obj, dict):
            if "itos" not in obj or "bpe" not in obj:
                raise DataError(f"a saved BPE vocabulary has the keys 'itos' and 'bpe', got {sorted(obj)}")
            try:
                bpe = BPE.from_json(obj["bpe"])
            except ValueError as e:
                raise DataError(f"a saved BPE vocabulary has unreadable merges: {e}") from None
            obj = obj["itos"]
        if isinstance(obj, str) or not isinstance(obj, (list, tuple)) or not all(isinstance(t, str) for t in obj):
            raise DataError("a saved vocabulary is a list of strings")
        return cls(obj, bpe=bpe)


# --------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------


#: The most bytes a compressed corpus file may expand to: its lines then take a few times this in
#: memory, and a small file that expands without end (a gzip bomb) must end in a clear error.
MAX_GUNZIP_BYTES = 2 * 2**30


def _gunzip(path: Path, chunk: int = 2**20) -> bytes:
    """The decompressed bytes of ``path``, at most :data:`MAX_GUNZIP_BYTES` of them, or a DataError.
    Read a MiB at a time: ``read(n)`` sets aside ``n`` bytes before it knows how many there are."""
    parts, total = [], 0
    try:
        with gzip.open(path, "rb") as f:
            while total <= MAX_GUNZIP_BYTES and (part := f.read(chunk)):
                parts.append(part)
                total += len(part)
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable gzip file ({e})") from None
    if total > MAX_GUNZIP_BYTES:
        raise DataError(f"{path}: decompresses to more than {MAX_GUNZIP_BYTES:,} bytes, the most a corpus file "
                        "may hold: split the corpus into smaller files (or is it not a corpus?)")
    return b"".join(parts)


def _read_lines(path) -> list[str]:
    """Lines of a UTF-8 text file (``.gz`` read transparently), without their line ends.

    Lines are split on ``\\n`` only (a ``\\r`` before it is dropped: CRLF files, such as
    Tatoeba's, read as they should), so a stray U+2028 inside a sentence does not shift the
    alignment; a ``\\r`` left inside a line (old Mac line ends) is an error naming the line.
    A leading UTF-8 byte-order mark is dropped; a UTF-16 or UTF-32 one is an error.
    If ``path`` is missing but ``path.gz`` exists, that is read."""
    path = Path(path)
    if not path.is_file() and Path(str(path) + ".gz").is_file():
        path = Path(str(path) + ".gz")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    raw = _gunzip(path) if path.suffix == ".gz" else path.read_bytes()
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if raw.startswith(bom):
            raise DataError(f"{path}: line 1 starts with a {name} byte-order mark: the file is {name}, "
                            "not UTF-8; save it as UTF-8")
    chunks = raw.split(b"\n")
    if chunks[-1] == b"":  # the newline that ends the last line
        chunks.pop()
    lines = []
    for number, chunk in enumerate(chunks, start=1):
        try:
            line = chunk.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: line {number} is not valid UTF-8 "
                            f"({e.reason} at byte {e.start} of the line)") from None
        if "\r" in line:
            raise DataError(f"{path}: line {number} holds a carriage return (\\r) inside the line: are its lines "
                            "ended by \\r alone (old Mac style)? Convert the file to \\n line ends")
        lines.append(line)
    return lines


def read_parallel(data_dir, src: str, tgt: str, split: str) -> list[tuple[str, str]]:
    """Sentence pairs from the line-aligned files ``DIR/{split}.{src}`` and ``DIR/{split}.{tgt}``.

    Returns ``[(source text, target text), ...]``, one per line, lines empty on both
    sides included (:func:`encode_pairs` skips and counts them). Raises :class:`DataError`
    for a missing file, a line that is not UTF-8, files with different line counts, or a
    line that is empty in one file only (the usual sign of files out of step).
    """
    src_path, tgt_path = Path(data_dir) / f"{split}.{src}", Path(data_dir) / f"{split}.{tgt}"
    src_lines = [line.strip() for line in _read_lines(src_path)]
    tgt_lines = [line.strip() for line in _read_lines(tgt_path)]
    if len(src_lines) != len(tgt_lines):
        raise DataError(f"{src_path} has {len(src_lines)} lines but {tgt_path} has {len(tgt_lines)}: "
                        "parallel files must be line-aligned, one sentence per line")
    for number, (s, t) in enumerate(zip(src_lines, tgt_lines), start=1):
        if bool(s) != bool(t):
            empty, full = (src_path, tgt_path) if not s else (tgt_path, src_path)
            raise DataError(f"{empty}: line {number} is empty but line {number} of {full} is not: "
                            "are the files out of step? (a line empty in both is skipped)")
    return list(zip(src_lines, tgt_lines))


def read_tsv(path) -> list[tuple[str, str]]:
    """Sentence pairs from a tab-separated file: ``source<TAB>target[<TAB>anything]`` per line.

    This is the Tatoeba/Anki format (manythings.org files carry an attribution in a
    third column, which is ignored). Fields are stripped of surrounding spaces. Blank lines
    are skipped and counted in a warning; a non-blank line without a tab, or with an empty
    source or target field, raises :class:`DataError` naming the file and line.
    """
    pairs, blank = [], 0
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            blank += 1
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            raise DataError(f"{path}: line {number} has no tab; expected 'source<TAB>target', "
                            f"got {line[:60]!r}")
        src, tgt = fields[0].strip(), fields[1].strip()
        if not src or not tgt:
            raise DataError(f"{path}: line {number} has an empty {'source' if not src else 'target'} field: "
                            f"expected 'source<TAB>target', got {line[:60]!r}")
        pairs.append((src, tgt))
    if blank:
        warnings.warn(f"{path}: skipped {blank} blank line(s)", DataWarning, stacklevel=2)
    return pairs


# --------------------------------------------------------------------------
# Encoding and batching
# --------------------------------------------------------------------------


def encode_pairs(pairs: Iterable[tuple[str, str]], vocab: Vocab,
                 max_len: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Tokenise (``vocab.tokenize``: words or BPE pieces) and encode each pair with the shared vocabulary.

    Skips pairs where either side has no tokens, or (with ``max_len``) more than
    ``max_len`` tokens (BOS/EOS not counted), and reports the count in one
    :class:`DataWarning`. Returns ``[(src ids, tgt ids), ...]`` without BOS/EOS.
    """
    encoded, total, empty, long = [], 0, 0, 0
    for src, tgt in pairs:
        total += 1
        s, t = vocab.tokenize(src), vocab.tokenize(tgt)
        if not s or not t:
            empty += 1
        elif max_len is not None and max(len(s), len(t)) > max_len:
            long += 1
        else:
            encoded.append((vocab.encode(s), vocab.encode(t)))
    if empty or long:
        warnings.warn(f"skipped {empty + long} of {total} sentence pairs: {empty} with an empty side, "
                      f"{long} longer than max_len={max_len} tokens", DataWarning, stacklevel=2)
    return encoded


class Batch(NamedTuple):
    """One batch of padded id arrays on the host (int64).

    A source of n tokens fills n + 1 positions (the ids, then EOS, as tensor2tensor and
    fairseq do, and as :func:`attn.evaluate.source_ids` expects); a target of m tokens
    fills m + 1 positions of ``tgt_in`` (BOS, ids) and of ``tgt_out`` (ids, EOS), so
    ``tgt_out[:, i]`` is the token the decoder must predict after reading ``tgt_in[:, :i+1]``.
    """
    src: object  # (B, S) source ids + EOS, PAD after the end
    tgt_in: object  # (B, T) BOS + target ids: the decoder's input
    tgt_out: object  # (B, T) target ids + EOS: what the decoder must predict
    n_src_tokens: int  # real (non-PAD) positions in src (EOS included)
    n_tgt_tokens: int  # real (non-PAD) positions in tgt_out (EOS included)


def _pad_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Batch:
    """Pad one group of (src ids, tgt ids) pairs into a :class:`Batch`."""
    np = B.host
    n = len(pairs)
    S = max(len(s) for s, _ in pairs) + 1  # room for EOS
    T = max(len(t) for _, t in pairs) + 1  # room for BOS (input) / EOS (output)
    src = np.full((n, S), PAD, dtype=np.int64)
    tgt_in = np.full((n, T), PAD, dtype=np.int64)
    tgt_out = np.full((n, T), PAD, dtype=np.int64)
    for row, (s, t) in enumerate(pairs):
        src[row, :len(s)] = s
        src[row, len(s)] = EOS
        tgt_in[row, 0] = BOS
        tgt_in[row, 1:len(t) + 1] = t
        tgt_out[row, :len(t)] = t
        tgt_out[row, len(t)] = EOS
    return Batch(src, tgt_in, tgt_out,
                 n_src_tokens=sum(len(s) + 1 for s, _ in pairs),
                 n_tgt_tokens=sum(len(t) + 1 for _, t in pairs))


def _cut(lengths: Sequence[tuple[int, int]], order: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Cut ``order`` (indices, sorted by length) into runs whose padded size
    ``max(S, T) * B`` stays within ``max_tokens``; a pair too long for the budget
    gets a batch of its own. ``S`` and ``T`` count the EOS/BOS position."""
    groups: list[list[int]] = []
    group: list[int] = []
    width = 0
    for i in order:
        s, t = lengths[i]
        new_width = max(width, s + 1, t + 1)
        if group and new_width * (len(group) + 1) > max_tokens:
            groups.append(group)
            group, new_width = [], max(s + 1, t + 1)
        group.append(i)
        width = new_width
    if group:
        groups.append(group)
    return groups


def make_batches(encoded_pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_tokens: int, *,
                 shuffle: bool, seed: int = 0, epoch: int = 0) -> list[Batch]:
    """Batches of about ``max_tokens`` padded positions each (section 5.1).

    Pairs are sorted by source length, then target length, and cut in order so that
    every batch's ``max(S, T) * B <= max_tokens`` (S and T count EOS/BOS, see
    :class:`Batch`; a single over-long pair is a batch of its own). Each pair appears
    in exactly one batch. With ``shuffle=True``, ties in length and the order of the
    batches are shuffled by
    ``backend.host.random.default_rng(seed + epoch)``: the same ``(seed, epoch)``
    always gives the same list, so a run can resume mid-epoch by skipping ahead.
    With ``shuffle=False`` the batches come shortest first, ties in input order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    lengths = [(len(s), len(t)) for s, t in encoded_pairs]
    for i, (s, t) in enumerate(lengths):
        if s == 0 or t == 0:
            raise DataError(f"pair {i} has an empty side; encode_pairs skips such pairs")
    rng = B.host.random.default_rng(seed + epoch) if shuffle else None
    order = rng.permutation(len(lengths)).tolist() if shuffle else list(range(len(lengths)))
    order.sort(key=lambda i: lengths[i])  # stable: shuffled (or input) order within a length
    groups = _cut(lengths, order, max_tokens)
    if shuffle:
        groups = [groups[k] for k in rng.permutation(len(groups)).tolist()]
    return [_pad_batch([encoded_pairs[i] for i in g]) for g in groups]


def pad_to_bucket(batch: Batch, length_multiple: int = 8, row_multiple: int = 16) -> Batch:
    """``batch`` padded with PAD to a shape from a short list: source and target lengths
    rounded up to multiples of ``length_multiple``, the rows to a multiple of ``row_multiple``
    (rows of PAD alone). A CUDA graph replays one shape (:class:`attn.fast.gpu.graph.CapturedStep`
    captures one per shape), and batches of about N tokens come in dozens of shapes an epoch;
    rounded, in a handful. The loss and the gradients are those of ``batch``: every padded
    position is masked out of the attention and the loss (up to the order floating-point
    sums are taken in), and the token counts are unchanged."""
    if length_multiple < 1 or row_multiple < 1:
        raise ValueError(f"pad_to_bucket: length_multiple and row_multiple must be positive, got "
                         f"{length_multiple} and {row_multiple}")
    np = B.host
    (n, S), T = batch.src.shape, batch.tgt_in.shape[1]

    def up(k, m):
        return -(-k // m) * m
    rows, S2, T2 = up(n, row_multiple), up(S, length_multiple), up(T, length_multiple)
    if (rows, S2, T2) == (n, S, T):
        return batch

    def padded(a, width):
        out = np.full((rows, width), PAD, dtype=a.dtype)
        out[:a.shape[0], :a.shape[1]] = a
        return out
    return batch._replace(src=padded(batch.src, S2), tgt_in=padded(batch.tgt_in, T2),
                          tgt_out=padded(batch.tgt_out, T2))


# --------------------------------------------------------------------------
# A text for a language model
# --------------------------------------------------------------------------


def read_text(path) -> str:
    """A whole UTF-8 text (``.gz`` read transparently; PATH.gz where PATH is missing), its lines
    ended by ``\\n``: what a language model learns to continue. A DataError names the file."""
    lines = _read_lines(path)
    if not lines:
        raise DataError(f"{path}: the text is empty")
    return "\n".join(lines) + "\n"


def char_vocab(text: str) -> Vocab:
    """A character vocabulary: the specials, then every character of ``text``, sorted (nanoGPT's
    ``shakespeare_char``)."""
    return Vocab(SPECIALS + tuple(sorted(set(text))))


def encode_text(text: str, vocab: Vocab, char: bool) -> list[int]:
    """The ids of ``text``: one a character (``char``), or the vocabulary's pieces of each line
    (words or BPE), each line ended by ``EOS``, which stands for the line end."""
    if char:
        return [vocab.stoi.get(c, UNK) for c in text]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [i for line in lines for i in (*vocab.encode(vocab.tokenize(line)), EOS)]


def decode_text(ids: Iterable[int], vocab: Vocab, char: bool) -> str:
    """The text of ``ids``, inverting :func:`encode_text`; ``PAD``, ``BOS`` and ``UNK`` are left
    out (and ``EOS`` of a character vocabulary, which never reads it)."""
    specials = (PAD, BOS, UNK) if not char else (PAD, BOS, EOS, UNK)
    ids = [int(i) for i in ids]
    if char:
        return "".join(vocab.itos[i] for i in ids if i not in specials)
    lines, line = [], []
    for i in ids:
        if i == EOS:
            lines.append(line)
            line = []
        elif i not in specials:
            line.append(vocab.itos[i])
    done = "".join(detokenize(t) + "\n" for t in lines)
    return done + detokenize(line) if line else done
