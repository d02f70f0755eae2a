"""The NumPy/CuPy switch: the import rule, choosing a backend, and the operations the two
libraries spell differently (scatter-add, host transfer, seeded random numbers)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn
import attn.backend as B
from attn.testing import normals, token_ids

ATTN_DIR = Path(attn.__file__).resolve().parent
FORBIDDEN = ("numpy", "cupy", "cupyx")


def _forbidden_imports(path: Path) -> list[str]:
    """'file:line: statement' for every import of NumPy or CuPy (any form) in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "__import__" and node.args and isinstance(node.args[0], ast.Constant)):
            names = [str(node.args[0].value)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            names = [str(node.args[0].value)]
        else:
            continue
        for name in names:
            if name.split(".")[0] in FORBIDDEN:
                rel = path.relative_to(ATTN_DIR.parent)
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_backend_imports_numpy_or_cupy():
    """attn/backend.py is the one module that may import NumPy or CuPy (its docstring); every other asks it."""
    files = sorted(ATTN_DIR.rglob("*.py"))
    assert ATTN_DIR / "backend.py" in files
    offenders = [hit for f in files if f != ATTN_DIR / "backend.py" for hit in _forbidden_imports(f)]
    assert not offenders, ("only attn/backend.py may import NumPy or CuPy; use `attn.backend` "
                           "(xp, host, to_device, ...) instead:\n  " + "\n  ".join(offenders))


@pytest.mark.parametrize("source", [
    "import numpy", "import numpy as np", "from numpy import zeros", "from numpy.random import default_rng",
    "import cupy", "import cupyx.scipy", "from cupyx import scatter_add", "import os, numpy",
    "def f():\n    import cupy as cp\n", "np = __import__('numpy')", "importlib.import_module('cupy')",
])
def test_the_import_rule_catches_every_form(tmp_path, monkeypatch, source):
    monkeypatch.setattr(sys.modules[__name__], "ATTN_DIR", tmp_path)
    f = tmp_path / "mod.py"
    f.write_text(source + "\n")
    assert _forbidden_imports(f), source


@pytest.mark.parametrize("source", ["from . import backend as B", "import numbers", "from .numpyish import x",
                                    "import attn.backend"])
def test_the_import_rule_allows_the_rest(tmp_path, monkeypatch, source):
    monkeypatch.setattr(sys.modules[__name__], "ATTN_DIR", tmp_path)
    f = tmp_path / "mod.py"
    f.write_text(source + "\n")
    assert not _forbidden_imports(f)

# ----------------------------------------------------------------------------- choosing


@pytest.fixture
def fresh(monkeypatch):
    """The backend module as if nothing had been selected yet (restored afterwards)."""
    monkeypatch.setattr(B, "_current", None)
    monkeypatch.setattr(B, "_xp", None)
    return B


def test_set_backend_numpy(fresh):
    assert fresh.set_backend("numpy") is np
    assert fresh.get_backend() == "numpy" and fresh.xp() is np


def test_unknown_backend_is_a_value_error(fresh):
    with pytest.raises(ValueError, match="backend must be one of.*'tensorflow'"):
        fresh.set_backend("tensorflow")


@pytest.mark.parametrize("value", ["numpy", " NumPy ", ""])
def test_attn_backend_env_is_read_on_first_use(fresh, monkeypatch, value):
    monkeypatch.setenv("ATTN_BACKEND", value)
    assert fresh.get_backend() == "numpy"
    assert fresh.xp() is np


def test_unset_attn_backend_means_numpy(fresh, monkeypatch):
    monkeypatch.delenv("ATTN_BACKEND", raising=False)
    assert fresh.xp() is np


def test_attn_backend_env_with_an_unknown_name_is_a_value_error(fresh, monkeypatch):
    monkeypatch.setenv("ATTN_BACKEND", "gpu")
    with pytest.raises(ValueError, match="'gpu'"):
        fresh.get_backend()


def test_the_env_var_is_not_reread_after_the_first_choice(fresh, monkeypatch):
    monkeypatch.setenv("ATTN_BACKEND", "numpy")
    fresh.get_backend()
    monkeypatch.setenv("ATTN_BACKEND", "cupy")
    assert fresh.get_backend() == "numpy"


@pytest.mark.skipif(B.cupy_available(), reason="CuPy is usable here; this checks the error where it is not")
@pytest.mark.parametrize("how", ["call", "env"])
def test_asking_for_unavailable_cupy_says_what_is_missing_and_how_to_fix_it(fresh, monkeypatch, how):
    with pytest.raises(B.BackendError) as info:
        if how == "call":
            fresh.set_backend("cupy")
        else:
            monkeypatch.setenv("ATTN_BACKEND", "cupy")
            fresh.xp()
    msg = str(info.value)
    assert "CuPy" in msg and ("not installed" in msg or "no GPU" in msg)     # what is missing
    assert "pip install" in msg or "nvidia-smi" in msg                       # how to fix it
    assert "ATTN_BACKEND=numpy" in msg                                       # or how to go without
    assert fresh._current is None                                            # nothing half-selected


def test_missing_cupy_error_even_where_cupy_is_installed(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "cupy_modules", None)     # not the stand-in (ATTN_BACKEND=fakecupy)
    monkeypatch.setitem(sys.modules, "cupy", None)      # makes `import cupy` raise ImportError
    assert not fresh.cupy_available()
    with pytest.raises(B.BackendError, match=r"CuPy is not installed.*pip install -e \.\[gpu\]"):
        fresh.set_backend("cupy")


def test_auto_falls_back_to_numpy_without_a_gpu(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "cupy_modules", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert fresh.set_backend("auto") is np
    assert fresh.get_backend() == "numpy"


def test_auto_without_cupy_installed_says_nothing(fresh, monkeypatch):
    """``auto`` on a CPU-only install is what it is for: no warning, no notice, a plain description."""
    import warnings

    def not_installed():
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")
    monkeypatch.setattr(fresh, "_cupy", not_installed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.set_backend("auto") is np
    assert fresh.auto_fallback_notice() is None and fresh.describe() == "numpy"
    assert fresh.auto_fallback_reason.startswith("CuPy is not installed")


def test_auto_picks_what_this_machine_has(fresh):
    expected = "cupy" if B.cupy_available() else "numpy"
    fresh.set_backend("auto")
    assert fresh.get_backend() == expected

# ----------------------------------------------------------------------------- operations


def test_backend_fixture_selects_the_backend(backend):
    assert B.xp() is backend
    x = B.to_device(np.zeros(3))
    assert B.get_array_module(x) is backend
    assert B.is_device_array(x) == (B.get_backend() == "cupy")


def test_get_array_module_of_host_arrays_is_numpy(backend):
    assert B.get_array_module(np.zeros(2)) is np
    assert B.get_array_module(np.zeros(2), 1.0, [3]) is np


@given(shape=st.tuples(st.integers(0, 4), st.integers(1, 3)), dtype=st.sampled_from(["float32", "float64"]),
       data=st.data())
def test_to_device_and_to_host_round_trip(backend, shape, dtype, data):
    values = data.draw(normals(shape))
    d = B.to_device(values, dtype=dtype)
    assert B.get_array_module(d) is backend and d.dtype == np.dtype(dtype)
    back = B.to_host(d)
    assert isinstance(back, np.ndarray) and back.shape == values.shape
    np.testing.assert_array_equal(back, values.astype(dtype))


def test_to_float_of_a_device_scalar(backend):
    v = B.to_float(B.to_device(np.array([1.5, 2.0])).sum())
    assert type(v) is float and v == 3.5


@given(data=st.data())
def test_scatter_add_accumulates_repeated_ids(backend, data):
    V = data.draw(st.integers(1, 5))
    N = data.draw(st.integers(1, 8))
    ids = data.draw(token_ids((N,), V))
    values = data.draw(normals((N, 3)))
    target = B.to_device(np.zeros((V, 3)))
    B.scatter_add(target, B.to_device(ids), B.to_device(values))
    expected = np.zeros((V, 3))
    for i, v in zip(ids, values):           # the obvious loop
        expected[i] += v
    np.testing.assert_allclose(B.to_host(target), expected, rtol=1e-12, atol=1e-12)


def test_scatter_add_with_every_id_the_same(backend):
    target = B.to_device(np.zeros((2, 1)))
    B.scatter_add(target, B.to_device(np.array([1, 1, 1])), B.to_device(np.ones((3, 1))))
    np.testing.assert_array_equal(B.to_host(target), [[0.0], [3.0]])   # not [[0], [1]] as `t[ids] += v` gives


def test_host_rng_is_deterministic_per_seed():
    a = B.host_rng(7).standard_normal(5)
    np.testing.assert_array_equal(a, B.host_rng(7).standard_normal(5))
    assert not np.array_equal(a, B.host_rng(8).standard_normal(5))
    assert isinstance(B.host_rng(7), np.random.Generator)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_device_rng_is_deterministic_per_seed(backend, dtype):
    a = B.to_host(B.DeviceRNG(3).random((4, 5), dtype=dtype))
    b = B.to_host(B.DeviceRNG(3).random((4, 5), dtype=dtype))
    c = B.to_host(B.DeviceRNG(4).random((4, 5), dtype=dtype))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.dtype == np.dtype(dtype) and a.shape == (4, 5)
    assert (a >= 0).all() and (a < 1).all()


def test_device_rng_draws_on_the_selected_backend(backend):
    r = B.DeviceRNG(0)
    first, second = r.random((100,)), r.random((100,))
    assert B.get_array_module(first) is backend
    assert not np.array_equal(B.to_host(first), B.to_host(second))     # a stream, not a constant

# ----------------------------------------------------------------------------- real CuPy, no GPU
# CI installs cupy-cuda12x (the `gpu-ci` extra) on machines without a GPU: these prove, with the
# real library, what a user with CuPy installed but no usable GPU sees.


@pytest.fixture
def real_cupy_no_gpu(fresh, monkeypatch):
    """The backend module, fresh, on a machine where the real CuPy imports but no GPU is usable."""
    monkeypatch.setattr(fresh, "cupy_modules", None)      # the real library even under ATTN_BACKEND=fakecupy
    try:
        import cupy  # noqa: F401
    except Exception as e:
        pytest.skip(f"cupy-cuda12x is not installed ({type(e).__name__}); CI installs it with .[gpu-ci]")
    if B.cupy_available():
        pytest.skip("a GPU is usable here: these check the machine without one")
    assert B.cupy_modules is None                       # the real library, not the stand-in
    return fresh


def test_real_cupy_without_a_gpu_auto_falls_back_to_numpy_and_says_why(real_cupy_no_gpu):
    import warnings
    B = real_cupy_no_gpu
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # said by the command, in its own words
        assert B.set_backend("auto") is np
    assert B.auto_fallback_notice() == ("using NumPy: CuPy imports, but no GPU is usable on this machine "
                                        "(--backend numpy: no notice)")        # one quiet line, no CUDA error
    assert B.get_backend() == "numpy" and B.xp() is np
    assert B.describe().startswith("numpy (auto: CuPy imports, but no GPU is usable (")
    B.set_backend("numpy")
    assert B.describe() == "numpy"                       # the reason goes with the auto choice


@pytest.mark.parametrize("how", ["call", "env"])
def test_real_cupy_without_a_gpu_is_an_error_when_asked_for(real_cupy_no_gpu, monkeypatch, how):
    B = real_cupy_no_gpu
    with pytest.raises(B.BackendError) as info:
        if how == "call":
            B.set_backend("cupy")
        else:
            monkeypatch.setenv("ATTN_BACKEND", "cupy")
            B.xp()
    msg = str(info.value)
    assert msg.startswith("ATTN_BACKEND=cupy was asked for and CuPy imports, but no GPU is usable (")
    assert "Check `nvidia-smi` and the CUDA driver, or use ATTN_BACKEND=numpy." in msg
    assert B._current is None


def _attn_train(tmp_path, *args, env_backend=None):
    import os
    import subprocess
    pairs = [("a red cat", "un chat rouge"), ("a big dog", "un grand chien"), ("the cat runs", "le chat court")]
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for split in ("train", "val", "test"):
        (data / f"{split}.xx").write_text("\n".join(s for s, _ in pairs) + "\n", encoding="utf-8")
        (data / f"{split}.yy").write_text("\n".join(t for _, t in pairs) + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "ATTN_BACKEND"}
    if env_backend:
        env["ATTN_BACKEND"] = env_backend
    env["PYTHONPATH"] = str(ATTN_DIR.parent)
    cmd = [sys.executable, "-m", "attn.train", "--data", str(data), "--src", "xx", "--tgt", "yy", "--steps", "2",
           "--d-model", "8", "--heads", "2", "--d-ff", "8", "--layers", "1", "--average", "0",
           "--bleu-sentences", "0", "--minutes", "0", "--quiet", "--out", str(tmp_path / "run"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_attn_train_asked_for_cupy_without_a_gpu_fails_with_the_message(real_cupy_no_gpu, tmp_path, how):
    r = _attn_train(tmp_path, *(["--backend", "cupy"] if how == "flag" else []),
                    env_backend="cupy" if how == "env" else None)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("attn-train: error: ATTN_BACKEND=cupy was asked for and CuPy imports, but no GPU "
                               "is usable ("), r.stderr
    assert "nvidia-smi" in r.stderr and "ATTN_BACKEND=numpy" in r.stderr
    assert not (tmp_path / "run" / "checkpoint.npz").exists()


def test_attn_train_auto_without_a_gpu_trains_on_numpy_and_says_why(real_cupy_no_gpu, tmp_path):
    r = _attn_train(tmp_path, "--backend", "auto")
    assert r.returncode == 0, r.stderr
    assert "backend numpy (auto: CuPy imports, but no GPU is usable (" in r.stderr
    metrics = __import__("json").loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["backend"] == "numpy" and metrics["steps"] == 2


def test_device_rngs_share_one_curand_generator_made_at_the_first_draw():
    """The trainer makes a DeviceRNG a step: on CuPy (here the stand-in) one cuRAND generator
    serves them in turn, made at the first draw (none where nothing is drawn, as in the fast
    engine's steps), each DeviceRNG's numbers those of a new RandomState of its seed; one drawing
    while an earlier one is still alive gets its own."""
    from conftest import selected_backend
    with selected_backend("fakecupy") as cp:
        made = cp.random.RandomState.made
        unused = [B.DeviceRNG(s) for s in range(3)]
        assert cp.random.RandomState.made == made and unused[0].seed == 0
        for s in range(4):
            rng = B.DeviceRNG(s)
            got = rng.random((5,)).get()
            np.testing.assert_array_equal(got, cp.random.RandomState(s).random_sample((5,), dtype="float32").get())
            np.testing.assert_array_equal(rng.random_uint16((3,)).get().dtype, np.uint16)
            del rng
        made_here = cp.random.RandomState.made - made - 4           # less the four made to compare
        a, b = B.DeviceRNG(7), B.DeviceRNG(8)
        first = a.random((4,)).get(), b.random((4,)).get(), a.random((4,)).get()
        fresh = cp.random.RandomState(7), cp.random.RandomState(8)
        assert made_here <= 1
        np.testing.assert_array_equal(first[0], fresh[0].random_sample((4,), dtype="float32").get())
        np.testing.assert_array_equal(first[1], fresh[1].random_sample((4,), dtype="float32").get())
        np.testing.assert_array_equal(first[2], fresh[0].random_sample((4,), dtype="float32").get())
