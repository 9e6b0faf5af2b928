"""Kernel source assembly, the per-instantiation module cache, and a GPU-free compile check.

Each kernel family lives in ``kernels/<family>.cuh``. :func:`source` inlines its local includes
(each once), so the text handed to NVRTC contains every line it depends on, and CuPy's on-disk
cache, keyed by that text, is invalidated by an edit to any kernel file. One
``cupy.RawModule`` is compiled per (family, instantiation, device) and kept for the process.

:func:`compile_check` compiles name expressions with NVRTC for a given architecture without a
GPU (CuPy's own compile path asks the driver for the device's architecture, so it calls NVRTC
through CuPy's bindings directly).

With ``CUKERN_FORCE_FALLBACKS=1`` in the environment, every kernel is compiled with
``-DCUKERN_FORCE_FALLBACKS``: the code paths written for GPUs before Ampere (sm_70, sm_75) in place
of ``max.NaN``, ``cvt.rn.bf16.f32`` and ``cp.async``, so a newer GPU can test them. The option is
part of CuPy's cache key, so forced and normal builds are cached apart.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from pathlib import Path

__all__ = ["kernel_dir", "source", "get_kernel", "compile_check", "kernel_resources", "warm_cache",
           "NVRTC_OPTIONS", "FORCE_FALLBACKS_ENV", "fallbacks_forced", "nvrtc_options"]

NVRTC_OPTIONS = ("-std=c++17",)
FORCE_FALLBACKS_ENV = "CUKERN_FORCE_FALLBACKS"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_lock = threading.Lock()
_kernels: dict[tuple, object] = {}


def kernel_dir() -> Path:
    """Where the ``.cuh`` files are: inside the installed package, or the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "types.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cukern: kernel sources not found beside {here}")


def fallbacks_forced() -> bool:
    """Whether ``CUKERN_FORCE_FALLBACKS`` asks for the pre-Ampere fallbacks (set, not 0)."""
    return os.environ.get(FORCE_FALLBACKS_ENV, "").strip() not in ("", "0")


def nvrtc_options(fallbacks: bool | None = None) -> tuple[str, ...]:
    """NVRTC options of a kernel build: ``NVRTC_OPTIONS``, plus ``-DCUKERN_FORCE_FALLBACKS``
    where ``fallbacks`` (None: :func:`fallbacks_forced`)."""
    if fallbacks is None:
        fallbacks = fallbacks_forced()
    return (*NVRTC_OPTIONS, "-DCUKERN_FORCE_FALLBACKS") if fallbacks else NVRTC_OPTIONS


@functools.cache
def source(family: str) -> str:
    """The self-contained source of ``kernels/<family>.cuh`` with local includes inlined."""
    root = kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"cukern: kernel source {path} not found")
        text = path.read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return f"// cukern {family}\n" + expand(f"{family}.cuh")


def get_kernel(family: str, name: str, device_id: int):
    """The compiled ``cupy.RawKernel`` for one instantiation on one device (cached), built with
    :func:`nvrtc_options` (the environment's ``CUKERN_FORCE_FALLBACKS``)."""
    options = nvrtc_options()
    key = (family, name, device_id, options)
    kern = _kernels.get(key)
    if kern is not None:
        return kern
    import cupy

    with _lock:
        kern = _kernels.get(key)
        if kern is None:
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(code=source(family), options=options,
                                        name_expressions=[name])
                kern = module.get_function(name)
            _kernels[key] = kern
    return kern


def check_options() -> tuple[str, ...]:
    """NVRTC options of :func:`compile_check` beyond ``NVRTC_OPTIONS``: the fast-compile level
    (``-Ofc=max``, NVRTC 12.8 and newer) where NVRTC has it. It runs the same front end, NVVM and
    ptxas with fewer optimisations (2-5x faster for most kernels): a check of what compiles, not
    of the code the ops run, which CuPy compiles at full optimisation."""
    from cupy.cuda import nvrtc

    return ("-Ofc=max",) if nvrtc.getVersion() >= (12, 8) else ()


def compile_check(family: str, names, arch: str = "sm_90",
                  fallbacks: bool | None = None) -> dict[str, str]:
    """Compile ``names`` (C++ name expressions from ``kernels/<family>.cuh``) with NVRTC for
    ``arch`` (``sm_75``, ``sm_80``, ``sm_90``, ...) without a GPU, with the pre-Ampere fallbacks
    forced where ``fallbacks`` (None: the environment, :func:`nvrtc_options`), through ptxas to
    machine code at NVRTC's fast-compile level (:func:`check_options`). Returns name -> mangled
    symbol; raises ``RuntimeError`` with the compiler log on failure."""
    symbols, _ = _nvrtc(family, names, arch, [*nvrtc_options(fallbacks), *check_options()])
    return symbols


def _nvrtc(family: str, names, arch: str, options) -> tuple[dict[str, str], str]:
    """Compile ``names`` of ``kernels/<family>.cuh`` for ``arch`` with ``options``: name ->
    mangled symbol, and the compiler's log."""
    from cupy.cuda import nvrtc

    names = list(names)
    prog = nvrtc.createProgram(source(family), f"{family}.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, [*options, f"-arch={arch}"])
        except nvrtc.NVRTCError as err:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed for {family} on {arch}: {err}\n{log}") from None
        return {n: nvrtc.getLoweredName(prog, n) for n in names}, nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


RESOURCES = ("registers", "stack", "spill_stores", "spill_loads", "smem")
_PTXAS_PROPS = re.compile(r"Function properties for (\S+)")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def kernel_resources(family: str, names, arch: str = "sm_90",
                     fallbacks: bool | None = None) -> dict[str, dict[str, int]]:
    """Registers, stack frame, spill bytes and static shared memory (``RESOURCES``) of each of
    ``names`` for ``arch``, from ptxas's report (``-Xptxas=-v``) at full optimisation, as the
    ops compile them (:func:`compile_check` compiles at the fast-compile level): no GPU needed.
    They depend on the NVRTC version; two trees compare only under the same one."""
    names = list(names)
    symbols, log = _nvrtc(family, names, arch, [*nvrtc_options(fallbacks), "-Xptxas=-v"])
    by_symbol = {sym: n for n, sym in symbols.items()}
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in log.splitlines():
        if m := _PTXAS_PROPS.search(line):
            name = by_symbol.get(m.group(1))
            if name is not None:
                out[name] = dict.fromkeys(RESOURCES, 0)
        elif name is not None and (m := _PTXAS_STACK.search(line)):
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                             spill_loads=int(m.group(3)))
        elif name is not None and (m := _PTXAS_USED.search(line)):
            out[name].update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    missing = [n for n in names if n not in out]
    if missing:
        raise RuntimeError(f"ptxas reported no resources for {len(missing)} of {family}'s "
                           f"kernels, the first {missing[0]}")
    return out


def _warm_one(item) -> str | None:
    family, name, device_id = item
    try:
        get_kernel(family, name, device_id)
    except Exception as err:  # reported to the caller, who decides
        return f"{name}: {err}"
    return None


def warm_cache(items, device_id: int = 0, processes: int | None = None, progress=None) -> list:
    """Compile (family, name) pairs into CuPy's on-disk cache using several processes, so later
    first calls only load a cubin. Returns the error messages (empty when all compiled)."""
    import multiprocessing as mp
    import os

    todo = [(f, n, device_id) for f, n in items]
    if not todo:
        return []
    processes = processes or max(1, min(len(todo), (os.cpu_count() or 2)))
    errors = []
    with mp.get_context("spawn").Pool(processes) as pool:
        for err in pool.imap_unordered(_warm_one, todo, chunksize=4):
            if err:
                errors.append(err)
            if progress:
                progress(1)
    return errors
