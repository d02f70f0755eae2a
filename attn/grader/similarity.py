"""``attn-check --class DIR --similarity``: which learners' files are alike, and which are
alike the library's own source, by copydetect (token winnowing with names normalised;
the starter's own text discounted as boilerplate). An optional dependency: the ``teach``
extra installs it."""
from __future__ import annotations

from pathlib import Path

from .library import EXERCISES

ROOT = Path(__file__).resolve().parents[2]


def _library_sources() -> list[Path]:
    package = Path(__file__).resolve().parents[1]
    return sorted((package / "layers").glob("*.py")) + [package / p for p in ("masks.py", "loss.py", "optim.py",
                                                                              "decode.py", "bpe.py", "model.py")] \
        + [Path(__file__).with_name("solutions.py")]


def similarity_report(subs: list, out_file: Path, out) -> list:
    """Compare every pair of files of one exercise, and each with the library's source.
    Writes copydetect's HTML report to ``out_file``; returns (similarity, file, other)
    rows, most alike first, and prints the first ten."""
    try:
        from copydetect import CopyDetector
    except ImportError:
        out.write("attn-check: --similarity needs copydetect (pip install 'attn[teach]')\n")
        return []
    detector = CopyDetector(extensions=["py"], noise_t=25, guarantee_t=25, display_t=0.5, autoopen=False,
                            silent=True, out_file=str(out_file))
    exercises = sorted({p.stem for _, p in subs})
    for _, path in subs:
        detector.add_file(str(path), "testref")
    for src in _library_sources():
        if src.is_file():
            detector.add_file(str(src), "ref")
    for name in exercises:
        starter = ROOT / "lessons" / "exercises" / f"{name}.py"
        if name in EXERCISES and starter.is_file():
            detector.add_file(str(starter), "boilerplate")
    detector.run()
    rows = []
    for item in detector.get_copied_code_list():
        sim_a, sim_b, a, b = item[0], item[1], item[2], item[3]
        rows.append((max(sim_a, sim_b), a, b))
    rows.sort(reverse=True)
    detector.generate_html_report()
    out.write(f"similarity ({len(rows)} pairs over 50%; {out_file}):\n")
    for sim, a, b in rows[:10]:
        out.write(f"  {sim:5.0%}  {a}  ~  {b}\n")
    return rows
