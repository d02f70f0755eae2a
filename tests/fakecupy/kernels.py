"""``cupy.RawModule`` and ``cupy.RawKernel``: each kernel function run by its NumPy twin,
the function ``attn.fast.gpu.kernels`` keeps beside every kernel as its specification, given the
launch (grid, block, shared memory; its blocks in a drawn order where ``cupy.race`` is set)
and the arguments read as the kernel's signature says.
Part of :mod:`fakecupy.cupy`, which re-exports every name; its state lives there.
"""
from __future__ import annotations

import builtins
import itertools
import re
import time
import weakref

import numpy as np

from . import cupy as _c


class KernelLaunch:
    """How a kernel was launched: what its NumPy twin receives first."""

    def __init__(self, name, grid, block, shared_mem):
        self.name, self.grid, self.block, self.shared_mem = name, grid, block, shared_mem
        #: the order the launch's blocks run in (flat indices, x fastest), where :data:`race`
        #: is set; None: the twin may run them as it likes. A twin whose kernel's blocks talk to
        #: each other (a two-stage reduction, a ticket counter) runs them one by one in it.
        self.order = None

    @property
    def threads(self) -> int:
        return int(np.prod(self.block))

    @property
    def blocks(self) -> int:
        return int(np.prod(self.grid))


def _kernel_signatures(code: str) -> dict:
    """name -> (template parameter or None, [(C type, is pointer, parameter name, is const)]) of
    every ``__global__`` function in ``code``: a template's type parameter (its first argument in a
    name, ``flash_fwd<float, 64>``); a template of values alone (``template <int KIND, int DH>``)
    has the parameter "" (an instance must still be named in ``name_expressions``)."""
    sigs = {}
    pattern = (r"(?:template\s*<([^>]*)>\s*)?__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
               r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)")
    for m in re.finditer(pattern, code):
        tlist, name, params = m.group(1), m.group(2), m.group(3)
        typename = re.search(r"typename\s+(\w+)", tlist or "")
        tparam = None if tlist is None else typename.group(1) if typename else ""
        plist = []
        for p in (s.strip() for s in params.split(",") if s.strip()):
            const = re.search(r"\bconst\b", p) is not None
            p = re.sub(r"\b(const|__restrict__)\b", " ", p)
            ptr = "*" in p
            p = p.replace("*", " ")
            words = p.split()
            plist.append((" ".join(words[:-1]), ptr, words[-1], const))
        sigs[name] = (tparam, plist)
    return sigs


def _twins() -> dict:
    """The NumPy twins of attn's kernels, by kernel name: ``attn.fast.gpu.kernels.NUMPY_TWINS``."""
    import importlib
    for mod in ("attn.fast.gpu.kernels", "attn.kernels"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "NUMPY_TWINS"):
            return m.NUMPY_TWINS
    raise RuntimeError("fakecupy: attn's kernels module has no NUMPY_TWINS to run kernels with")


class RawKernel:
    """One kernel of a :class:`RawModule`. Calling it checks the launch as a GPU would
    (block and shared-memory limits, every argument's type against the kernel's C
    signature, device arrays only) and then runs the kernel's NumPy twin in its place."""

    MAX_THREADS, MAX_SHARED = 1024, 48 << 10

    #: The most shared memory a block may opt into (``max_dynamic_shared_size_bytes``): an H100's.
    MOST_SHARED = 227 << 10

    def __init__(self, name, signature, targ, twin):
        self.name, self._sig, self._targ, self._twin = name, signature, targ, twin
        self._opted = 0
        self.ptr = next(_PTRS)                  # what cupy.cuda.driver.funcSetAttribute names it by
        _BY_PTR[self.ptr] = self

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        """CuPy's attribute: the shared memory a launch may ask for above the 48 KiB every block gets."""
        return self._opted

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n) -> None:
        if not 0 <= int(n) <= self.MOST_SHARED:
            raise ValueError(f"{self.name}: max_dynamic_shared_size_bytes {n}, at most {self.MOST_SHARED}")
        self._opted = int(n)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        tparam, params = self._sig
        if not (isinstance(grid, tuple) and isinstance(block, tuple) and 1 <= len(grid) <= 3
                and 1 <= len(block) <= 3):
            raise TypeError(f"{self.name}: grid and block must be tuples of 1 to 3 ints, got {grid!r}, {block!r}")
        for v in grid + block:
            if not isinstance(v, (int, np.integer)) or isinstance(v, (builtins.bool, np.bool_)) or v < 1:
                raise ValueError(f"{self.name}: grid and block sizes must be positive ints, got {grid!r}, {block!r}")
        if int(np.prod(block)) > self.MAX_THREADS:
            raise ValueError(f"{self.name}: {int(np.prod(block))} threads per block, at most {self.MAX_THREADS}")
        if not 0 <= int(shared_mem) <= max(self.MAX_SHARED, self._opted):
            raise ValueError(f"{self.name}: shared_mem {shared_mem} bytes, at most {self.MAX_SHARED} unless "
                             f"max_dynamic_shared_size_bytes opts into more ({self._opted})")
        if not isinstance(args, tuple) or len(args) != len(params):
            raise TypeError(f"{self.name}: the kernel takes {len(params)} arguments "
                            f"({', '.join(p[2] for p in params)}), got {len(args) if isinstance(args, tuple) else args!r}")
        host_args = []
        for a, (ctype, ptr, pname, _) in zip(args, params):
            ctype = self._targ if ctype == tparam else ctype
            want = _c._CTYPE_DTYPES.get(ctype)
            if want is None:
                raise TypeError(f"{self.name}: fakecupy does not know the C type {ctype!r} of {pname}")
            if ptr:
                if isinstance(a, np.ndarray):
                    raise _c._host_refused(f"kernel {self.name} argument {pname}", a)
                if not isinstance(a, _c.ndarray):
                    raise TypeError(f"{self.name}: argument {pname} ({ctype}*) must be a device array, "
                                    f"got {type(a).__name__}")
                if a.dtype != want:
                    raise TypeError(f"{self.name}: argument {pname} is {ctype}*, but the array's dtype is "
                                    f"{a.dtype}")
                host_args.append(a._a)
            else:
                # CuPy passes a NumPy scalar with its own width; a Python int or float would be
                # passed as 64 bits and silently misread by a kernel expecting int or float.
                if not isinstance(a, np.generic) or a.dtype != want:
                    raise TypeError(f"{self.name}: argument {pname} is {ctype}, so it must be a numpy.{np.dtype(want)} "
                                    f"scalar, got {type(a).__name__} {a!r}")
                host_args.append(a)
        launch = KernelLaunch(self.name, tuple(int(v) for v in grid), tuple(int(v) for v in block), int(shared_mem))
        if _c.race is not None:
            launch.order = tuple(_c.race.permutation(launch.blocks).tolist())
        t0 = time.perf_counter()
        self._twin(launch, *host_args)
        _c.device_seconds[0] += time.perf_counter() - t0
        if _c._capturing is not None:
            twin = self._twin
            _c._record(lambda: twin(launch, *host_args), None if stream is None else stream.ptr)
        if _c.tracer is not None:
            arrays = [a for a in host_args if isinstance(a, np.ndarray)]
            written = [a for a, p in zip(host_args, params) if p[1] and not p[3]]     # its non-const pointers
            _c.tracer("raw", self.name.split("<")[0], arrays, [],
                   {"fresh": [], "grid": launch.grid, "block": launch.block, "written": written,
                    "stream": None if stream is None else stream.ptr,
                    "work": max((a.size for a in arrays), default=0)})


_PTRS = itertools.count(0x7F0000000000, 0x100)
_BY_PTR: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Driver:
    """``cupy.cuda.driver``: the one function attribute attn sets (a block's dynamic shared memory above
    48 KiB), on a kernel of a module (CuPy's module functions have no attribute for it)."""
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    @staticmethod
    def funcSetAttribute(ptr, attribute, value):
        if attribute != Driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            raise NotImplementedError(f"fakecupy: funcSetAttribute of attribute {attribute}")
        if ptr not in _BY_PTR:
            raise ValueError(f"fakecupy: funcSetAttribute: no kernel at {ptr:#x}")
        _BY_PTR[ptr].max_dynamic_shared_size_bytes = value


class RawModule:
    """``cupy.RawModule``: CUDA source and the kernels named in ``name_expressions``. The
    source is only read for the kernels' signatures (``tests/test_kernels.py`` compiles it
    with NVRTC); each kernel runs as its NumPy twin (see :class:`RawKernel`)."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None:
            raise ValueError("fakecupy.RawModule: pass the source as code=")
        self.code, self.options = code, tuple(options)
        self.name_expressions = tuple(name_expressions or ())
        self._sigs = _kernel_signatures(code)

    def get_function(self, name: str) -> RawKernel:
        m = re.fullmatch(r"(\w+)\s*(?:<\s*([\w ,]+?)\s*>)?", name)
        if m is None:
            raise ValueError(f"fakecupy.RawModule.get_function: cannot read the name {name!r}")
        base, targ = m.group(1), m.group(2) and m.group(2).split(",")[0].strip()
        if base not in self._sigs:
            raise KeyError(f"no __global__ function {base!r} in the module's source")
        if self._sigs[base][0] is not None:
            if targ is None or name not in self.name_expressions:
                raise KeyError(f"template kernel {name!r} was not named in name_expressions "
                               f"{self.name_expressions} (NVRTC would not instantiate it)")
        twins = _twins()
        if base not in twins:
            raise KeyError(f"kernel {base!r} has no NumPy twin in attn's kernels module")
        return RawKernel(name, self._sigs[base], targ, twins[base])
