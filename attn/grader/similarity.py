"""``attn-check --class DIR --similarity``: which learners' files are alike, how much of each
is the library's own source, and which execute code they carry as a blob.

copydetect fingerprints the files (token winnowing with names normalised; the starter's own
text discounted as boilerplate) from the text the grader read once; the page is attn-check's
own, every learner's text escaped (copydetect's template prints paths raw). The library's
share of a file is the part of its fingerprints found in the library's source, all files
together: a paste of four library files counts as much as a paste of one. An optional
dependency: the ``teach`` extra installs copydetect."""
from __future__ import annotations

import ast
import html
import io
from pathlib import Path

from .library import EXERCISES

ROOT = Path(__file__).resolve().parents[2]
#: copydetect's k-gram length and winnowing window (its defaults: noise 25, guarantee 30).
K, WINDOW = 25, 1
#: A pair, or a file and the library, are listed from this similarity on.
SHOWN = 0.5
#: Calls that run code built at run time, and calls that unpack a blob.
RUNS = {"exec", "eval", "compile", "__import__", "exec_module", "loads", "run_path", "run_module"}
UNPACKS = {"decompress", "b64decode", "b85decode", "a85decode", "b32decode", "b16decode", "unhexlify", "decode",
           "fromhex", "loads"}
#: Unpackers no layer needs: flagged whatever their argument (a blob split into pieces is one too).
CODECS = UNPACKS - {"decode", "loads"}
#: Names through which a file reaches exec and eval by a string (the builtins' dictionary).
BUILTINS = {"__builtins__", "builtins", "__dict__", "__globals__"}
#: Codecs that unpack a blob (``codecs.decode(text, "base64")``).
CODEC_NAMES = {"base64", "base_64", "base64_codec", "zlib", "zip", "zlib_codec", "bz2", "hex", "hex_codec", "rot13",
               "rot_13", "uu", "quopri"}
#: Characters of literals without a space, all of a file's together, from which they are a blob.
BLOB = 2000


def _library_sources() -> list[Path]:
    package = Path(__file__).resolve().parents[1]
    return sorted((package / "layers").glob("*.py")) + [package / p for p in ("masks.py", "loss.py", "optim.py",
                                                                              "decode.py", "bpe.py", "model.py")] \
        + [Path(__file__).with_name("solutions.py")]


def executed_blobs(source: str) -> list[str]:
    """Where ``source`` runs code it builds at run time (exec, eval, compile, marshal or pickle
    loads, an import of a module made from a string), reaches them by a string (the builtins'
    dictionary, a name in a literal or built from pieces), unpacks encoded data (base64, zlib,
    hex), or carries literals without a space of more than ``BLOB`` characters in all (a blob,
    whole or split): one line each, "line N: what"."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found, pieces = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in RUNS and not (name == "__import__" and node.args and isinstance(node.args[0], ast.Constant)):
                if name != "loads" or _module_of(node.func) in ("marshal", "pickle"):
                    found.append(f"line {node.lineno}: calls {name}(), which runs code made at run time")
            elif name in CODECS or name in UNPACKS and name != "loads" and _long_literal_in(node):
                found.append(f"line {node.lineno}: {name}() unpacks encoded data")
        elif isinstance(node, (ast.Name, ast.Attribute, ast.alias)) and _named(node) in BUILTINS:
            found.append(f"line {getattr(node, 'lineno', 1)}: reaches {_named(node)}, where exec and eval are looked "
                         "up by a string")
        elif isinstance(node, ast.Constant) and _folded(node.value) in CODEC_NAMES and _in_call(tree, node):
            found.append(f"line {node.lineno}: decodes with the {_folded(node.value)} codec")
        elif isinstance(node, ast.Constant) and _folded(node.value) in RUNS - {"loads"} | BUILTINS:
            found.append(f"line {node.lineno}: names {_folded(node.value)} in a string")
        elif isinstance(node, ast.BinOp) and _folded(_concatenated(node)) in RUNS - {"loads"}:
            found.append(f"line {node.lineno}: builds the name {_folded(_concatenated(node))} from pieces")
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and len(node.value) >= 16 \
                and not any(c.isspace() for c in _folded(node.value)):
            pieces.append(node)
    if sum(len(n.value) for n in pieces) > BLOB:
        found.append(f"line {pieces[0].lineno}: literals of {sum(len(n.value) for n in pieces):,} characters "
                     "without a space in all (a blob, whole or in pieces?)")
    return sorted(set(found), key=lambda s: int(s.split()[1].rstrip(":")))


def _in_call(tree, const) -> bool:
    return any(isinstance(n, ast.Call) and any(a is const for a in n.args + [k.value for k in n.keywords])
               for n in ast.walk(tree))


def _named(node) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else node.name


def _folded(value) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value if isinstance(value, str) else ""


def _concatenated(node):
    """The string a ``+`` of literals makes ("ex" + "ec"), or None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _concatenated(node.left), _concatenated(node.right)
        if type(left) is type(right) and left is not None:
            return left + right
    return None


def _module_of(func) -> str:
    return func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""


def _long_literal_in(call: ast.Call) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes)) and len(n.value) > 200
               for n in ast.walk(call))


def _fingerprint(name: str, text: str, boilerplate=None):
    from copydetect import CodeFingerprint
    return CodeFingerprint(name, K, WINDOW, boilerplate=boilerplate, fp=io.StringIO(text))


def similarity_report(subs: list, out_file: Path, out) -> list:
    """Compare every pair of files of one exercise, and each with the library's source.
    ``subs``: the class's files as :func:`attn.grader.classes.submissions` read them. Writes
    an HTML page to ``out_file``; returns (similarity, file, other) rows, most alike first,
    and prints the first ten."""
    try:
        from copydetect import compare_files
    except ImportError:
        out.write("attn-check: --similarity needs copydetect (pip install 'attn[teach]')\n")
        return []
    library = set()
    for src in _library_sources():
        if src.is_file():
            library |= set(_fingerprint(str(src), src.read_text(encoding="utf-8")).hashes)
    prints = {}
    for sub in subs:
        starter = ROOT / "lessons" / "exercises" / f"{sub['exercise']}.py"
        boiler = (list(_fingerprint(str(starter), starter.read_text(encoding="utf-8")).hashes)
                  if sub["exercise"] in EXERCISES and starter.is_file() else None)
        prints[sub["file"]] = _fingerprint(sub["file"], sub["source"][0], boiler)
    rows = []
    for i, a in enumerate(subs):
        fa = prints[a["file"]]
        share = len(set(fa.hashes) & library) / max(1, len(fa.hashes))
        if share >= SHOWN:
            rows.append((share, a["file"], "the library's own source"))
        for b in subs[i + 1:]:
            if b["exercise"] == a["exercise"]:
                _, (sim_a, sim_b), _ = compare_files(fa, prints[b["file"]])
                if max(sim_a, sim_b) >= SHOWN:
                    rows.append((max(sim_a, sim_b), a["file"], b["file"]))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    blobs = [(s["file"], line) for s in subs for line in executed_blobs(s["source"][0])]
    _write_page(rows, blobs, out_file)
    out.write(f"similarity ({len(rows)} pairs over {SHOWN:.0%}; {out_file}):\n")
    for sim, a, b in rows[:10]:
        out.write(f"  {sim:5.0%}  {_printable(a)}  ~  {_printable(b)}\n")
    for file, line in blobs[:10]:
        out.write(f"  runs a blob: {_printable(file)} {line}\n")
    return rows


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def _write_page(rows, blobs, out_file: Path) -> None:
    q = html.escape
    body = ["<!doctype html><meta charset='utf-8'><title>attn-check: similar files</title>",
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:left}</style>",
            f"<h1>attn-check: similar files</h1><p>pairs of one exercise, and files against the library's own "
            f"source, from {SHOWN:.0%} of their fingerprints (copydetect, k={K})</p>",
            "<table><tr><th>similarity</th><th>file</th><th>alike</th></tr>"]
    body += [f"<tr><td>{sim:.0%}</td><td>{q(a)}</td><td>{q(b)}</td></tr>" for sim, a, b in rows]
    body.append("</table><h2>files that run code they carry</h2><table><tr><th>file</th><th>where</th></tr>")
    body += [f"<tr><td>{q(f)}</td><td>{q(line)}</td></tr>" for f, line in blobs]
    body.append("</table>")
    Path(out_file).write_text("\n".join(body) + "\n", encoding="utf-8")
