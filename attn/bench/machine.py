"""What the benchmark records about the machine: CPU, BLAS, threads."""
from __future__ import annotations

import os
import platform
import re

from .. import backend as B

def blas_threads(set_to: int | None = None) -> int | None:
    """NumPy's BLAS threads (OpenBLAS), optionally setting them first. None if unknown."""
    return B.blas_threads(set_to)


def machine_info() -> dict:
    info = {"name": "machine", "platform": platform.platform(), "python": platform.python_version(),
            "numpy": B.host.__version__, "cpu_count": os.cpu_count()}
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        cpuinfo = open("/proc/cpuinfo").read()
        m = re.search(r"model name\s*:\s*(.*)", cpuinfo)
        info["cpu_model"] = m.group(1).strip() if m else platform.processor()
        flags = re.search(r"flags\s*:\s*(.*)", cpuinfo)
        if flags:
            have = set(flags.group(1).split())
            info["cpu_features"] = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in have]
    except OSError:
        info["cpu_model"] = platform.processor()
    bi = B.blas_info()
    if "build" in bi:
        info["blas"] = bi["build"]
    if "corename" in bi:
        info["blas_kernel"] = bi["corename"]       # the kernel OpenBLAS chose for this CPU
    if "config" in bi:
        info["blas_config"] = bi["config"]
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info
