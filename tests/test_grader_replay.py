"""What keeps attn-check fast over a class without changing a grade: each layer's examples
are drawn once and replayed (the very examples hypothesis feeds a passing check, a check
that writes into one never reaching the next file, a failure still shrunk by hypothesis),
and central differences send a learner's forward its arguments once and let the child
perturb them (the gradients bitwise those of one call per perturbation)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from attn import backend as B
from attn.grader import checks, grading
from attn.grader.results import Failure
from attn.grader.sandbox import Remote, Sandbox
from attn.testing import LAYERS
from attn.testing.strategies import scaled


class _NoChild:
    """What :func:`grading._run` asks of a sandbox when no learner's code is called."""

    def reset(self):
        pass


def _print(v):
    """An example's contents, arrays by their bytes: equal examples print equal."""
    if isinstance(v, np.ndarray):
        return (v.dtype.str, v.shape, hashlib.sha256(v.tobytes()).hexdigest())
    if isinstance(v, dict):
        return tuple((k, _print(x)) for k, x in v.items())
    if isinstance(v, (tuple, list)):
        return tuple(_print(x) for x in v)
    return repr(v)


@pytest.mark.parametrize("name, seed", [("softmax", None), ("layer_norm", 4242), ("causal_mask", None)])
def test_the_replayed_examples_are_those_hypothesis_feeds_a_passing_check(name, seed):
    layer, fed = LAYERS[name], []
    with scaled(grading.FINAL_SCALE if seed is not None else 1):
        runs, failure = grading._run(layer, _NoChild(), lambda ex: fed.append(_print(ex)), 6, seed, replay=False)
        replayed = [_print(ex) for ex in grading.drawn(layer, 6, seed)]
    assert failure is None and runs == len(fed) == len(replayed)
    assert fed == replayed
    n = len(layer.explicit)
    assert n and fed[:n] == [_print(ex) for ex in layer.explicit]      # every profile meets them first
    if seed is not None:                        # then the final profile meets the default profile's hard examples
        with scaled(1):
            hard = [_print(ex) for ex in grading.drawn(layer, 6)[n:] if not ex.gradcheck]
        assert hard and set(hard) <= set(fed[n:n + len(hard)])


def test_once_the_class_has_drawn_a_passing_file_never_waits_on_hypothesis(monkeypatch):
    """What attn-check --class does before its workers start: draw every layer its exercises
    ask for; then a file that passes calls hypothesis not once."""
    layers = ("causal_mask", "padding_mask", "decoder_mask")
    assert {k[0] for k in grading.draw_for({"05_masks"}, 4)} >= set(layers)
    monkeypatch.setattr(grading, "_hypothesis", lambda *a: pytest.fail("hypothesis ran for a passing file"))
    for name in layers:
        runs, failure = grading._run(LAYERS[name], _NoChild(), lambda ex: None, 4)
        assert failure is None and runs == len(grading.DRAWN[(name, grading.share(LAYERS[name], 4), None, 1)])


def test_a_check_that_writes_into_its_example_leaves_the_next_files_alone():
    layer = LAYERS["relu"]
    before = [_print(ex) for ex in grading.drawn(layer, 5)]

    def vandal(ex):
        for _, v in ex.args:
            if isinstance(v, np.ndarray):
                v[...] = 0

    assert grading._run(layer, _NoChild(), vandal, 5) == (len(before), None)
    assert [_print(ex) for ex in grading.drawn(layer, 5)] == before


def test_a_failure_is_still_shrunk_by_hypothesis_and_one_that_does_not_return_is_flagged(monkeypatch):
    layer = LAYERS["relu"]._replace(explicit=())       # a failing explicit example is reported as it is
    monkeypatch.setattr(grading, "DRAWN", {})

    def wide(ex):
        if ex.get("x").size > 3:
            raise Failure("forward", "too wide")

    runs, failure = grading._run(layer, _NoChild(), wide, 20)
    assert isinstance(failure, Failure) and failure.message == "too wide"
    assert failure.example.get("x").size == 4, "hypothesis shrinks the failing example to the smallest one"
    calls = [0]

    def once(ex):
        calls[0] += 1
        if calls[0] == 1:
            raise Failure("forward", "only the first time")

    runs, failure = grading._run(layer, _NoChild(), once, 20)
    assert failure.check == "repeatability", failure.message


def test_central_differences_in_one_request_are_those_of_one_call_per_perturbation(tmp_path):
    """Bitwise: the child perturbs its own copy as the grader would have. A block's
    parameters are a dict; dropout's generator is a new one at every call."""
    path = tmp_path / "07_feed_forward_layer_norm.py"
    path.write_text("from attn.layers import dropout_forward\n\n\n"
                    "def feed_forward_forward(x, w1, b1, w2, b2, dropout=0.0, rng=None):\n"
                    "    h = x @ w1 + b1\n    a = h * (h > 0)\n    a, _ = dropout_forward(a, dropout, rng)\n"
                    "    return a @ w2 + b2, None\n", encoding="utf-8")
    sandbox = Sandbox(path)
    try:
        fwd = Remote(sandbox, "feed_forward_forward")

        def one_at_a_time(*args):
            return fwd(*args)

        compared = 0
        examples = grading.drawn(LAYERS["feed_forward"], 4)
        for ex in examples:
            args = checks._Args(ex)
            out = fwd(*args.call())[0]
            dout = B.host_rng(ex.seed).standard_normal(out.shape)
            for name in ("x", "w1", "b2"):
                x = args.arrays[args.index(name)]
                idx = checks._spot(x.size, ex.seed)
                calls = sandbox.calls
                fast = checks._central_differences(fwd, "f", args, x, dout, idx)
                assert sandbox.calls - calls == 2 * len(idx)
                slow = checks._central_differences(one_at_a_time, "f", args, x, dout, idx)
                assert np.array_equal(fast, slow) and np.abs(fast).max() > 0, name
                compared += 1
        assert compared == 3 * len(examples) == 3 * (4 + len(LAYERS["feed_forward"].explicit))
    finally:
        sandbox.cleanup()


def test_frames_sent_back_to_back_come_out_of_the_buffer_whole_and_in_order():
    """Each frame goes out in one write and comes in through a buffer: a second frame read
    with the first is kept for the next recv (and poll says one is waiting); a frame that
    stops half-way still times out."""
    import os

    from attn.grader.wire import Arr, Channel
    r, w = os.pipe()
    try:
        out, inp = Channel(w), Channel(r, patience=0.5)
        arrays = [np.arange(k, dtype=np.float64).reshape(-1, 1) for k in range(1, 40)]
        out.send(("ok", [Arr(a, False) for a in arrays], []))
        out.send(("todo", "second"))
        first = inp.recv()
        assert [x.host.tolist() for x in first[1]] == [a.tolist() for a in arrays]
        assert inp.poll(0) and inp.recv() == ("todo", "second") and not inp.poll(0)
        os.write(w, (1 << 20).to_bytes(8, "little") + (0).to_bytes(8, "little") + b"{")
        with pytest.raises(TimeoutError):
            inp.recv()
    finally:
        os.close(r)
        os.close(w)
