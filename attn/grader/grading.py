"""Grading: one layer (its forward on every example first, then its backward, then its
dropout) and one file (every layer it defines, in the child process)."""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, example, given, reject, seed, settings
from hypothesis.errors import Flaky, Unsatisfiable

from .. import backend as B
from ..gradcheck import rel_error
from ..testing import DROPOUT_PROBES, LAYERS, XP, Layer
from ..testing.strategies import SCALE, scaled
from .checks import CHECKS, DROPOUT_DRAWS, EXAMPLE_SHARE, _Args, _entries, check_dropout, check_pair
from .results import (DEFAULT_EXAMPLES, DEFAULT_TIMEOUT, EXAMPLE_SEED, Failure, Fatal, FileReport, LoadError,
                      NotImplementedYet, Result, _Todo, plain)
from .reports import report, summary
from .library import EXERCISES, manifest_for, reference
from .sandbox import Remote, Sandbox, describe, read_source

np = B.host

#: The final profile (``--seed``): lengths and widths up to this many times the defaults.
FINAL_SCALE = 3

#: The phases of a layer's search: the last shrinks a failing example to the smallest that fails
#: (tests/test_hints.py leaves it out where the example's size is not what it checks).
PHASES = (Phase.explicit, Phase.generate, Phase.shrink)

# ----------------------------------------------------------------------------- grading a layer


@contextlib.contextmanager
def _the_seeds_examples_alone():
    """Hypothesis (from 6.131) now and then draws a constant found in the source of the local
    modules loaded so far, and caches what it found: a layer's examples would depend on what the
    process imported before and on every literal of the library (a layer added, another layer's
    examples changed). The grader draws without them, so that its examples are its seed's."""
    try:
        from hypothesis.internal.conjecture import providers
        empty = type(providers._local_constants)(**{f: type(v)(key=getattr(v, "key", None))
                                                    for f, v in vars(providers._local_constants).items()})
        real, cache = providers._get_local_constants, providers.CONSTANTS_CACHE
    except (ImportError, AttributeError, TypeError):     # another Hypothesis: nothing to take out
        yield
        return
    providers._get_local_constants = lambda: empty
    cache.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = real
        cache.cache.clear()


#: Each layer's examples for a profile, in the order a check meets them (its explicit examples
#: first, then what hypothesis draws): ``(layer, examples, seed, scale) -> [Example]``, drawn
#: once per process (and once per class: ``attn-check --class`` draws them before its workers
#: start, and hands them in). Every file meets these same examples; a file that passes them all
#: never waits on hypothesis.
DRAWN: dict = {}


def _hypothesis(layer: Layer, examples: int, seed_: int | None, body):
    """``body(ex)`` as a hypothesis test over the layer's examples: the layer's explicit examples
    first, in every profile, then (the final profile's, ``seed_``) the default profile's hard
    examples, then what hypothesis draws."""
    # A fixed seed, not derandomize (which seeds from this function's source): the same
    # examples for every file and every version of the grader.
    @settings(max_examples=examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, verbosity=Verbosity.quiet,
              phases=PHASES)
    @seed(EXAMPLE_SEED if seed_ is None else seed_)
    @given(layer.examples)
    def run(ex):
        body(ex)

    extra = list(layer.explicit)
    if seed_ is not None:
        extra += _hard_examples(layer, examples)
    for ex in reversed(extra):                  # the last applied runs first: in the order declared
        run = example(_copy(ex))(run)
    return run


def share(layer: Layer, examples: int) -> int:
    """The examples ``layer``'s check meets at ``--examples`` (:data:`EXAMPLE_SHARE`)."""
    return max(1, round(examples * EXAMPLE_SHARE.get(layer.name, 1.0)))


def draw_for(exercises, examples: int = DEFAULT_EXAMPLES, seed_: int | None = None) -> dict:
    """Draw, into :data:`DRAWN`, the examples of every layer ``exercises`` ask for in a profile
    (what ``attn-check --class`` does once, before its workers start); returns :data:`DRAWN`."""
    asks = {f for e in exercises for f in EXERCISES[e].asks}
    with scaled(FINAL_SCALE) if seed_ is not None else contextlib.nullcontext():
        for layer in LAYERS.values():
            if asks & set(layer.functions):
                drawn(layer, share(layer, examples), seed_)
    return DRAWN


def drawn(layer: Layer, examples: int, seed_: int | None = None) -> list:
    """The examples :func:`_run` meets for ``layer`` at the current scale (:data:`DRAWN`);
    ``examples`` already the layer's share of ``--examples``."""
    key = (layer.name, examples, seed_, SCALE[0])
    if key not in DRAWN:
        got = []
        with _the_seeds_examples_alone():
            _hypothesis(layer, examples, seed_, got.append)()
        DRAWN[key] = got
    return DRAWN[key]


def _copy(ex):
    """An example of :data:`DRAWN` for one check: its own arrays (a call may write into them)."""
    return copy.deepcopy(ex, {id(XP): XP})


class _Examples:
    """``fn(ex)`` as one example of a layer's run: counts the examples, resets the sandbox before
    each, marks a failure with its example (and whether it was one of the ``explicit`` examples
    every run meets first), and sets aside, rejecting its example, a failure that fits several
    typical mistakes at once (in ``ambiguous``)."""

    def __init__(self, sandbox: Sandbox, fn, explicit: int):
        self.sandbox, self.fn, self.explicit = sandbox, fn, explicit
        self.count, self.ambiguous = 0, []

    def __call__(self, ex):
        self.count += 1
        self.sandbox.reset()
        try:
            self.fn(ex)
        except Failure as e:
            e.example, e.explicit = ex, self.count <= self.explicit
            if e.ambiguous:
                self.ambiguous.append(e)
                reject()
            raise
        except NotImplementedYet as e:          # nothing to shrink: stop at once
            raise _Todo(e) from None
        except Fatal as e:
            e.failure.example, e.failure.explicit = ex, self.count <= self.explicit
            raise


def _run(layer: Layer, sandbox: Sandbox, fn, examples: int, seed_: int | None = None, replay: bool = True):
    """``fn(ex)`` over the layer's examples; returns (runs, the failure or None). With ``replay``
    (a check that rejects no example), the examples of :func:`drawn` in turn; only when one
    fails does hypothesis run them again, to shrink the failure to its smallest example.
    A failure that fits several typical mistakes at once is set aside while hypothesis looks
    for (and shrinks) one that tells them apart; it is the answer only if none does."""
    examples = share(layer, examples)
    explicit = len(layer.explicit) if Phase.explicit in PHASES else 0      # every run meets them first
    if replay:
        body = _Examples(sandbox, fn, explicit)
        done = _replay(layer, examples, seed_, body)
        if done is not None:
            return done
    body = _Examples(sandbox, fn, explicit)
    failure = _search(layer, examples, seed_, body, replay)
    return body.count, failure


def _replay(layer: Layer, examples: int, seed_: int | None, body: _Examples):
    """``body`` over the examples of :func:`drawn` in turn: (runs, None) if all pass, (runs, the
    answer) on what stops a run at once, None on a failure for hypothesis to shrink."""
    try:
        for ex in drawn(layer, examples, seed_):
            body(_copy(ex))
        return body.count, None
    except _Todo as e:                          # hypothesis too stops at once on these
        return body.count, e.todo
    except Fatal as e:
        return body.count, e.failure
    except Exception:
        return None


def _search(layer: Layer, examples: int, seed_: int | None, body: _Examples, replay: bool):
    """``body`` as hypothesis's test over the layer's examples: the failure it finds and shrinks
    (the smallest ambiguous one if it finds no other), or None."""
    try:
        with _the_seeds_examples_alone():
            _hypothesis(layer, examples, seed_, body)()
        if replay and not body.ambiguous:       # failed a moment ago, passes now
            raise Flaky("passed when hypothesis ran the examples again")
        return _smallest(body.ambiguous)
    except Unsatisfiable:
        return _smallest(body.ambiguous)
    except _Todo as e:
        return e.todo
    except (Failure, NotImplementedYet) as e:
        return e
    except Fatal as e:
        return e.failure
    except Flaky as e:
        inner = next((x for x in getattr(e, "exceptions", ()) if isinstance(x, (Failure, NotImplementedYet))), None)
        return inner or Failure("repeatability", "the same input gave different results on two calls",
                                look="an unseeded random number, or state kept between calls (globals, "
                                     "attributes)")
    except Exception as e:      # a bug of attn-check's own: say so, without a traceback for the learner
        return Failure("attn-check", f"attn-check itself failed: {type(e).__name__}: {e}",
                       look="not your code's fault: please report it with this file")


def _smallest(failures: list):
    """The failure of the fewest array entries, or None."""
    size = lambda f: sum(getattr(v, "size", 1) for _, v in f.example.args)     # noqa: E731
    return min(failures, key=size, default=None)


def _hard_examples(layer: Layer, examples: int) -> list:
    """The hard examples (those too hard for a gradient check: logits of 1e4, fully masked or
    constant rows) among what the default profile draws for ``layer``, at its sizes (its explicit
    examples left out: every profile runs those): the final profile runs them whatever its seed."""
    with scaled(1):
        got = drawn(layer, examples)
        return [ex for ex in got[len(layer.explicit) if Phase.explicit in PHASES else 0:] if not ex.gradcheck]


def _attach_outputs(layer: Layer, impl: dict, f: Failure, drop=()) -> None:
    """For the HTML report: the learner's output and the library's on the failing example,
    where the failure (an invariant, say) did not already compare them."""
    if f.arrays is not None or f.example is None or f.fatal:
        return
    try:
        ref_f = reference(layer.name)[0]
        want = B.to_host(ref_f(*_Args(f.example).call())[0])
        got = impl[layer.functions[0]](*_Args(f.example, drop=drop).call())
        got = B.to_host(got[0] if isinstance(got, tuple) else got)
        if got.shape == want.shape and want.dtype.kind == "f":
            f.arrays = (got, want)
            if not f.entries:
                f.entries = _entries(got, want)
            if f.error is None and not np.array_equal(got, want):
                f.error = rel_error(got, want)
            f.outputs_agree = not f.entries
    except (Exception, Fatal):
        pass


@dataclass
class _Grading:
    """What grading one layer carries from step to step: the layer, the learner's functions,
    the sandbox and profile they run in, the functions graded (``names``), the report's note,
    and when it began."""
    layer: Layer
    impl: dict
    sandbox: Sandbox
    examples: int
    seed: int | None
    drop: tuple
    names: list
    note: str
    t0: float

    def check(self, phase: str) -> tuple:
        """:func:`check_pair` in ``phase`` over the layer's examples: (runs, the failure or None)."""
        return _run(self.layer, self.sandbox, lambda ex: check_pair(self.layer, self.impl, ex, phase, self.drop),
                    self.examples, self.seed, replay=not self.drop)

    def result(self, status: str, runs: int, detail=None, blame: str = "", also: str = "",
               note: str | None = None) -> Result:
        return Result(self.layer.name, status, time.perf_counter() - self.t0, runs, detail,
                      self.note if note is None else note, blame, also, self.names)


def grade(layer: Layer, impl: dict, sandbox: Sandbox, examples: int = DEFAULT_EXAMPLES, given_forward: bool = False,
          forward_only: bool = False, drop=(), seed: int | None = None) -> Result:
    """Grade one layer: its forward first (every example), then its backward (against the
    library's if the forward passed, against central differences of the learner's own
    forward if not), then its dropout."""
    t0 = time.perf_counter()
    sandbox.begin_layer()
    names = [n for n in layer.functions if n in impl and not (given_forward and n == layer.functions[0])]
    note = ""
    if drop:
        note = (f"dropout not graded: {layer.functions[0]} takes no dropout argument (lesson 12 teaches it; add "
                "`dropout=0.0, rng=None` then)")
    g = _Grading(layer, impl, sandbox, examples, seed, drop, names, note, t0)
    if layer.kind != "pair":
        return _grade_function(g)
    fname, bname = layer.functions
    runs = 0
    if not given_forward:
        runs, err = g.check("forward")
        if isinstance(err, NotImplementedYet):
            return g.result("todo", runs, err)
        if err is not None:
            err.blame = fname
            return _forward_failed(g, err, runs)
    if bname not in impl:
        n = f"forward only: {bname} is not defined, gradients not checked"
        if forward_only:
            return g.result("pass", runs, note="; ".join(x for x in (n, note) if x))
        return g.result("incomplete", runs, note="; ".join(x for x in (n + " (--forward-only accepts that)", note)
                                                           if x))
    n, err = g.check("backward")
    runs += n
    if isinstance(err, NotImplementedYet):
        return g.result("todo", runs, err)
    if err is not None:
        blame = fname if err.check in ("forward", "float32") else bname
        err.blame = blame
        return g.result("fail", runs, err, blame=blame)
    if layer.name in DROPOUT_PROBES and not drop:
        failed = _grade_dropout(g, runs)
        if failed is not None:
            return failed
        runs += DROPOUT_DRAWS + 3
    if given_forward:
        note = "; ".join(x for x in (f"{fname} is the library's, as the exercise gives it: {bname} graded", note) if x)
    return g.result("pass", runs, note=note)


def _grade_function(g: _Grading) -> Result:
    """A layer that is one plain function (no forward/backward pair): its check on every example."""
    runs, err = _run(g.layer, g.sandbox, lambda ex: CHECKS[g.layer.kind](g.layer, g.impl, ex), g.examples, g.seed)
    if err is None:
        return g.result("pass", runs)
    if isinstance(err, NotImplementedYet):
        return g.result("todo", runs, err)
    return g.result("fail", runs, err, blame=g.layer.functions[0])


def _forward_failed(g: _Grading, failure: Failure, runs: int) -> Result:
    """A forward that failed: the outputs attached for the report and, where there is a backward,
    what it does against central differences of the learner's own forward."""
    if failure.check == "attn-check":
        return g.result("fail", runs, failure)
    fname, bname = g.layer.functions
    has_bwd = bname in g.impl
    _attach_outputs(g.layer, g.impl, failure, g.drop)
    also = ""
    if has_bwd and failure.check != "integrity" and not failure.message.startswith(fname + " "):
        n, err = g.check("self")
        runs += n
        if isinstance(err, NotImplementedYet):
            also = f"{bname}: not implemented yet"
        elif err is None:
            also = (f"{bname} agrees with central differences of your own forward (it was not compared with "
                    "the library's, whose forward differs from yours): fix the forward, then run this again")
        else:
            also = (f"{bname} also disagrees with central differences of your own forward: {err.message}"
                    + (f" (relative error {err.error:.3g})" if err.error is not None else ""))
    r = g.result("fail", runs, failure, blame=fname, also=also)
    r.forward_first = has_bwd and failure.check != "integrity"
    return r


def _grade_dropout(g: _Grading, runs: int) -> Result | None:
    """:func:`check_dropout` on a pair that passed: its failure's Result, or None."""
    fname, bname = g.layer.functions
    g.sandbox.reset()
    try:
        check_dropout(g.layer, g.impl)
    except Fatal as e:
        e.failure.blame = fname
        return g.result("fail", runs, e.failure, blame=fname)
    except NotImplementedYet as e:
        return g.result("todo", runs, e)
    except Failure as f:
        blame = bname if "backward" in f.look or f.message.startswith("d") else fname
        f.blame = blame
        return g.result("fail", runs, f, blame=blame)
    return None

# ----------------------------------------------------------------------------- grading a file


def _layer_table() -> str:
    return "\n".join(f"  {n:<22} {', '.join(layer.functions)}" for n, layer in LAYERS.items())


def _reexport(layer: Layer, name: str, origin: dict) -> Result:
    f = Failure("integrity", f"{name} is the library's own ({origin['defined']}), re-exported: attn-check grades "
                             "your code", look="write the body yourself; import the library as a module (from attn "
                             "import layers as L) only to call its other layers")
    return Result(layer.name, "fail", 0.0, 0, f, blame=name, functions=(name,))


def _missing(layer: Layer, names: list, why: str) -> Result:
    f = Failure("missing", f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {why}",
                look="write every function the exercise's starter asks for, under its name")
    return Result(layer.name, "fail", 0.0, 0, f, blame=names[0], functions=tuple(names))


def _plan(found: dict, sandbox: Sandbox, manifest, layers, allow_library: bool) -> tuple[list, list]:
    """(layer, implementation or a Result already decided, given forward, deferred dropout) for
    every layer graded, and the names the file imported from the library without writing them."""
    plan, imported = [], []
    asks = set(manifest.asks) if manifest else None
    given = set(manifest.given_forwards) if manifest else set()
    for name, layer in LAYERS.items():
        if layers and name not in layers:
            continue
        present = [n for n in layer.functions if n in found]
        if asks is not None:
            wanted = [n for n in layer.functions if n in asks]
            if not wanted:
                continue
            absent = [n for n in wanted if n not in found]
            if absent:
                plan.append((layer, _missing(layer, absent, "not defined in the file (the exercise asks for "
                                                            + ("it" if len(absent) == 1 else "them") + ")"),
                             False, ()))
                continue
        elif not present:
            continue
        lib = [n for n in present if found[n]["library"] and not allow_library]
        if layer.kind != "pair":
            plan.append((layer, _reexport(layer, present[0], found[present[0]]) if lib else
                         {present[0]: Remote(sandbox, present[0])}, False, ()))
            continue
        fname, bname = layer.functions
        if bname in lib:
            plan.append((layer, _reexport(layer, bname, found[bname]), False, ()))
        elif bname in present:
            if fname in given:
                impl = {fname: Remote(sandbox, fname, given=True), bname: Remote(sandbox, bname)}
                plan.append((layer, impl, True, ()))
            elif fname not in present:
                plan.append((layer, _missing(layer, [fname], "not defined in the file, and the exercise gives no "
                                                             f"forward: {bname} is graded with your own forward"),
                             False, ()))
            elif fname in lib:
                plan.append((layer, _reexport(layer, fname, found[fname]), False, ()))
            else:
                impl = {fname: Remote(sandbox, fname), bname: Remote(sandbox, bname)}
                plan.append((layer, impl, False, _deferred(layer, found.get(fname), False)))
        elif fname in lib:
            if asks is not None:
                plan.append((layer, _reexport(layer, fname, found[fname]), False, ()))
            else:
                imported.append(fname)
        else:
            plan.append((layer, {fname: Remote(sandbox, fname)}, False, _deferred(layer, found[fname], False)))
    return plan, imported


def grade_file(path: Path, layers=None, examples: int = DEFAULT_EXAMPLES, timeout: float = DEFAULT_TIMEOUT,
               forward_only: bool = False, allow_library: bool = False, out=None, hint_level: int = 1,
               exercise: str | None = None, sandbox_mode: str = "auto", memory_mb: int | None = None,
               seed: int | None = None, source: tuple[str, str] | None = None,
               layer_seconds: float | None = None) -> FileReport:
    """Grade every layer ``path``'s exercise asks for (every layer it defines, for a file that
    is no exercise's), or those named in ``layers``, printing the text report to ``out`` as it
    goes. ``source``: (the file's text, its SHA-256), read already (by :func:`read_source`
    if not given, a link refused: the file is read once, nowhere else)."""
    rep = FileReport(path)
    rep.examples, rep.hint, rep.seed = examples, hint_level, seed
    manifest = manifest_for(path, exercise)
    rep.exercise = manifest.name if manifest else ""
    w = (out.write if out is not None else (lambda s: None))
    try:
        text, rep.sha256 = source or read_source(path)
    except LoadError as e:
        rep.error = str(e)
        _zero(rep, manifest)
        return rep
    sandbox = Sandbox(path, timeout, allow_library, exercise=exercise, mode=sandbox_mode, memory_mb=memory_mb,
                      source=text, layer_s=layer_seconds)
    try:
        found = _start(sandbox, path, rep, manifest)
        if found is None:
            return rep
        rep.sandbox = describe(sandbox.got)
        if manifest is None and not allow_library:   # bound where the syntax does not say (globals(), setattr)
            found = {n: (o if n in sandbox.withheld else dict(o, library=True, defined=o["defined"] + ", bound in a "
                                                               "way attn-check does not read")) for n, o in found.items()}
        plan, imported = _plan(found, sandbox, manifest, layers, allow_library)
        rep.error = _nothing_to_grade(path, plan, imported, layers)
        if rep.error:
            return rep
        rep.header = _header(path, len(plan), manifest, examples, seed, allow_library)
        w(rep.header + "\n")
        w(f"sandbox: {rep.sandbox}\n")
        with scaled(FINAL_SCALE) if seed is not None else contextlib.nullcontext():
            for layer, impl, given_fwd, drop in plan:
                if isinstance(impl, Result):
                    r = impl
                else:
                    r = grade(layer, impl, sandbox, examples, given_fwd, forward_only, drop, seed=seed)
                rep.results.append(r)
        _blame_parts(rep.results)
        for r in rep.results:
            if out is not None:
                report(r, out, hint_level)
                out.flush()
        w(summary(rep.results) + "\n")
        rep.status = 0 if all(r.status == "pass" for r in rep.results) else 1
        return rep
    finally:
        sandbox.cleanup()


def _header(path: Path, layers: int, manifest, examples: int, seed: int | None, allow_library: bool) -> str:
    """The report's first line: the file, its layers and exercise, the profile."""
    return (f"attn-check {path}: {layers} layer{'s' * (layers != 1)}"
            + (f" of exercise {manifest.name}" if manifest else "")
            + f", {examples} examples each, backend {B.get_backend()}"
            + (", the final profile" if seed is not None else "")
            + (", the library's own functions allowed" if allow_library else ""))


def _start(sandbox: Sandbox, path: Path, rep: FileReport, manifest) -> dict | None:
    """The sandbox started on the learner's file: what it defines, or None with ``rep.error``
    saying why it could not be imported (and nothing of its exercise scored)."""
    try:
        return sandbox.start()
    except LoadError as e:
        rep.error = f"could not import {path}: {plain(str(e))}" + (f"\n    where: {plain(e.where)}" if e.where
                                                                  else "")
    except Fatal as e:
        rep.error = f"could not import {path}: {plain(e.failure.message)}" + (
            f"\n    where: {plain(e.failure.where)}" if e.failure.where else "")
    _zero(rep, manifest)
    return None


def _nothing_to_grade(path: Path, plan: list, imported: list, layers) -> str:
    """Why the file has nothing to grade (a layer asked for that it does not define, or no
    gradable function at all), or "" when it has."""
    if layers:
        missing = [n for n in layers if n not in {layer.name for layer, *_ in plan}]
        if missing:
            return (f"{path} defines no function of {', '.join(missing)} (looked for "
                    + "; ".join(", ".join(LAYERS[n].functions) for n in missing) + ")")
    if plan:
        return ""
    error = f"{path} defines no gradable function"
    if imported:
        error += (f": {', '.join(imported)} {'is' if len(imported) == 1 else 'are'} the library's own, "
                  "imported, not written here")
    return error + f". Names it looks for:\n{_layer_table()}"


def _zero(rep: FileReport, manifest) -> None:
    """A file that could not be loaded scores nothing of what its exercise asks for."""
    if manifest is None:
        return
    for name, layer in LAYERS.items():
        wanted = [n for n in layer.functions if n in manifest.asks]
        if wanted:
            r = _missing(layer, wanted, "not graded: the file could not be imported")
            rep.results.append(r)


#: Composites and the parts they are built from (a part's failure explains the composite's).
PARTS = {"residual_ffn": ("feed_forward", "layer_norm"), "feed_forward": ("relu",),
         "multi_head_attention": ("attention", "split_heads", "merge_heads"), "attention": ("softmax",),
         "encoder_layer": ("multi_head_attention", "feed_forward", "layer_norm"),
         "decoder_layer": ("multi_head_attention", "feed_forward", "layer_norm"),
         "transformer": ("encoder_layer", "decoder_layer", "embedding", "positional"),
         "luong_attention": ("softmax",), "rnn": ("rnn_step",)}


def _blame_parts(results: list) -> None:
    """A composite that fails after one of its parts failed in the same file: say so, and
    point at the part (the composite may well be right once the part is)."""
    failed = {r.layer: r for r in results if r.status == "fail"}
    for r in results:
        if r.status != "fail" or not isinstance(r.detail, Failure) or r.detail.check in ("missing", "integrity"):
            continue
        parts = [p for p in PARTS.get(r.layer, ()) if p in failed]
        if parts:
            part = failed[parts[0]]
            r.part = f"{parts[0]} failed first (fix {part.blame or parts[0]}): {r.layer} may pass once it does"
            r.blame = part.blame or r.blame
            r.detail.look = f"{parts[0]} first, which failed above" + (f": {part.detail.look}" if isinstance(
                part.detail, Failure) and part.detail.look else "")


def _deferred(layer: Layer, origin: dict | None, given_fwd: bool) -> tuple:
    """("dropout", "rng") when the learner's forward takes no dropout argument although the
    library's does (the starters before lesson 12 leave it out); () otherwise."""
    if given_fwd or origin is None or layer.name not in DROPOUT_PROBES or layer.name == "dropout":
        return ()
    params = origin.get("params") or []
    return () if "dropout" in params or not params else ("dropout", "rng")
