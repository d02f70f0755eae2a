"""What a training run is asked to do: :class:`TrainConfig`, the recipes behind its defaults,
the settings a resumed run keeps, and the ``attn-train`` command line that fills it in.

The field names are the flags (``lr_factor`` is ``--lr-factor``); :func:`build_parser` is the
command line and :func:`config_from_argv` turns one into a config. Nothing here trains:
:mod:`attn.train` runs the loop.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..block import KINDS
from ..bpe import BYTE_TOKENS
from ..data import SPECIALS
from ..decode import Decoding
from ..evaluate import MAX_ALPHA, MAX_BEAM
from ..model import MAX_LEN_LIMIT, PRESETS, TransformerConfig, renamed_fields
from ..precision import PRECISIONS, Precision, PrecisionError

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "data" / "toy"


# --------------------------------------------------------------------------- settings

#: Each preset's training recipe, for the fields left at None: words for the toy corpus; for a small
#: real corpus (``small``) a vocabulary of 4,000 BPE pieces, 2,048-token batches, a cooldown, rotary
#: positions, and test translations by beam search that repeats no 4-gram; for ``base`` the earlier
#: real-corpus recipe (why: benchmarks/RESULTS.md, "A recipe for a small corpus" and "The block of
#: today on Multi30k").
RECIPES = {
    "toy": dict(vocab="word", max_tokens=2048, lr_factor=0.5, min_freq=1, cooldown=0.0,
                beam=1, alpha=0.6, no_repeat_ngram=0),
    "small": dict(vocab="bpe", vocab_size=4000, max_tokens=2048, lr_factor=1.0, min_freq=2, cooldown=0.3,
                  beam=4, alpha=1.4, no_repeat_ngram=4, positional="rope"),
    "base": dict(vocab="bpe", max_tokens=4096, lr_factor=1.0, min_freq=2, cooldown=0.0,
                 beam=1, alpha=0.6, no_repeat_ngram=0),
    # nanoGPT's shakespeare_char on a CPU (context 64, batch 12), characters; a peak rate of 1e-3
    # (lr_factor 0.113: the section-5.3 schedule at d_model 128 and 100 warm-up steps)
    "shakespeare_char": dict(vocab="bpe", max_tokens=2048, lr_factor=0.113, min_freq=1, cooldown=0.0,
                             beam=1, alpha=0.6, no_repeat_ngram=0, char=True, context=64, batch=12),
}

#: A language model's settings where neither the flags nor the preset's recipe give them.
LM_DEFAULTS = dict(char=False, context=64, batch=12)
#: The tasks of attn-train: a translator (an encoder-decoder) or a language model (decoder-only).
TASKS = ("translate", "lm")
#: The text a language model trains on when --text is not given: tiny Shakespeare (data/README.md).
DEFAULT_TEXT = DEFAULT_DATA.parent / "tinyshakespeare" / "input.txt.gz"

#: With no ``warmup`` given and a budget (``minutes`` or ``steps``), the warm-up is this fraction
#: of the steps the budget allows, if that is shorter than the preset's, so that a short run
#: leaves its warm-up before it ends.
WARMUP_FRACTION = 0.3
#: Share of a --minutes budget spent on evaluations and checkpoints, for the estimate of steps.
EVAL_SHARE = 0.1

#: The largest ``lr_factor``: the paper's rate times this already diverges; beyond it the rate
#: overflows float32.
MAX_LR_FACTOR = 1000.0


class TrainConfigError(ValueError):
    """A training setting is out of range or of the wrong type; the message names it."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


#: The largest batch (``--max-tokens``) in tokens: forty times the paper's, whose activations alone
#: would fill a large GPU's memory many times over.
MAX_BATCH_TOKENS = 1_000_000


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run, with its default.

    The field names are the ``attn-train`` flags (``lr_factor`` is ``--lr-factor``).
    ``None`` for a model field keeps the preset's value. Out-of-range values raise
    :class:`TrainConfigError` naming the field, before any work starts.
    """
    # data
    task: str = "translate"            # "translate" (an encoder-decoder) or "lm" (a decoder-only language model)
    text: Path | None = None           # lm: the text (.gz read as such; None: tiny Shakespeare); last 10% for val
    char: bool | None = None           # lm: one token a character (None: the recipe's, else BPE pieces)
    context: int | None = None         # lm: tokens per sequence (None: the recipe's, else 64)
    batch: int | None = None           # lm: sequences per step (None: the recipe's, else 12)
    data: Path = DEFAULT_DATA          # folder with {train,val,test}.{src,tgt} line-aligned files
    src: str = "en"                    # source language suffix
    tgt: str = "tk"                    # target language suffix
    tsv: Path | None = None            # tab-separated pairs file instead of `data`; val/test held out
    min_freq: int | None = None        # words seen fewer times in training become <unk> (None: the recipe's)
    vocab: str | None = None           # "word" (tokens of attn.text) or "bpe" (subword pieces, attn.bpe);
                                       # None: the recipe's
    vocab_size: int | None = None      # bpe: the vocabulary's size (None: the recipe's, else 8000);
                                       # word: at most this many (None: every word seen min_freq times)
    max_len: int | None = None         # skip training pairs longer than this many tokens (None: the preset's)
    # model (None: the preset's value)
    preset: str = "toy"
    d_model: int | None = None
    heads: int | None = None
    d_ff: int | None = None
    layers: int | None = None          # encoder layers and decoder layers
    dropout: float | None = None
    label_smoothing: float | None = None
    # the block (None: the preset's, the paper's): lesson 26
    norm_position: str | None = None   # where the norm sits: "post" (the paper) or "pre"
    norm_kind: str | None = None       # "layer" (the paper) or "rms"
    positional: str | None = None      # "sinusoidal", "learned" or "rope"
    ffn: str | None = None             # "relu" or "swiglu"
    kv_heads: int | None = None        # key/value heads of every attention (grouped-query attention)
    qk_norm: bool | None = None        # RMSNorm over each head's queries and keys (QK-norm)
    dtype: str = "float32"
    # training
    backend: str | None = None         # numpy, cupy, auto; None: $ATTN_BACKEND or numpy
    minutes: float = 7.0               # wall-clock budget for training (0: no limit)
    steps: int = 0                     # stop after this many optimizer steps (0: no limit)
    epochs: int = 0                    # stop after this many epochs (0: no limit)
    max_tokens: int | None = None      # tokens per batch, padding included (None: the recipe's)
    warmup: int | None = None          # warm-up steps (None: the preset's, shortened to fit the budget)
    lr_factor: float | None = None     # multiplies the section-5.3 learning rate (None: the recipe's)
    cooldown: float | None = None      # the rate falls linearly to 0 over this last fraction of the budget
                                       # (attn.optim.cooldown_scale; 0: off; None: the recipe's)
    clip: float = 0.0                  # clip the global gradient norm to this (0: off)
    seed: int = 0                      # weights, batch order, dropout, the tsv split
    eval_every: int = 250              # validate and checkpoint every N steps
    bleu_sentences: int = 200          # validation sentences translated at each evaluation (0: none)
    average: int = 5                   # average the last K snapshots for the final model (0 or 1: off)
    snapshot_every: int = 50           # steps between the snapshots that `average` uses
    beam: int | None = None            # the final test translation: beam size (1: greedy; None: the recipe's),
    alpha: float | None = None         # its length penalty (attn.decode.length_penalty; None: the recipe's)
    no_repeat_ngram: int | None = None  # and the n-grams it may not repeat (0: off; None: the recipe's)
    out: Path = Path("runs/toy")       # output folder
    resume: bool = False               # continue from out/checkpoint.npz, with the saved run's settings
    allow_new_corpus: bool = False     # resume even though the corpus is not the one the run trained on
    overwrite: bool = False            # a fresh run into an `out` that holds a run deletes that run first
    reference: bool = False            # train with the readable engine (attn.engine), not the fast one
    cuda_graph: bool = False           # each training step one CUDA graph launch (CuPy, the fast engine, one process)
    precision: str = "fp32"            # the matrix products' inputs: fp32, tf32 or bf16 (attn.precision); the
                                       # weights stay float32 (fp32 master weights in the arena)
    attention: str = "auto"            # the fast engine's attention: plain, flash (tiled) or auto (attn.fast.core.flash)
    quiet: bool = False                # no progress bar
    # fine-tuning a trained translator (attn.training.finetune; lesson 29)
    resume_from: Path | None = None    # start from this checkpoint's weights and vocabulary, on this corpus
    lora: int | None = None            # train LoRA adapters of this rank alone, the weights frozen (None: all)
    lora_targets: str = "q,v"          # the projections of every attention that get an adapter
    lora_alpha: float | None = None    # the adapters' update is scaled by lora_alpha / rank (None: 2 * rank)

    def __post_init__(self):
        self._check_paths()
        self._check_choices()
        self._check_precision()
        self._check_attention()
        self._check_block()
        self._check_task()
        self._check_finetune()
        if self.backend not in (None, "numpy", "cupy", "auto"):
            self._bad("backend", "must be 'numpy', 'cupy', 'auto' or None ($ATTN_BACKEND or numpy)")
        self._check_integers()
        self._check_reals()
        for name in ("resume", "allow_new_corpus", "overwrite", "reference", "cuda_graph", "quiet"):
            if not isinstance(getattr(self, name), bool):
                self._bad(name, "must be True or False")

    def _check_paths(self) -> None:
        """``data``, ``tsv`` and ``out`` as paths; a corpus given; ``resume`` or ``overwrite``, not both."""
        for name in ("data", "tsv", "out", "text"):
            v = getattr(self, name)
            if isinstance(v, str):
                if not v.strip():
                    self._bad(name, "must be a path, not empty (for the current folder give .)")
                object.__setattr__(self, name, Path(v))
            elif v is not None and not isinstance(v, Path):
                self._bad(name, "must be a path")
        if self.resume and self.overwrite:
            self._bad("overwrite", "cannot be combined with resume (one continues the run in out, the other deletes it)")
        if self.tsv is None and self.data is None:
            self._bad("data", "must be a folder (or give tsv)")

    def _check_choices(self) -> None:
        """The languages, the preset, the dtype and the vocabulary's kind and size."""
        for name in ("src", "tgt"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                self._bad(name, "must be a non-empty language suffix such as 'en'")
        if self.preset not in PRESETS:
            self._bad("preset", f"must be one of {sorted(PRESETS)}")
        if self.dtype not in ("float32", "float64"):
            self._bad("dtype", "must be 'float32' or 'float64'")
        if self.vocab not in (None, "word", "bpe"):
            self._bad("vocab", "must be 'word' or 'bpe' (or None: the preset's recipe)")
        kind = self.vocab or RECIPES.get(self.preset, RECIPES["base"])["vocab"]
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool)
                                            or self.vocab_size < _smallest_vocab(kind)):
            self._bad("vocab_size", f"must be an integer of at least {_smallest_vocab(kind)} "
                                    f"for vocab={kind!r}")

    def _check_precision(self) -> None:
        """A known precision, and one other than fp32 only in float32 on the fast engine."""
        try:
            Precision(self.precision)
        except PrecisionError:
            self._bad("precision", f"must be one of {', '.join(PRECISIONS)}")
        if self.precision != "fp32" and self.dtype != "float32":
            self._bad("precision", f"rounds float32 products and needs --dtype float32 (got {self.dtype}); "
                                   "use --precision fp32")
        if self.precision != "fp32" and self.reference is True:
            self._bad("precision", "applies to the attn.fast engine, not to --reference (the readable layers "
                                   "multiply in float32); drop one of the two flags")

    def _check_attention(self) -> None:
        """The fast engine's attention: plain, flash or auto, forced only on the fast engine."""
        if self.attention not in ("auto", "plain", "flash"):
            self._bad("attention", "must be one of auto, plain, flash")
        if self.attention != "auto" and self.reference is True:
            self._bad("attention", "applies to the attn.fast engine, not to --reference; drop one of the two flags")

    def _check_integers(self) -> None:
        """The counts: integers, not bools, at least their smallest value; ``max_tokens`` capped."""
        for name, low, optional in (("min_freq", 1, True), ("max_len", 1, True), ("d_model", 1, True),
                                    ("heads", 1, True), ("d_ff", 1, True), ("layers", 1, True), ("kv_heads", 1, True),
                                    ("steps", 0, False), ("epochs", 0, False), ("max_tokens", 1, True),
                                    ("warmup", 1, True), ("seed", 0, False), ("eval_every", 1, False),
                                    ("bleu_sentences", 0, False), ("average", 0, False),
                                    ("snapshot_every", 1, False), ("beam", 1, True), ("no_repeat_ngram", 0, True),
                                    ("context", 2, True), ("batch", 1, True)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                self._bad(name, "must be an integer")
            if v < low:
                self._bad(name, f"must be at least {low}")
        if self.beam is not None and self.beam > MAX_BEAM:
            self._bad("beam", f"must be at most {MAX_BEAM} (the hypotheses kept of every test sentence)")
        if self.max_tokens is not None and self.max_tokens > MAX_BATCH_TOKENS:
            self._bad("max_tokens", f"must be at most {MAX_BATCH_TOKENS:,} (the paper's batches hold 25,000 "
                                    f"source and 25,000 target tokens)")

    def _check_reals(self) -> None:
        """The rates and fractions: finite numbers within their ranges."""
        for name, check, rule in (("minutes", lambda v: v >= 0, "must be >= 0 (0: no limit)"),
                                  ("lr_factor", lambda v: 0 < v <= MAX_LR_FACTOR,
                                   f"must be > 0 and at most {MAX_LR_FACTOR:g} (1 is the paper's rate)"),
                                  ("clip", lambda v: v >= 0, "must be >= 0 (0: off)"),
                                  ("cooldown", lambda v: 0 <= v <= 1, "must be in [0, 1] (0: off)"),
                                  ("alpha", lambda v: 0 <= v <= MAX_ALPHA,
                                   f"must be in [0, {MAX_ALPHA:g}] (0: no length penalty; the paper's is 0.6)"),
                                  ("dropout", lambda v: 0 <= v < 1, "must be in [0, 1)"),
                                  ("label_smoothing", lambda v: 0 <= v < 1, "must be in [0, 1)")):
            v = getattr(self, name)
            if v is None and name in ("dropout", "label_smoothing", "lr_factor", "cooldown", "alpha"):
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                self._bad(name, "must be a finite number")
            if not check(v):
                self._bad(name, rule)

    def _check_block(self) -> None:
        """The block's kinds."""
        for name, kinds in KINDS.items():
            if getattr(self, name) not in (None, *kinds):
                self._bad(name, f"must be one of {', '.join(kinds)} (or None: the preset's)")

    def _check_task(self) -> None:
        """The task; a language model's flags given to it alone; a language model's preset trains
        one; a lower precision and a captured step refused for a language model (its fast engine runs
        float32 and float64 steps, eagerly)."""
        if self.task not in TASKS:
            self._bad("task", f"must be one of {', '.join(TASKS)}")
        lm = self.task == "lm"
        for name in ("text", "char", "context", "batch"):
            if not lm and getattr(self, name) is not None:
                self._bad(name, "is a language model's setting: give --task lm")
        if self.char not in (None, True, False):
            self._bad("char", "must be True, False or None")
        if not lm and self.preset in PRESETS and PRESETS[self.preset]["n_encoder_layers"] == 0:
            self._bad("preset", "is a language model's (no encoder): give --task lm")
        for name, default in (("precision", "fp32"), ("cuda_graph", False)):
            if lm and getattr(self, name) != default:
                self._bad(name, "applies to a translator's step; a language model's runs at fp32, eagerly")
        if lm and (self.context or 0) > MAX_LEN_LIMIT:
            self._bad("context", f"must be at most {MAX_LEN_LIMIT:,} (the model's max_len: its table of positions)")
        if lm and (self.context or 0) * (self.batch or 0) > MAX_BATCH_TOKENS:
            self._bad("batch", f"times --context ({self.context:,}) must be at most {MAX_BATCH_TOKENS:,} tokens a step")

    def _check_finetune(self) -> None:
        """``resume_from`` a checkpoint file, for a translator, on the readable engine, not with
        ``resume``; ``lora`` a positive rank given with it; its targets and alpha well formed."""
        from ..lora import parse_targets
        if isinstance(self.resume_from, str):
            object.__setattr__(self, "resume_from", Path(self.resume_from))
        if self.lora is not None and (not isinstance(self.lora, int) or isinstance(self.lora, bool) or self.lora < 1):
            self._bad("lora", "must be a positive integer, the adapters' rank")
        if self.lora is not None and self.resume_from is None:
            self._bad("lora", "adapts a trained model: give --resume-from CHECKPOINT too")
        try:
            parse_targets(self.lora_targets)
        except ValueError as e:
            raise TrainConfigError(f"{e}") from None
        if self.lora_alpha is not None and not (isinstance(self.lora_alpha, (int, float)) and 0 < self.lora_alpha
                                                < math.inf):
            self._bad("lora_alpha", "must be a positive number")
        if self.resume_from is None:
            return
        if not self.resume_from.is_file():
            self._bad("resume_from", "must be a checkpoint file written by attn-train")
        if self.resume or self.task != "translate":
            self._bad("resume_from", "starts a new fine-tuning run of a translator: not with --resume or --task lm")
        if not self.reference:
            self._bad("resume_from", "fine-tunes on the readable engine: add --reference (the attn.fast engine "
                                     "has no LoRA adapters)")

    def _bad(self, name: str, rule: str):
        raise TrainConfigError(f"{name} ({_flag(name)}) {rule}, got {getattr(self, name)!r}")

    def with_recipe(self) -> "TrainConfig":
        """This config with the fields left at ``None`` that :data:`RECIPES` covers filled
        in from the preset's recipe (its ``vocab_size`` only for a BPE vocabulary: a word
        vocabulary keeps every word unless ``vocab_size`` is given)."""
        recipe = RECIPES.get(self.preset, RECIPES["base"])     # a preset added elsewhere: the real-corpus recipe
        fill = {k: v for k, v in recipe.items() if getattr(self, k) is None}
        if (self.vocab or recipe["vocab"]) != "bpe":
            fill.pop("vocab_size", None)
        if self.task == "lm":
            fill.update({k: v for k, v in LM_DEFAULTS.items() if getattr(self, k) is None and k not in fill})
        else:
            fill = {k: v for k, v in fill.items() if k not in LM_DEFAULTS}
        return dataclasses.replace(self, **fill)

    def to_dict(self) -> dict:
        """JSON-ready: paths as strings. :meth:`from_dict` inverts it."""
        return {f.name: (str(v) if isinstance(v, Path) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A config from :meth:`to_dict` output (or a checkpoint's saved settings); unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in renamed_fields(d, "TrainConfig").items() if k in names})

    @property
    def decoding(self) -> Decoding:
        """How the final test translation decodes (``--beam``, ``--alpha``, ``--no-repeat-ngram``;
        on a config whose recipe is filled in, :meth:`with_recipe`)."""
        return Decoding(beam_size=self.beam, alpha=self.alpha, no_repeat_ngram=self.no_repeat_ngram)

    @property
    def engine(self) -> str:
        """The :mod:`attn.engine` engine that trains: ``reference`` with ``--reference``, else ``fast``
        (a translator's or a language model's)."""
        return "reference" if self.reference else "fast"

    def model_config(self, vocab_size: int) -> TransformerConfig:
        """The preset with this config's overrides, for a vocabulary of ``vocab_size``; a
        TrainConfigError naming the flag without which the model would fit, where there is one."""
        given = {name: getattr(self, name) for _, name in MODEL_FLAGS if getattr(self, name) is not None}
        lm = {}
        if self.task == "lm":                     # decoder-only; positions for the whole context
            lm = dict(n_encoder_layers=0, max_len=max(PRESETS[self.preset]["max_len"], self.context or 0))
        try:
            return _model_config(self.preset, vocab_size, given, lm)
        except ValueError as e:
            culprit = next((n for n in given if _fits(self.preset, vocab_size, {k: v for k, v in given.items()
                                                                                 if k != n}, lm)), None)
            which = f" ({_flag(culprit)} {given[culprit]!r})" if culprit else ""
            raise TrainConfigError(f"the model settings do not fit together{which}: {e}") from None

    def check_model_fits(self, memory_bytes: int | None = None) -> None:
        """A TrainConfigError if the model's parameters, gradients and Adam's two moments alone, its
        embeddings left out, exceed ``memory_bytes`` (default: this machine's memory), so that
        ``--d-model 1000000`` is refused before any data is read rather than ending in a MemoryError."""
        from ..model import parameter_shapes
        if memory_bytes is None:
            try:
                memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                return
        cfg = self.model_config(len(SPECIALS) + 1)
        count = sum(math.prod(shape) for shape in parameter_shapes(cfg).values())
        need = 4 * count * (8 if self.dtype == "float64" else 4)
        if need > memory_bytes:
            raise TrainConfigError(f"the model ({self.preset} with --d-model {cfg.d_model}, --d-ff {cfg.d_ff}, "
                                   f"--layers {cfg.n_encoder_layers}) has {count:,} parameters before its "
                                   f"embeddings: {need / 2**30:,.1f} GiB with gradients and Adam's moments, "
                                   f"more than this machine's {memory_bytes / 2**30:,.1f} GiB")


#: The model's fields that a flag of attn-train overrides: (TransformerConfig's name, TrainConfig's).
MODEL_FLAGS = (("d_model", "d_model"), ("n_heads", "heads"), ("d_ff", "d_ff"), ("n_encoder_layers", "layers"),
               ("n_decoder_layers", "layers"), ("dropout", "dropout"), ("label_smoothing", "label_smoothing"),
               ("warmup_steps", "warmup"), ("norm_position", "norm_position"), ("norm_kind", "norm_kind"),
               ("positional", "positional"), ("ffn", "ffn"), ("kv_heads", "kv_heads"), ("qk_norm", "qk_norm"))


def _model_config(preset: str, vocab_size: int, given: dict, fields: dict | None = None) -> TransformerConfig:
    """The preset with ``given`` (TrainConfig's names), then ``fields`` (the model's), in place of its fields."""
    return TransformerConfig.preset(preset, vocab_size=vocab_size, **{
        **{field: given[name] for field, name in MODEL_FLAGS if name in given}, **(fields or {})})


def _fits(preset: str, vocab_size: int, given: dict, fields: dict | None = None) -> bool:
    try:
        _model_config(preset, vocab_size, given, fields)
        return True
    except ValueError:
        return False


#: Settings a resumed run may take from the new command line: they change how the run is watched,
#: evaluated or where it stops, not what it computes. Every other setting comes from the saved run.
RESUME_MAY_CHANGE = ("minutes", "steps", "epochs", "backend", "quiet", "reference", "cuda_graph", "beam", "alpha",
                     "no_repeat_ngram", "attention", "allow_new_corpus",
                     "bleu_sentences", "eval_every", "out", "resume", "overwrite")


def _same(a, b) -> bool:
    if isinstance(a, Path) and isinstance(b, Path):
        return a.resolve() == b.resolve()
    return a == b


def say_resumed_backend(saved: str | None, asked: str | None, chosen: str | None) -> None:
    """One line where a resumed run's backend is not simply the saved one's by default: the
    environment asks for another (kept: the saved), or ``--backend`` switches (the numbers then
    differ from an unbroken run's)."""
    env = os.environ.get("ATTN_BACKEND", "").strip().lower()
    if asked is not None and saved is not None and asked != saved:
        print(f"attn-train: --resume: the run was saved on the {saved} backend and continues on {asked}, as "
              "--backend asks; its dropout masks come from another generator, so its numbers will not match "
              "an unbroken run's", file=sys.stderr)
    elif asked is None and saved is not None and env and env != saved:
        print(f"attn-train: --resume continues on the saved run's backend, {saved} (ATTN_BACKEND={env} applies "
              f"to new runs; pass --backend {env} to switch)", file=sys.stderr)


def say_resumed_engine(saved: dict, config: TrainConfig) -> None:
    """One line where a resumed run switches engine (``--reference`` on a run that the fast engine
    trained): the two draw their dropout masks from other generators, so the numbers then differ
    from an unbroken run's, as with a switch of ``--backend``."""
    if config.engine == "reference" and TrainConfig.from_dict({**saved, "resume": False}).engine == "fast":
        print("attn-train: --resume: the run was trained by the attn.fast engine and continues on the readable "
              "one, as --reference asks; its dropout masks come from another generator, so its numbers will not "
              "match an unbroken run's", file=sys.stderr)


def resumed_config(config: TrainConfig, saved: dict, given=None) -> TrainConfig:
    """The settings of a resumed run: the saved run's (``saved``, a :meth:`TrainConfig.to_dict`),
    with those in :data:`RESUME_MAY_CHANGE` taken from ``config``.

    ``given`` names the fields the user set (the command line passes the flags it saw); by
    default, those where ``config`` differs from the defaults. A given field that contradicts
    the saved run is a :class:`TrainConfigError` naming it.
    """
    base = TrainConfig.from_dict({**saved, "resume": False, "overwrite": False})
    default = TrainConfig()
    if given is None:
        given = {f.name for f in dataclasses.fields(config)
                 if not _same(getattr(config, f.name), getattr(default, f.name))}
    clashes = [f"{_flag(n)} {getattr(config, n)} (the saved run has {getattr(base, n)})"
               for n in sorted(given) if n not in RESUME_MAY_CHANGE
               and not _same(getattr(config, n), getattr(base, n))]
    if clashes:
        raise TrainConfigError(
            f"--resume continues the run in {config.out} with its own settings, but "
            + "; ".join(clashes) + ". Drop the flag(s), or start a new run with another --out. "
            f"A resumed run may change only {', '.join(_flag(n) for n in RESUME_MAY_CHANGE[:-3])}.")
    take = {n: getattr(config, n) for n in RESUME_MAY_CHANGE if n in given or n in ("out", "resume", "overwrite")}
    # The backend too is the saved run's unless --backend is given: $ATTN_BACKEND chooses for new
    # runs, and a run continued on another backend draws other dropout masks (other numbers).
    if config.backend is not None:
        take["backend"] = config.backend
    take.setdefault("backend", base.backend)
    if take.get("reference") and "attention" not in given:
        take["attention"] = "auto"              # the readable engine has no choice of attention to keep
    return dataclasses.replace(base, **take)


#: The BPE vocabulary's size when ``vocab_size`` is not given.
DEFAULT_BPE_SIZE = 8000


def _smallest_vocab(kind: str) -> int:
    return len(SPECIALS) + (len(BYTE_TOKENS) + 1 if kind == "bpe" else 1)


# --------------------------------------------------------------------------- command line

_D = TrainConfig()      # the defaults, quoted in the help


def _recipe(name: str) -> str:
    return ", ".join(f"{preset} {r[name]:g}" if not isinstance(r[name], str) else f"{preset} {r[name]}"
                     for preset, r in RECIPES.items() if r.get(name) is not None)


def build_parser() -> argparse.ArgumentParser:
    """The ``attn-train`` command line. Flags that are not given stay out of the
    namespace (``argparse.SUPPRESS``): :func:`config_from_argv` fills them from
    :class:`TrainConfig`'s defaults, and ``--resume`` knows which ones the user set."""
    p = argparse.ArgumentParser(
        prog="attn-train", argument_default=argparse.SUPPRESS,
        description="Train a Transformer translator. With no arguments: the toy English -> toy-language "
                    "translator in data/toy, on the backend chosen by ATTN_BACKEND (default numpy), "
                    "for at most --minutes of training, writing runs/toy/. "
                    "In Python: attn.train.train(attn.train.TrainConfig(...)), whose fields are these flags. "
                    "Ctrl-C or SIGTERM saves a checkpoint at the next step and exits with status 130 or 143 "
                    "(--resume continues it); a second one aborts without saving. Errors exit with status 2.",
        epilog="examples:\n"
               "  attn-train                                   # the toy translator\n"
               "  attn-train --backend cupy                    # the same on a GPU\n"
               "  attn-train --data multi30k --src de --tgt en --preset small --minutes 60\n"
               "  attn-train --tsv deu.txt --preset small      # Tatoeba/Anki pairs: src<TAB>tgt\n"
               "  attn-train --resume --out runs/toy           # continue an interrupted run\n"
               "  attn-train --resume-from runs/toy/checkpoint.npz --lora 8 --reference --data other --out runs/ft",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_data_flags(p.add_argument_group("data"))
    _add_model_flags(p.add_argument_group("model"))
    _add_block_flags(p)
    g = p.add_argument_group("training")
    _add_budget_flags(g)
    _add_evaluation_flags(g)
    _add_run_flags(g)
    return p


def _add_data_flags(g) -> None:
    """The corpus, its languages and its vocabulary."""
    g.add_argument("--task", choices=list(TASKS), help="translate (default): a translator; lm: a language model "
                                                        "of --text (a decoder-only stack of the same block)")
    g.add_argument("--text", type=Path, metavar="FILE", help="lm: the text to learn (.gz too; default: tiny "
                   "Shakespeare, data/tinyshakespeare); its last 10%% is the validation text")
    g.add_argument("--char", action="store_true", default=argparse.SUPPRESS,
                   help="lm: one token a character (default: the preset's recipe, else BPE pieces)")
    g.add_argument("--context", type=int, metavar="N", help="lm: tokens per sequence (default: the recipe's, else 64)")
    g.add_argument("--batch", type=int, metavar="N", help="lm: sequences per step (default: the recipe's, else 12)")
    g.add_argument("--data", type=Path,
                   help="folder with {train,val,test}.{SRC,TGT} line-aligned files (default: the toy corpus)")
    g.add_argument("--src", help=f"source language suffix (default: {_D.src})")
    g.add_argument("--tgt", help=f"target language suffix (default: {_D.tgt})")
    g.add_argument("--tsv", type=Path, help="tab-separated pairs file instead of --data; 5%% each held out for val/test")
    g.add_argument("--min-freq", type=int,
                   help=f"drop words seen fewer times in training (-> <unk>; default: the preset's, {_recipe('min_freq')})")
    g.add_argument("--max-len", type=int, help="skip training pairs longer than this many tokens (default: the preset's max_len)")
    g.add_argument("--vocab", choices=["word", "bpe"],
                   help=f"word: words and punctuation as written; bpe: subword pieces learned on both languages "
                        f"(byte-pair encoding; no <unk>) (default: the preset's, {_recipe('vocab')})")
    g.add_argument("--vocab-size", type=int, metavar="N",
                   help=f"with --vocab bpe: the vocabulary's size, e.g. 8000 (default: the preset's, "
                        f"{_recipe('vocab_size')}; else {DEFAULT_BPE_SIZE}); "
                        "with --vocab word: keep the N most frequent (default: all)")


def _add_model_flags(g) -> None:
    """The model's size, over the preset's."""
    g.add_argument("--preset", choices=sorted(PRESETS), help=f"model size (default: {_D.preset})")
    g.add_argument("--d-model", type=int, help="override the preset's d_model")
    g.add_argument("--heads", type=int, help="override the number of attention heads")
    g.add_argument("--d-ff", type=int, help="override the feed-forward width")
    g.add_argument("--layers", type=int, help="override the number of encoder and decoder layers")
    g.add_argument("--dropout", type=float, help="override the residual dropout")
    g.add_argument("--label-smoothing", type=float, help="override label smoothing epsilon")
    g.add_argument("--dtype", choices=["float32", "float64"], help=f"default {_D.dtype}")


def _add_budget_flags(g) -> None:
    """The backend, how long to train, and the schedule of the updates."""
    g.add_argument("--backend", choices=["numpy", "cupy", "auto"],
                   help="array backend (default: $ATTN_BACKEND or numpy; a resumed run keeps its saved backend "
                        "unless this flag is given)")
    g.add_argument("--minutes", type=float,
                   help=f"wall-clock budget for training, in minutes (0: no limit; default {_D.minutes:g})")
    g.add_argument("--steps", type=int, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--epochs", type=int, help="stop after this many epochs (0: no limit)")
    g.add_argument("--max-tokens", type=int,
                   help=f"tokens per batch, padding included (default: the preset's, {_recipe('max_tokens')}; "
                        f"at most {MAX_BATCH_TOKENS:,}, the global batch under mpiexec)")
    g.add_argument("--warmup", type=int,
                   help=f"warm-up steps of the schedule (default: the preset's, or {round(WARMUP_FRACTION * 100)}%% of the "
                        "steps that --minutes/--steps/--epochs allow when that is shorter, with the peak learning "
                        "rate of the preset's schedule; --minutes measures the step time first)")
    g.add_argument("--lr-factor", type=float,
                   help=f"multiplies the section-5.3 learning rate (default: the preset's, {_recipe('lr_factor')}; "
                        "the toy model's d_model of 128 would peak at 4.4e-3 with 1, where it learns markedly slower)")
    g.add_argument("--cooldown", type=float, metavar="F",
                   help="the learning rate falls linearly to 0 over the last F of the budget (--minutes, --steps "
                        f"or --epochs, whichever runs out first), e.g. 0.3 (0: off; default: the preset's, "
                        f"{_recipe('cooldown')}; not with --cuda-graph)")
    g.add_argument("--clip", type=float, help="clip the global gradient norm to this (0: off, the default)")


def _add_evaluation_flags(g) -> None:
    """The seed, validation, averaging and the final test translation."""
    g.add_argument("--seed", type=int, help=f"seed for weights, batch order and dropout (default {_D.seed})")
    g.add_argument("--eval-every", type=int,
                   help=f"validate and checkpoint every N steps (default {_D.eval_every})")
    g.add_argument("--bleu-sentences", type=int,
                   help=f"validation sentences translated for the periodic BLEU (0: skip; default {_D.bleu_sentences})")
    g.add_argument("--average", type=int,
                   help="average the parameters of the last K snapshots for the final model, written to "
                        "OUT/averaged.npz and used for the test BLEU (section 6.1; 0 or 1: off; "
                        f"default {_D.average})")
    g.add_argument("--snapshot-every", type=int,
                   help=f"steps between the snapshots that --average uses (default {_D.snapshot_every})")
    g.add_argument("--beam", type=int,
                   help=f"beam size for the final test translation (1: greedy; default: the preset's, {_recipe('beam')})")
    g.add_argument("--alpha", type=float,
                   help=f"the length penalty of that beam search, ((5+|Y|)/6)**A (default: the preset's, {_recipe('alpha')})")
    g.add_argument("--no-repeat-ngram", type=int, metavar="N",
                   help="no test translation repeats one of its own N-grams of tokens (0: off; default: the "
                        f"preset's, {_recipe('no_repeat_ngram')})")


def _add_run_flags(g) -> None:
    """The run's folder, the engine and its precision, and what is printed."""
    g.add_argument("--out", help=f"output folder (default {_D.out}); one run at a time: a second run on a "
                                 "folder in use is refused")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in OUT from its checkpoint, with its saved settings and seed; "
                        f"only {', '.join(_flag(n) for n in RESUME_MAY_CHANGE[:-3])} may be given anew")
    g.add_argument("--allow-new-corpus", action="store_true",
                   help="with --resume: continue even though the corpus's training files changed since the run "
                        "was saved (by default a resumed run refuses another corpus)")
    g.add_argument("--overwrite", action="store_true",
                   help="a fresh run into an OUT that holds a run deletes that run's files first "
                        "(without it, such an OUT is an error)")
    g.add_argument("--reference", action="store_true",
                   help="train with the readable reference layers instead of the faster attn.fast path "
                        "(same numbers up to float rounding, slower)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="on a GPU (--backend cupy, the attn.fast engine, one process): capture the training step "
                        "as a CUDA graph per batch shape and replay it, one launch a step instead of hundreds; "
                        "batches are padded to shapes from a short list (lengths to multiples of 8, rows to 16), "
                        "which changes the dropout masks but not the loss or the gradients")
    g.add_argument("--precision", choices=list(PRECISIONS),
                   help="what the training step's matrix products read: fp32 (the default and the reference), "
                        "tf32 (10 stored significand bits; on a GPU cuBLAS's TF32 tensor-op math) or bf16 (7 bits, "
                        "bfloat16 operands); their sums, the weights (fp32 master weights), gradients and Adam stay "
                        "float32. On NumPy the operands are rounded the same way and multiplied in float32. The "
                        "attn.fast engine only (not --reference); a resumed run keeps "
                        "its saved precision")
    g.add_argument("--attention", choices=["auto", "plain", "flash"],
                   help="the attn.fast engine's attention: plain (the weights kept for the backward), flash (tiled, "
                        "FlashAttention: memory linear in the length, no attention dropout) or auto (default: the "
                        "rule of docs/GPU.md, tiled where the plain one's weights would not fit); same numbers")
    g.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="fine-tune: start from CHECKPOINT's weights and vocabulary (written by attn-train) on this "
                        "run's corpus, into a new --out; with --reference")
    g.add_argument("--lora", type=int, metavar="RANK",
                   help="with --resume-from: freeze the weights and train LoRA adapters of this rank alone; OUT/"
                        "adapter.npz holds them (attn-translate --adapter and attn-export --adapter merge them)")
    g.add_argument("--lora-targets", metavar="LIST",
                   help="the projections of every attention that get an adapter, among q,k,v,o (default q,v)")
    g.add_argument("--lora-alpha", type=float, metavar="A",
                   help="the adapters' update is scaled by A / RANK (default 2 * RANK)")
    g.add_argument("--quiet", action="store_true", help="no progress bars (training's and the test's); each evaluation's line and the summary at the "
                        "end still print")


def _add_block_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the block's parts: the norm and its place, positions, the feed-forward network,
    grouped-query attention (each None by default: the preset's, the paper's)."""
    g = parser.add_argument_group("the block (default: the paper's, but small's rotary positions, chosen on "
                                  "Multi30k in lesson 28; lesson 26 derives the others)")
    g.add_argument("--norm-position", "--norm", choices=list(KINDS["norm_position"]),
                   help="where the norm sits: after each sub-layer's residual sum (post, the paper) or before "
                        "the sub-layer (pre, every later model); --norm is its older name")
    g.add_argument("--norm-kind", choices=list(KINDS["norm_kind"]),
                   help="the norm: layer norm (the paper) or RMSNorm (no mean subtracted, no shift)")
    g.add_argument("--positional", choices=list(KINDS["positional"]),
                   help="positions: the paper's sinusoids, a learned table, or rotary positions on the queries and keys "
                        f"(default: the preset's, {_recipe('positional')}; else sinusoidal)")
    g.add_argument("--ffn", choices=list(KINDS["ffn"]),
                   help="the feed-forward network: ReLU (equation 2) or SwiGLU (at 2/3 of --d-ff, the same parameters)")
    g.add_argument("--kv-heads", type=int, metavar="N",
                   help="key/value heads of every attention, dividing --heads (grouped-query attention; 1: multi-query)")
    g.add_argument("--qk-norm", action="store_true", default=None,
                   help="QK-norm (OLMo 2, Gemma 3): RMSNorm over each head's queries and keys before the scores, "
                        "in every attention")


def config_from_argv(argv=None) -> TrainConfig:
    """The :class:`TrainConfig` that an ``attn-train`` command line asks for.

    Raises SystemExit (argparse's usage message) for an unknown flag and
    :class:`TrainConfigError` for a value out of range."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))
