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
        m = re.search(r"model name\s*:\s*(.*)", open("/proc/cpuinfo").read())
        info["cpu_model"] = m.group(1).strip() if m else platform.processor()
    except OSError:
        info["cpu_model"] = platform.processor()
    try:
        cfgs = B.host.show_config(mode="dicts")
        blas = cfgs["Build Dependencies"]["blas"]
        info["blas"] = f"{blas.get('name')} {blas.get('version')}"
    except Exception:
        pass
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info
