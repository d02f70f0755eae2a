"""Generate the toy parallel corpus: English ("en") -> a made-up language ("tk").

The corpus is small enough to train a Transformer on a laptop CPU in minutes,
yet a word-by-word lookup cannot translate it: tk moves verbs to the end of
subordinate clauses (and infinitives to the end of every clause), places
adjectives after the noun, makes articles, adjectives and verbs agree with
words elsewhere in the sentence, drops or inserts words, splits some verbs
in two, and reorders numbers
("twenty three" -> "tri e vint"). See data/README.md for the grammar.

Every tk sentence is a deterministic function of its English source (no
random synonyms on the target side), so a perfect model scores BLEU 100.

Usage::

    python data/make_toy.py            # (re)write data/toy/{train,val,test}.{en,tk}
    python data/make_toy.py --check    # regenerate into a temp dir, compare byte for byte
    python data/make_toy.py --stats    # print sizes, vocabularies, lengths, rule frequencies

Only the standard library is used: ``random.Random(seed)`` drives every choice,
and nothing iterates over a set, so the output is byte-identical on every run.
"""
from __future__ import annotations

import argparse
import filecmp
import random
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple

TOY_DIR = Path(__file__).resolve().parent / "toy"
SEED = 20170612  # the day "Attention Is All You Need" appeared on arXiv
SIZES = {"test": 1000, "val": 1000, "train": 30000}  # generated in this order
MIN_LEN, MAX_LEN = 3, 25  # tokens per side, "." included

# --------------------------------------------------------------------------
# Lexicon
# --------------------------------------------------------------------------


class Noun(NamedTuple):
    sg: str  # English singular
    pl: str  # English plural
    tk: str  # tk singular; plural is tk + "en" (class I) or tk + "s" (class II)
    cls: int  # noun class (grammatical gender): 1 or 2


ANIMATE = (
    Noun("man", "men", "vir", 1), Noun("woman", "women", "dona", 2),
    Noun("child", "children", "kindel", 1), Noun("teacher", "teachers", "magistra", 2),
    Noun("king", "kings", "reks", 1), Noun("queen", "queens", "regina", 2),
    Noun("dog", "dogs", "hund", 1), Noun("cat", "cats", "mitsa", 2),
    Noun("bird", "birds", "pulo", 1), Noun("elephant", "elephants", "elefant", 1),
)
THINGS = (
    Noun("book", "books", "libro", 1), Noun("house", "houses", "domo", 1),
    Noun("car", "cars", "karo", 1), Noun("tree", "trees", "arba", 2),
    Noun("apple", "apples", "pomo", 1), Noun("letter", "letters", "letra", 2),
    Noun("garden", "gardens", "hortus", 1), Noun("egg", "eggs", "ovo", 1),
)
NOUNS = ANIMATE + THINGS

# English adjective -> tk stem; the ending agrees with the noun (see ADJ_END).
ADJECTIVES = {
    "big": "grand", "small": "mik", "old": "vet", "young": "jun",
    "red": "rud", "green": "verd", "happy": "fel", "angry": "irat",
}
# Definite article and adjective ending by (noun class, plural?).
ARTICLE = {(1, False): "du", (1, True): "dus", (2, False): "ka", (2, True): "kas"}
ADJ_END = {(1, False): "o", (1, True): "on", (2, False): "a", (2, True): "an"}


class Verb(NamedTuple):
    base: str  # English: see
    s3: str  # English: sees
    past: str  # English: saw
    tk: str  # tk stem: vid (+ person ending, or + "ar" for the infinitive)
    kind: str  # "trans", "sep" (transitive, tk particle + verb), "intr", "clause"
    particle: str = ""  # tk separable particle, for kind "sep"


VERBS = (
    Verb("see", "sees", "saw", "vid", "trans"), Verb("like", "likes", "liked", "am", "trans"),
    Verb("find", "finds", "found", "trov", "trans"), Verb("take", "takes", "took", "pren", "trans"),
    Verb("buy", "buys", "bought", "kup", "trans"), Verb("open", "opens", "opened", "aper", "trans"),
    Verb("call", "calls", "called", "fon", "sep", "tele"),
    Verb("visit", "visits", "visited", "suk", "sep", "bi"),
    Verb("sleep", "sleeps", "slept", "dorm", "intr"), Verb("run", "runs", "ran", "kur", "intr"),
    Verb("sing", "sings", "sang", "kant", "intr"),
    Verb("say", "says", "said", "dik", "clause"), Verb("know", "knows", "knew", "sav", "clause"),
)
ACTION_VERBS = tuple(v for v in VERBS if v.kind != "clause")
CLAUSE_VERBS = tuple(v for v in VERBS if v.kind == "clause")

# Persons: English pronoun -> person code. tk drops subject pronouns (the verb ending
# says who): "i sleep ." -> "dormo ." English "you" is always singular here.
PRONOUNS = {"i": "1sg", "you": "2sg", "he": "3sg", "she": "3sg", "we": "1pl", "they": "3pl"}
VERB_END = {"1sg": "o", "2sg": "as", "3sg": "at", "1pl": "amos", "3pl": "ant"}
INFINITIVE = "ar"
FUTURE_AUX = "ul"  # "will" -> ul + person ending (ulat), the verb moves to the end
PAST, NEG = "ba", "ne"  # tk particles: "saw" -> "ba vidat"; "not" -> "ne" near the end

PREPOSITIONS = {"in": "en", "on": "sur", "near": "pres", "with": "kun"}
CONJUNCTIONS = {"because": "ob"}  # the clause after it is verb-final
THAT = "ke"

EN_UNITS = ("", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
EN_TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen",
            "sixteen", "seventeen", "eighteen", "nineteen")
EN_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
TK_UNITS = ("", "un", "dos", "tri", "kvar", "kin", "ses", "sep", "ok", "nov")
TK_TENS = ("", "dek", "vint", "trent", "kvarant", "kinkant", "sesant", "sepant", "oktant", "novant")
TK_AND = "e"

VOWELS = "aeiou"

# --------------------------------------------------------------------------
# Translation of the pieces: each returns (English tokens, tk tokens)
# --------------------------------------------------------------------------


def number_words(n: int) -> tuple[list[str], list[str]]:
    """2 <= n <= 99. English tens first, tk units first: 23 -> "twenty three" / "tri e vint";
    13 -> "thirteen" / "tri dek" (one word becomes two); 20 -> "twenty" / "vint"."""
    tens, units = divmod(n, 10)
    if tens == 0:
        return [EN_UNITS[units]], [TK_UNITS[units]]
    if tens == 1:
        tk = [TK_TENS[1]] if units == 0 else [TK_UNITS[units], TK_TENS[1]]
        return [EN_TEENS[units]], tk
    if units == 0:
        return [EN_TENS[tens]], [TK_TENS[tens]]
    return [EN_TENS[tens], EN_UNITS[units]], [TK_UNITS[units], TK_AND, TK_TENS[tens]]


class NP(NamedTuple):
    """A noun phrase: [the|a|an] [number] [adj] noun (the generator draws at most one adjective)."""
    noun: Noun
    plural: bool
    definite: bool
    number: int  # 0 for none (plural only)
    adjs: tuple[str, ...]

    @property
    def person(self) -> str:
        return "3pl" if self.plural else "3sg"

    def en(self) -> list[str]:
        words = []
        if self.number:
            words += number_words(self.number)[0]
        words += list(self.adjs) + [self.noun.pl if self.plural else self.noun.sg]
        if self.definite:
            return ["the"] + words
        if not self.plural:  # "a" / "an" by the sound of the next word
            return ["an" if words[0][0] in VOWELS else "a"] + words
        return words

    def tk(self) -> list[str]:
        """Article (definite only) and adjective endings agree with the noun's class
        and number; adjectives follow the noun (several would come in mirror order)."""
        key = (self.noun.cls, self.plural)
        words = [ARTICLE[key]] if self.definite else []
        if self.number:
            words += number_words(self.number)[1]
        noun = self.noun.tk + ("en" if self.noun.cls == 1 else "s") if self.plural else self.noun.tk
        words.append(noun)
        words += [ADJECTIVES[a] + ADJ_END[key] for a in reversed(self.adjs)]
        return words


class Clause(NamedTuple):
    """Subject, verb (tense, polarity), optional object and prepositional phrase."""
    subj: NP | str  # a noun phrase or an English pronoun
    verb: Verb
    tense: str  # "present", "past", "future"
    neg: bool
    obj: NP | None
    prep: str | None
    pp: NP | None

    @property
    def person(self) -> str:
        return PRONOUNS[self.subj] if isinstance(self.subj, str) else self.subj.person

    def en(self) -> list[str]:
        subj = [self.subj] if isinstance(self.subj, str) else self.subj.en()
        v, third = self.verb, self.person == "3sg"
        if self.tense == "future":
            vp = ["will", "not", v.base] if self.neg else ["will", v.base]
        elif self.neg:
            aux = "did" if self.tense == "past" else ("does" if third else "do")
            vp = [aux, "not", v.base]
        else:
            vp = [v.past if self.tense == "past" else (v.s3 if third else v.base)]
        obj = self.obj.en() if self.obj else []
        pp = [self.prep] + self.pp.en() if self.pp else []
        return subj + vp + obj + pp

    def tk(self, subordinate: bool) -> list[str]:
        """Main clause: SUBJ VFIN OBJ PP [ne] [particle] [VINF]  (verb second).
        Subordinate:    SUBJ OBJ PP [ne] [particle] VERB(S)   (verb final).
        Pronoun subjects are dropped; "ba" (past) sits right before the finite verb."""
        subj = [] if isinstance(self.subj, str) else self.subj.tk()
        v, end = self.verb, VERB_END[self.person]
        obj = self.obj.tk() if self.obj else []
        pp = self.pp.tk() + [PREPOSITIONS[self.prep]] if self.pp else []
        tail = ([NEG] if self.neg else []) + ([v.particle] if v.particle else [])
        if self.tense == "future":
            finite, infinite = [FUTURE_AUX + end], [v.tk + INFINITIVE]
        else:
            finite, infinite = ([PAST] if self.tense == "past" else []) + [v.tk + end], []
        if subordinate:
            verbs = infinite + finite
            return subj + obj + pp + tail + verbs
        return subj + finite + obj + pp + tail + infinite


# --------------------------------------------------------------------------
# Random sentences
# --------------------------------------------------------------------------


def random_number(rng: random.Random) -> int:
    """2-9 half the time, 10-19 a fifth, 20-99 the rest."""
    r = rng.random()
    if r < 0.5:
        return rng.randint(2, 9)
    if r < 0.7:
        return rng.randint(10, 19)
    return rng.randint(20, 99)


def random_np(rng: random.Random, nouns: tuple[Noun, ...]) -> NP:
    noun = rng.choice(nouns)
    plural = rng.random() < 0.45
    definite = rng.random() < (0.5 if plural else 0.6)
    number = random_number(rng) if plural and rng.random() < 0.3 else 0
    r = rng.random()
    n_adj = 0 if r < 0.6 else 1
    adjs = tuple(rng.sample(list(ADJECTIVES), n_adj))
    return NP(noun, plural, definite, number, adjs)


def random_clause(rng: random.Random, verbs: tuple[Verb, ...] = ACTION_VERBS,
                  with_pp: bool = True) -> Clause:
    subj = rng.choice(list(PRONOUNS)) if rng.random() < 0.35 else random_np(rng, ANIMATE)
    verb = rng.choice(verbs)
    r = rng.random()
    tense = "present" if r < 0.4 else ("past" if r < 0.75 else "future")
    neg = rng.random() < 0.2
    obj = random_np(rng, NOUNS) if verb.kind in ("trans", "sep") else None
    prep, pp = None, None
    if with_pp and rng.random() < 0.2:
        prep, pp = rng.choice(list(PREPOSITIONS)), random_np(rng, NOUNS)
    return Clause(subj, verb, tense, neg, obj, prep, pp)


def random_pair(rng: random.Random) -> tuple[list[str], list[str]]:
    """One (English, tk) sentence pair as token lists, "." included.

    Kinds: a simple clause (65%); "X says/knows that Y" (17.5%); "X because Y" (17.5%).
    tk puts a comma before the subordinate clause and moves its verbs last.
    """
    r = rng.random()
    if r < 0.65:
        c = random_clause(rng)
        return c.en() + ["."], c.tk(False) + ["."]
    if r < 0.825:
        main, sub = random_clause(rng, CLAUSE_VERBS, with_pp=False), random_clause(rng)
        return (main.en() + ["that"] + sub.en() + ["."],
                main.tk(False) + [",", THAT] + sub.tk(True) + ["."])
    main, sub = random_clause(rng), random_clause(rng)
    return (main.en() + ["because"] + sub.en() + ["."],
            main.tk(False) + [",", CONJUNCTIONS["because"]] + sub.tk(True) + ["."])


def generate(seed: int = SEED, sizes: dict[str, int] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Draw unique English sentences (and their tk translations) for each split.

    Splits are drawn from one stream in the order test, val, train, and an English
    sentence is never drawn twice, so no val or test source appears in train.
    Pairs with a side outside [MIN_LEN, MAX_LEN] tokens are redrawn.
    """
    sizes = dict(SIZES if sizes is None else sizes)
    rng = random.Random(seed)
    seen: dict[str, str] = {}
    splits: dict[str, list[tuple[str, str]]] = {}
    for split in ("test", "val", "train"):
        pairs = []
        while len(pairs) < sizes[split]:
            en, tk = random_pair(rng)
            if not (MIN_LEN <= len(en) <= MAX_LEN and MIN_LEN <= len(tk) <= MAX_LEN):
                continue
            en_line, tk_line = " ".join(en), " ".join(tk)
            if en_line in seen:
                # the translation is a function of the source: same English, same tk
                assert seen[en_line] == tk_line, (en_line, seen[en_line], tk_line)
                continue
            seen[en_line] = tk_line
            pairs.append((en_line, tk_line))
        splits[split] = pairs
    train_src = {en for en, _ in splits["train"]}
    assert not any(en in train_src for split in ("val", "test") for en, _ in splits[split])
    return splits


def write(splits: dict[str, list[tuple[str, str]]], out_dir: Path) -> None:
    """Write OUT/{split}.en and OUT/{split}.tk, one sentence per line, UTF-8, LF."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        for side, lang in ((0, "en"), (1, "tk")):
            text = "".join(p[side] + "\n" for p in pairs)
            (out_dir / f"{split}.{lang}").write_bytes(text.encode("utf-8"))


def file_names(splits) -> list[str]:
    return [f"{s}.{lang}" for s in splits for lang in ("en", "tk")]


def check(out_dir: Path, seed: int, sizes: dict[str, int]) -> int:
    """Regenerate into a temp dir and compare with OUT byte for byte. Returns an exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        write(generate(seed, sizes), Path(tmp))
        bad = [n for n in file_names(sizes)
               if not (out_dir / n).is_file() or not filecmp.cmp(Path(tmp) / n, out_dir / n, shallow=False)]
    if bad:
        print(f"make_toy --check: {', '.join(bad)} in {out_dir} differ from a fresh generation "
              f"(seed {seed}); run `python data/make_toy.py` to rewrite them", file=sys.stderr)
        return 1
    print(f"make_toy --check: {len(file_names(sizes))} files in {out_dir} are byte-identical")
    return 0


# --------------------------------------------------------------------------
# Statistics (read back from the files, so they describe what is on disk)
# --------------------------------------------------------------------------

RULES = {  # rule -> test on the English tokens
    "negation (not)": lambda t: "not" in t,
    "past tense": lambda t: any(w in t for w in ("did",) + tuple(v.past for v in VERBS)),
    "future (will)": lambda t: "will" in t,
    "subordinate clause (that/because)": lambda t: any(w in t for w in ("that", "because")),
    "pronoun subject (dropped in tk)": lambda t: any(w in t for w in PRONOUNS),
    "separable verb (call/visit)": lambda t: any(
        w in t for v in VERBS if v.kind == "sep" for w in (v.base, v.s3, v.past)),
    "number word": lambda t: any(w in t for w in EN_UNITS[2:] + EN_TEENS + EN_TENS[2:]),
    "number 21-99 (reordered)": lambda t: any(a in EN_TENS[2:] and b in EN_UNITS[1:] for a, b in zip(t, t[1:])),
    "adjective": lambda t: any(w in ADJECTIVES for w in t),
    "prepositional phrase": lambda t: any(w in PREPOSITIONS for w in t),
}


def read_lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text(encoding="utf-8").splitlines()]


def stats(out_dir: Path, splits) -> str:
    """A Markdown summary: sentences, vocabulary and length per side, rule frequencies."""
    rows = ["| split | pairs | en vocab | tk vocab | en len min/mean/median/max | tk len min/mean/median/max |",
            "|---|---|---|---|---|---|"]
    data = {s: {lang: read_lines(out_dir / f"{s}.{lang}") for lang in ("en", "tk")} for s in splits}
    for s in splits:
        cells = [s, str(len(data[s]["en"]))]
        cells += [str(len({w for t in data[s][lang] for w in t})) for lang in ("en", "tk")]
        for lang in ("en", "tk"):
            ls = [len(t) for t in data[s][lang]]
            cells.append(f"{min(ls)} / {statistics.mean(ls):.1f} / {statistics.median(ls):g} / {max(ls)}")
        rows.append("| " + " | ".join(cells) + " |")
    all_en = [t for s in splits for t in data[s]["en"]]
    all_tk = [t for s in splits for t in data[s]["tk"]]
    vocab = {lang: {w for s in splits for t in data[s][lang] for w in t} for lang in ("en", "tk")}
    joint = len(vocab["en"] | vocab["tk"])
    lens = [len(t) for t in all_en + all_tk]
    share = sum(6 <= n <= 15 for n in lens) / len(lens)
    train_en = {" ".join(t) for t in data.get("train", {}).get("en", [])}
    leaks = sum(" ".join(t) in train_en for s in splits if s != "train" for t in data[s]["en"])
    out = rows + [
        "",
        f"All splits: en vocabulary {len(vocab['en'])}, tk vocabulary {len(vocab['tk'])}, "
        f"shared (joint) vocabulary {joint} words; "
        f"{share:.0%} of sentences (both sides) have 6-15 tokens; "
        f"val/test sources found in train: {leaks}.",
        "",
        "| rule (seen in the English) | share of all sentences |",
        "|---|---|",
    ]
    out += [f"| {name} | {sum(map(test, all_en)) / len(all_en):.1%} |" for name, test in RULES.items()]
    counts = Counter(w for t in all_tk for w in t)
    rare = min(counts.values())
    out += ["", f"Rarest tk word: {rare} occurrences; rarest en word: "
                f"{min(Counter(w for t in all_en for w in t).values())} occurrences."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=TOY_DIR, help="output folder (default: data/toy)")
    p.add_argument("--seed", type=int, default=SEED)
    for split, n in SIZES.items():
        p.add_argument(f"--{split}", type=int, default=n, metavar="N", help=f"{split} pairs (default {n})")
    p.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare; exit 1 on a difference")
    p.add_argument("--stats", action="store_true", help="print statistics of the files in --out (writes nothing)")
    args = p.parse_args(argv)
    sizes = {s: getattr(args, s) for s in SIZES}
    if args.check:
        return check(args.out, args.seed, sizes)
    if args.stats:
        print(stats(args.out, sizes))
        return 0
    write(generate(args.seed, sizes), args.out)
    print(f"wrote {', '.join(file_names(sizes))} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
