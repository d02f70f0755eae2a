"""A run on a GPU always trains (docs/GPU.md): each feature of the fast engine the run uses is
probed once at the start in a child process (:mod:`attn.fast.gpu.probe`: a CUDA error can be
sticky), and one that fails is switched off with one line naming it, with what needs it (the
captured step needs cuBLAS through ctypes and the step memory, bf16 and tf32 cuBLAS through
ctypes; without the fast engine the readable model trains). A child that dies or runs past
:data:`CHILD_SECONDS` fails its probe, and a fresh child probes the rest. On the stand-in the
probes run only where :data:`ON_STAND_IN` is set."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
from pathlib import Path
import sys

from ... import backend as B
from .probe import apply, asked, block_of, probe_config

#: Whether the probes run on the CuPy stand-in too (the tests set it); on a GPU they always run.
ON_STAND_IN = False

#: The command of a probe's child process; the request's JSON is its last argument.
CHILD = [sys.executable, "-m", "attn.fast.gpu.probe"]

#: Seconds a probe's child process may run before it counts as dead.
CHILD_SECONDS = 300


def tiny_config():
    """The tiny model of the paper's block (the GPU report's preflight trains it)."""
    return probe_config()


def request_of(config) -> dict:
    """What the child probes for the run of ``config``: its block, attention, precision and
    ``--cuda-graph``."""
    model = config.model_config(23)
    return {"block": block_of(model), "attention": config.attention, "precision": config.precision,
            "cuda_graph": bool(config.cuda_graph),
            "tiled": config.attention != "plain" and model.attention_dropout == 0}


def _child_env() -> dict:
    """The child's environment: this one on a GPU; on the stand-in, the one its package gives a
    child (``child_env``), so that the child runs on it too."""
    xp = B.xp()
    env = dict(os.environ) if xp.__name__ == "cupy" else importlib.import_module(xp.__name__.split(".")[0]).child_env()
    home = str(Path(__file__).resolve().parents[3])       # the folder holding this attn: the child imports it too
    env["PYTHONPATH"] = os.pathsep.join([home, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env


def _one_child(request: dict, decided: dict) -> tuple:
    """One child's run: ({probe: why or None} it reported, why it died or None)."""
    try:
        r = subprocess.run(CHILD + [json.dumps({**request, "decided": decided})], capture_output=True, text=True,
                           env=_child_env(), timeout=CHILD_SECONDS)
        out, err, code = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, err, code = e.stdout or "", f"past its limit of {CHILD_SECONDS} s", None
        out = out.decode() if isinstance(out, bytes) else out
    reported = {}
    for line in out.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "probe" in row:
            reported[row["probe"]] = row["why"]
    if code == 0:
        return reported, None
    last = next((ln for ln in reversed((err or "").splitlines()) if ln.strip()), "no error output")
    how = "ran past its limit" if code is None else (f"died of signal {-code}" if code < 0 else f"exited {code}")
    return reported, f"the probe's process {how}: {last.strip()[:200]}"


def probe(request: dict) -> dict:
    """{probe: why it failed, or None} for every probe ``request`` asks for, from as many child
    processes as it takes (one more after each failure)."""
    decided: dict = {}
    wanted = asked(request)
    while any(p not in decided for p in wanted):
        reported, died = _one_child(request, decided)
        decided.update(reported)
        if died is not None:
            decided[next(p for p in wanted if p not in decided)] = died
        elif all(why is None for why in reported.values()):
            for p in wanted:                     # the child went through: nothing left undecided
                decided.setdefault(p, "the probe's process ended without reporting it")
    return decided


def settle(config, say):
    """On a GPU (or the stand-in with :data:`ON_STAND_IN`), the run's features probed as the module
    says: returns ``config`` as it can run (``reference``, ``attention``, ``cuda_graph``,
    ``precision``), the process-wide switches set, and one line through ``say`` for each feature
    switched off. A run on NumPy is returned as it is."""
    if B.get_backend() != "cupy" or (B.xp().__name__ != "cupy" and not ON_STAND_IN):
        return config
    decided = probe(request_of(config))
    off = {p: why for p, why in decided.items() if why is not None}
    if "fast engine" in off:
        say(f"attn-train: the fast engine is switched off for this run: its probe on this device failed "
            f"({off['fast engine']}); the run trains the readable model (--reference)")
        return dataclasses.replace(config, reference=True, precision="fp32", attention="auto", cuda_graph=False)
    apply(off)
    names = {"tiled attention": "the tiled attention (--attention plain instead)",
             "precision": f"--precision {config.precision}"}
    for feature, reason in off.items():
        say(f"attn-train: {names.get(feature, feature)} is switched off for this run: its probe on this device "
            f"failed ({reason}); the run goes on without it")
    return dataclasses.replace(config, cuda_graph=config.cuda_graph and "captured step" not in off,
                               precision="fp32" if "precision" in off else config.precision,
                               attention="plain" if "tiled attention" in off else config.attention)
