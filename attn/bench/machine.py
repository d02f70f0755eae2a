"""What the benchmark records about the machine: CPU, BLAS, threads."""
from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

from .. import backend as B

#: The checkout attn runs from (where :func:`commit` asks git).
CHECKOUT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The commit attn runs from (``git rev-parse HEAD`` in :data:`CHECKOUT`), or "unknown" where
    that is no checkout of its own (an installed copy) or git is missing."""
    if not (CHECKOUT / ".git").exists():
        return "unknown"
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=CHECKOUT)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    out = r.stdout.strip()
    return out if r.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", out) else "unknown"


def blas_threads(set_to: int | None = None) -> int | None:
    """NumPy's BLAS threads (OpenBLAS), optionally setting them first. None if unknown."""
    return B.blas_threads(set_to)


def machine_info() -> dict:
    info = {"name": "machine", "platform": platform.platform(), "python": platform.python_version(),
            "numpy": B.host.__version__, "cpu_count": os.cpu_count(), "commit": commit()}
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
