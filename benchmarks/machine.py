"""What machine and code a benchmark ran on, for every benchmark's JSON.

CPU figures depend on the CPU model and its vector extensions far more than
on anything else (bf16 without AVX512-BF16/AMX is emulated; vLLM's CPU
attention kernels pick an ISA path), so every result records both, and every
benchmark prints them in one line before it starts.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The flags that decide which kernels run (printed; the full list is recorded).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "bf16")


def cpu_info(cpuinfo: str | None = None) -> tuple[str | None, list[str]]:
    """(CPU model name, sorted flags) from ``/proc/cpuinfo`` text (read when
    not given); (None, []) where there is no such file."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None, []
    model, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86 / arm64
            flags = set(value.split())
    return model, sorted(flags)


def machine_info() -> dict:
    info = {"hostname": platform.node(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:
        info["cpus_available"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["cpus_available"] = os.cpu_count()
    model, flags = cpu_info()
    if model:
        info["processor"] = info["model_name"] = model
    if flags:
        info["cpu_flags"] = flags
        info["isa"] = [f for f in ISA_FLAGS if f in flags]
        info["native_bf16"] = bool(set(flags) & {"avx512_bf16", "amx_bf16"})
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return info


def describe(info: dict) -> str:
    """One line for a benchmark's stdout: CPU model, CPUs, vector ISA."""
    isa = " ".join(info.get("isa") or []) or "unknown"
    return (f"machine: {info.get('processor')}, {info.get('cpus_available')} of "
            f"{info.get('cpu_count')} CPUs, {info.get('memory_gib', '?')} GiB; ISA: {isa}")


def git_info(root: str | None = None) -> dict | None:
    """The commit a result was measured on (this checkout, or ``root``), and
    whether the tree had changes."""
    root = str(root or REPO_ROOT)
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head or None, "dirty": bool(dirty)} if head else None
