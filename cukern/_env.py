"""The environment cukern runs in: CuPy's kernel-cache folder, why no GPU can be used, and the
facts ``cukern info`` reports (:func:`report`).

Importing cukern imports CuPy, which creates its kernel cache (``$CUPY_CACHE_DIR``, by default
``~/.cupy/kernel_cache``) at import time and fails when ``$HOME`` is read-only or missing.
:func:`ensure_cache_dir` runs first (``cukern/__init__.py``): when that folder cannot be made or
written, it points ``CUPY_CACHE_DIR`` at one that can (``$XDG_CACHE_HOME/cupy/kernel_cache``,
else a private folder per user in the temporary directory) and says so once on stderr.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

__all__ = ["ensure_cache_dir", "cache_dir", "gpu_problem", "no_gpu_reason", "report",
           "CACHE_FALLBACK"]

# (the folder CuPy would have used, why it could not, the one used instead), or None
CACHE_FALLBACK: tuple[str, str, str] | None = None

# cudaError_t values that say why no device can be used
_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver: no driver at all, or one too old
_NO_DEVICE = 100  # cudaErrorNoDevice: a driver, no visible GPU


def _default_cache_dir() -> str:
    return os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy",
                                                            "kernel_cache")


def _writable_dir(path: str) -> str | None:
    """None when ``path`` is (or could be made) a folder this process can write; else why not."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        return err.strerror or type(err).__name__
    if not os.access(path, os.W_OK | os.X_OK):
        return "not writable"
    return None


def _private_tmp_dir() -> str | None:
    """A folder of this user's own in the temporary directory (0700, not a link), or None."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    tag = str(uid) if uid is not None else (os.environ.get("USERNAME") or "user")
    path = os.path.join(tempfile.gettempdir(), f"cupy-kernel-cache-{tag}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(path)
    # another user's folder (or a link planted there) could hand us their cubins
    if not os.path.isdir(path) or os.path.islink(path) or (uid is not None and st.st_uid != uid):
        return None
    return path if _writable_dir(path) is None else None


def ensure_cache_dir() -> str:
    """CuPy's kernel-cache folder, made usable before CuPy is imported.

    Returns the folder CuPy will use. When the configured one (``$CUPY_CACHE_DIR`` or
    ``~/.cupy/kernel_cache``) cannot be created or written, sets ``CUPY_CACHE_DIR`` to
    ``$XDG_CACHE_HOME/cupy/kernel_cache`` or ``<tmp>/cupy-kernel-cache-<uid>`` and writes one
    line on stderr saying so (child processes inherit the variable and stay quiet). Does
    nothing once CuPy is imported (its cache folder is fixed then)."""
    global CACHE_FALLBACK
    wanted = _default_cache_dir()
    if "cupy" in sys.modules:
        return wanted
    why = _writable_dir(wanted)
    if why is None:
        return wanted
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    path = os.path.join(xdg, "cupy", "kernel_cache") if os.path.isabs(xdg) else None
    if path is None or _writable_dir(path) is not None:
        path = _private_tmp_dir()
    if path is not None:
        os.environ["CUPY_CACHE_DIR"] = path
        CACHE_FALLBACK = (wanted, why, path)
        print(f"cukern: the kernel cache {wanted} cannot be used ({why}); using {path} "
              f"(set CUPY_CACHE_DIR to choose)", file=sys.stderr)
        return path
    return wanted  # nothing works: CuPy's own error will say where


ensure_cache_dir()  # at import: cukern/__init__.py imports this module before CuPy


def cache_dir() -> tuple[str, int, int]:
    """The kernel-cache folder in use: its path, files and bytes."""
    path = _default_cache_dir()
    files = size = 0
    if os.path.isdir(path):
        for entry in os.scandir(path):
            if entry.is_file():
                files += 1
                size += entry.stat().st_size
    return path, files, size


# ------------------------------------------------------------------------------------------
# Why no GPU


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def no_gpu_reason(status: int | None, driver: int, runtime: int, text: str = "") -> str:
    """Why CUDA finds no usable GPU, worded for the case: ``status`` is the cudaError_t of the
    failed device query (None: it returned 0 devices), ``driver`` and ``runtime`` the CUDA
    versions as CUDA encodes them (12040 is 12.4; a driver version of 0: no driver)."""
    if driver == 0:
        return ("no NVIDIA driver found (the CUDA driver library libcuda could not be loaded): "
                "this machine has no usable NVIDIA GPU")
    if status == _INSUFFICIENT_DRIVER and runtime:
        return (f"the NVIDIA driver is too old: it supports CUDA up to {_version(driver)}, this "
                f"CuPy needs CUDA {_version(runtime)}; update the driver, or install the CuPy "
                f"build for CUDA {_version(driver).split('.')[0]} (cukern[cuda12] for 12.x)")
    if status is None or status == _NO_DEVICE:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""
        return f"no CUDA GPU visible: the driver (CUDA {_version(driver)}) sees none{where}"
    return f"no CUDA GPU usable ({text or f'CUDA error {status}'})"


def _error_text(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split(": ", 1)[-1] if text.startswith("cuda") else text


def gpu_problem(device_id: int = 0) -> str | None:
    """Why the GPU ``device_id`` cannot be used, or None."""
    try:
        import cupy
    except ImportError as err:
        return f"CuPy is not importable ({err}); install cukern[cuda12] or cukern[cuda13]"
    rt = cupy.cuda.runtime
    try:
        count = rt.getDeviceCount()
        status = None
    except Exception as err:  # no driver, a driver too old, no device
        count, status, text = 0, getattr(err, "status", -1), _error_text(err)
    if count == 0:
        return no_gpu_reason(status, _safe(rt.driverGetVersion), _safe(rt.runtimeGetVersion),
                             "" if status is None else text)
    if device_id >= count:
        return f"GPU {device_id} does not exist ({count} visible)"
    return None


def _safe(get) -> int:
    try:
        return int(get())
    except Exception:
        return 0


# ------------------------------------------------------------------------------------------
# cukern info


def report(compile_check: bool = True) -> dict:
    """What ``cukern info --json`` prints: versions, the GPUs, the kernel cache and, with
    ``compile_check``, whether each kernel family compiles here (keys in docs/cli.md)."""
    import numpy as np

    from . import __version__

    out: dict = {"cukern": __version__, "numpy": np.__version__, "cupy": None,
                 "nvidia_driver": _nvidia_driver(), "cuda_runtime": None, "cuda_driver": None,
                 "nvrtc": None, "nvrtc_error": None, "gpus": [], "gpu_problem": None,
                 "cache": None, "compile": []}
    path, files, size = cache_dir()
    out["cache"] = {"dir": path, "files": files, "bytes": size,
                    "fallback_from": CACHE_FALLBACK[0] if CACHE_FALLBACK else None}
    try:
        import cupy
    except ImportError as err:
        out["gpu_problem"] = f"CuPy is not importable ({err})"
        return out
    rt = cupy.cuda.runtime
    out["cupy"] = cupy.__version__
    runtime, driver = _safe(rt.runtimeGetVersion), _safe(rt.driverGetVersion)
    out["cuda_runtime"] = _version(runtime) if runtime else None
    out["cuda_driver"] = _version(driver) if driver else None
    try:
        from cupy.cuda import nvrtc

        out["nvrtc"] = "{}.{}".format(*nvrtc.getVersion())
    except Exception as err:
        out["nvrtc_error"] = _error_text(err)
    out["gpu_problem"] = gpu_problem()
    if out["gpu_problem"] is None:
        out["gpus"] = [_gpu(cupy, dev) for dev in range(rt.getDeviceCount())]
    if compile_check:
        archs = sorted({g["arch"] for g in out["gpus"]}) or ["sm_90"]
        out["compile"] = [c for arch in archs for c in _compile_families(arch)]
    return out


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version (``570.86.15``) where Linux shows it, else None."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return None
    versions = [w for w in words if w[:1].isdigit() and "." in w]
    return versions[0] if versions else None


def _gpu(cupy, dev: int) -> dict:
    from ._device import DeviceSpec

    spec = DeviceSpec.from_device(dev)
    with cupy.cuda.Device(dev):
        free, total = cupy.cuda.runtime.memGetInfo()
    major, minor = spec.compute_capability
    return {"id": dev, "name": spec.name, "compute_capability": f"{major}.{minor}",
            "arch": spec.arch, "sms": spec.sms, "memory_bytes": int(total),
            "free_bytes": int(free), "smem_per_block_optin": spec.smem_per_block_optin,
            "smem_per_sm": spec.smem_per_sm}


def _compile_families(arch: str) -> list[dict]:
    """One small NVRTC compile a kernel family (its shortest float32 instantiation reachable on
    ``arch``): does the family build with this NVRTC for this GPU?"""
    import dataclasses

    from . import _compile, registry
    from ._device import DeviceSpec

    major, minor = int(arch[3:-1]), int(arch[-1])
    spec = dataclasses.replace(DeviceSpec.h100(), compute_capability=(major, minor))
    ops_by_source: dict[str, list[str]] = {}
    for name, op in registry.OPS.items():
        ops_by_source.setdefault(op.source, []).append(name)
    rows = []
    for source, ops in ops_by_source.items():
        row = {"family": source, "arch": arch, "ops": ops, "ok": False, "kernel": None,
               "seconds": 0.0, "error": None}
        t0 = time.perf_counter()
        try:
            names = sorted(registry.kernel_names(ops[:1], ["float32"], spec)[source])
            row["kernel"] = min(names, key=len)
            _compile.compile_check(source, [row["kernel"]], arch)
            row["ok"] = True
        except Exception as err:  # reported, not raised: info describes what works
            row["error"] = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    return rows
