"""The CuPy kernels without a GPU: NVRTC compiles every one of them, and each has its NumPy twin.

NVRTC (the CUDA runtime compiler, from the ``nvidia-cuda-nvrtc-cu12`` wheel) needs no GPU and
no driver; it is reached through ``cupy_backends.cuda.libs.nvrtc`` (from ``cupy-cuda12x``).
``cupy.cuda.compiler.compile_using_nvrtc`` is not used: it asks the driver which device it
compiles for. Both wheels come with ``pip install -e .[test,gpu-ci]`` (what CI installs), so
these tests run in CI; elsewhere they skip, naming the missing wheel.

How the kernels *behave* is checked elsewhere: the stand-in (tests/fakecupy) runs each
kernel's NumPy twin through ``CupyOps``'s launch code, against the NumPy path
(tests/test_fast.py). What only a GPU can show is listed in docs/GPU.md.
"""
from __future__ import annotations

import re

import pytest

from attn.fast.gpu import kernels as K

#: The GPU generations the kernels are written for (Volta to Blackwell). Each is compiled where the
#: installed NVRTC still supports it: CUDA 13's dropped compute_70, CUDA 12's compiles them all.
ARCHS = ["compute_70", "compute_75", "compute_80", "compute_90", "compute_100"]


def supported_archs(nvrtc) -> set:
    """The ``compute_NN`` names the installed NVRTC compiles for (``nvrtcGetSupportedArchs``)."""
    return {f"compute_{n}" for n in nvrtc.getSupportedArchs()}


def archs_to_compile(supported: set) -> list:
    """The architectures of :data:`ARCHS` that NVRTC supports; an error if fewer than two are left
    (an NVRTC too old or too new to check the kernels against more than one generation)."""
    archs = [a for a in ARCHS if a in supported]
    if len(archs) < 2:
        raise AssertionError(f"NVRTC supports only {sorted(supported)}; of {ARCHS} that leaves {archs}")
    return archs


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()                      # loads libnvrtc
    except Exception as e:                      # ImportError, or the NVRTC library missing
        pytest.skip(f"NVRTC is not available ({type(e).__name__}: {e}); pip install -e .[gpu-ci] "
                    "installs cupy-cuda12x and nvidia-cuda-nvrtc-cu12")
    return nvrtc


def compile_source(source: str, arch: str, names=K.NAME_EXPRESSIONS, options=K.OPTIONS, binary: bool = False):
    """Compile ``source`` with every template instantiation in ``names``, for a virtual ``arch``
    (compute_NN: PTX) or, with ``binary``, a real one (sm_NN: machine code, ptxas reading any inline PTX).
    Returns (ptx text or the machine code, log, {name: lowered name}); raises AssertionError with the log on errors."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, "attn_kernels.cu", [], [])
    try:
        for name in names:                       # templates compile to nothing unless instantiated
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options])
        except nvrtc.NVRTCError as e:
            raise AssertionError(f"NVRTC ({arch}) rejects the kernels: {e}\n{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        code = nvrtc.getCUBIN(prog) if binary else nvrtc.getPTX(prog).decode(errors="replace")
        return code, log, lowered
    finally:
        nvrtc.destroyProgram(prog)


def test_the_architectures_follow_what_nvrtc_supports():
    """CUDA 13's NVRTC has no compute_70 (CUDA 12.9's has 50 to 121): it is left out, not failed."""
    cuda13 = {f"compute_{n}" for n in (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)}
    assert archs_to_compile(cuda13) == ["compute_75", "compute_80", "compute_90", "compute_100"]
    cuda12 = {f"compute_{n}" for n in (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 120)}
    assert archs_to_compile(cuda12) == ARCHS
    with pytest.raises(AssertionError, match="leaves"):
        archs_to_compile({"compute_90"})
    assert archs_to_compile(supported_archs(_nvrtc()))        # the installed one keeps at least two


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_for(arch):
    nvrtc = _nvrtc()
    if arch not in archs_to_compile(supported_archs(nvrtc)):
        pytest.skip(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))} does not compile for {arch} "
                    f"(it supports {min(nvrtc.getSupportedArchs())} to {max(nvrtc.getSupportedArchs())})")
    ptx, log, lowered = compile_source(K.SOURCE, arch)
    # NVRTC 12.9 says that targets before 7.5 are deprecated; any other remark fails the test
    remarks = [ln for ln in log.splitlines() if ln.strip() and "are deprecated" not in ln]
    assert not remarks, log
    sm = arch.split("_")[1]
    assert re.search(rf"^\.target sm_{sm}\b", ptx, re.M), f"PTX not for sm_{sm}"
    entries = set(re.findall(r"^(?:\.(?:visible|weak)\s+)?\.entry\s+(\w+)\(", ptx, re.M))
    missing = [name for name, low in lowered.items() if low not in entries]
    assert not missing, f"no PTX entry point for {missing}"
    assert {name.split("<")[0] for name in lowered} == set(K.KERNELS)     # every kernel of the module
    assert len(lowered) == 2 * len(K.KERNELS) + 3 * (len(K.registry.flash.HEAD_SIZES) - 1)   # float, double; heads


def test_a_typo_in_a_kernel_fails_with_its_line():
    """The check can fail: a missing semicolon is reported with the line of the source."""
    broken = K.SOURCE.replace("T total = 0;", "T total = 0", 1)
    line = broken[:broken.index("T total = 0")].count("\n") + 1
    with pytest.raises(AssertionError, match=rf"attn_kernels\.cu\({line + 1}\)|attn_kernels\.cu\({line}\)"):
        compile_source(broken, "compute_90")


def test_a_type_error_in_a_kernel_fails():
    broken = K.SOURCE.replace("const bool* keep, T scale, long long n) {",
                              "const bool* keep, T scale, long long n) { keep[0] = true;", 1)
    with pytest.raises(AssertionError, match="const"):
        compile_source(broken, "compute_80")


def _kernels_in(source: str) -> set:
    return set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", source))


def test_every_kernel_has_its_numpy_twin_and_every_twin_its_kernel():
    assert _kernels_in(K.SOURCE) | _kernels_in(K.registry.flash_mma.SOURCE) == set(K.NUMPY_TWINS)
    for name, twin in K.NUMPY_TWINS.items():
        assert twin.__name__ == f"{name}_np" and twin.__doc__.startswith(f"NumPy twin of ``{name}``")


def test_the_registry_lists_each_kernel_once_with_its_own_source():
    """Each entry's source defines that kernel and no other; the shared device functions define none."""
    assert not _kernels_in(K.registry.PRELUDE) and not _kernels_in(K.registry.flash_mma.PRELUDE)
    for name, (source, _) in {**K.KERNELS, **K.registry.flash_mma.KERNELS}.items():
        assert _kernels_in(source) == {name}, name
    assert K.SOURCE == K.registry.PRELUDE + "".join(source for source, _ in K.KERNELS.values())


def test_kernels_take_no_implicit_python_scalars():
    """On a GPU a Python int or float passed for an ``int`` or ``float`` parameter is sent as
    64 bits and misread; the stand-in refuses it, so the launch code must pass NumPy scalars."""
    import numpy as np
    import fakecupy
    cp = fakecupy.cupy
    module = cp.RawModule(code=K.SOURCE, options=K.OPTIONS, name_expressions=K.NAME_EXPRESSIONS)
    f = module.get_function("relu_bwd<float>")
    da, a = cp.zeros(4, dtype="float32"), cp.ones(4, dtype="float32")
    with pytest.raises(TypeError, match=r"n is long long, so it must be a numpy\.int64"):
        f((1,), (32,), (da, a, 4))
    with pytest.raises(TypeError, match=r"da is float\*, but the array's dtype is float64"):
        f((1,), (32,), (cp.zeros(4), a, np.int64(4)))
    f((1,), (32,), (da, a, np.int64(4)))
    with pytest.raises(KeyError, match="name_expressions"):
        cp.RawModule(code=K.SOURCE, name_expressions=("adam<float>",)).get_function("adam<double>")


def test_the_benchmark_runs_its_cupy_path(capsys):
    """``python -m attn.bench --backend cupy``, in process on the stand-in where no GPU is usable
    (a child process could not load it, hence no worker processes): the GPU branches (ids checked once before timing,
    device synchronisation around each timed run) run, and report the device."""
    import json
    from conftest import selected_backend
    from attn.bench.cli import main
    with selected_backend("cupy"):
        assert main(["--backend", "cupy", "--quick", "--no-torch", "--no-memory", "--no-isolated", "--no-phases",
                     "--json", "--quiet", "--only", "train_step,greedy_cached", "--repeats", "1",
                     "--warmup", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    by = {r["name"]: r for r in rows}
    assert by["machine"]["backend"] == "cupy" and by["machine"]["gpu"]
    assert by["train_step"]["seconds_per_step"] > 0 and by["greedy_cached"]["tokens_per_second"] > 0


def test_every_cupy_name_attn_calls_exists_in_the_real_cupy():
    """The stand-in forwards any NumPy function name; the real CuPy (installed in CI, no GPU
    needed to import it) must have each ``xp.NAME`` / ``cp.NAME`` that attn calls."""
    import importlib.util
    import pathlib
    try:
        import cupy
    except Exception as e:
        pytest.skip(f"cupy-cuda12x is not installed ({type(e).__name__}); CI installs it with .[gpu-ci]")
    root = pathlib.Path(K.__file__).resolve().parents[2]
    missing = set()
    for f in root.rglob("*.py"):
        for m in re.finditer(r"\b(?:xp|cp|self\.xp)\.(\w+)(?:\.(\w+))?", f.read_text(encoding="utf-8")):
            if m.group(0).startswith("cp.async"):                 # PTX's instruction, in CUDA source
                continue
            obj = getattr(cupy, m.group(1), None)
            if obj is None:
                missing.add(m.group(1))
            elif m.group(2) and m.group(1) in ("cuda", "random", "linalg") and not hasattr(obj, m.group(2)) \
                    and importlib.util.find_spec(f"cupy.{m.group(1)}.{m.group(2)}") is None:
                missing.add(f"{m.group(1)}.{m.group(2)}")    # (a submodule, cupy.cuda.nccl, counts once found)
    for name in ("random_sample", "randint"):                     # what DeviceRNG draws with
        assert hasattr(cupy.random.RandomState, name), name
    assert not missing, f"attn calls these on CuPy, which has no such name: {sorted(missing)}"
