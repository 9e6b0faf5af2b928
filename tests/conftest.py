"""Shared fixtures. GPU tests carry the ``gpu`` marker and skip, with the reason, where no CUDA
device is visible; everything else runs on any machine."""

from __future__ import annotations

import numpy as np
import pytest


def _gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError as err:
        return f"CuPy is not importable ({err})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # no driver, or a driver too old
        return f"no CUDA device visible ({type(err).__name__}: {err})"
    return None if n > 0 else "no CUDA device visible (device count 0)"


GPU_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {GPU_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Relative error ||out - ref|| / ||ref|| allowed per dtype (float64 NumPy reference).
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}
DTYPES = ["float16", "bfloat16", "float32", "float64"]


@pytest.fixture
def rng(request):
    """Fresh random data per test (seeded from the test id, printed on failure)."""
    seed = abs(hash(request.node.nodeid)) % (2**32) ^ np.random.SeedSequence().entropy % (2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


_warmed: dict[str, list] = {}


def warm_family(family: str) -> None:
    """Compile every kernel instantiation of ``kernels/<family>.cuh`` the planner can reach on
    this GPU, in parallel, into CuPy's on-disk cache (once per session), so GPU tests do not
    wait on one compile after another. It doubles as the check that each of them compiles and
    loads on the device."""
    if GPU_REASON is not None:
        pytest.skip(f"GPU test: {GPU_REASON}")
    if family not in _warmed:
        from cukern import _compile, _dispatch
        from cukern._device import DeviceSpec

        spec = DeviceSpec.from_device()
        names = sorted({(info.family, n) for op, info in _dispatch.OPS.items()
                        if info.family == family for dt in DTYPES
                        for n in _dispatch.reachable_plans(op, dt, spec)})
        _warmed[family] = _compile.warm_cache(names, spec.device_id)
    errors = _warmed[family]
    assert not errors, f"{len(errors)} {family} kernels failed to compile: {errors[:3]}"


@pytest.fixture(scope="session")
def warm_softmax():
    warm_family("softmax")


@pytest.fixture(scope="session")
def warm_layer_norm():
    warm_family("layer_norm")


@pytest.fixture(scope="session")
def warm_kernels():
    """Every family (the CLI's selftest and precompile touch them all)."""
    warm_family("softmax")
    warm_family("layer_norm")


def col_sums_expected(op: str, dtype: str, cols: int, size: int, device):
    """(threads, smem_bytes, sums_in_registers, gamma_in_smem) of one block of a backward with
    column sums (dweight, dbias) over a slice of a row of ``cols`` split in ``size`` blocks, by
    the rules documented in ``_dispatch._col_sums_block_ways`` (one block) and
    ``_dispatch._plan_col_sums`` (a cluster) with the device model's occupancy, or None when
    no way fits.

    One block: every width of 128..1024 threads (each with a pack, but 128), sums in shared
    memory or in registers (at most reg_sum_packs packs a thread), x and dy in one buffer or
    two, gamma in shared memory or not (float compute); the best by gamma in shared memory,
    then resident threads per SM nearest 1024, then shared-memory sums (registers for rows of
    at most 128 packs), then busy threads in the last pass, then width, then two buffers.

    A cluster: sums in shared memory or (slices of at most reg_sum_packs * 1024 packs, the
    block widened to cover the slice) in registers, x and dy in two buffers or one; the first
    of those four ways that keeps two blocks per SM, else the first with two buffers, else the
    first that fits. Then, with two buffers and a float compute type, gamma as floats beside
    them where that fits and keeps as many blocks per SM."""
    import itertools
    import math

    from cukern import _dispatch

    item = _dispatch.ITEMSIZE[dtype]
    pack = _dispatch.pack_size(dtype, cols, 16, False)
    packs = -(-(cols // pack) // size)
    apt = max(1, (8 if dtype == "float64" else 16) // pack)
    csize = 8 if dtype == "float64" else 4
    limit = _dispatch.max_dynamic_smem(device)
    align = _dispatch.OPS[op].smem_align
    sums_per_value = _dispatch.OPS[op].col_sums * csize

    if size == 1:
        best = None
        for threads in (128, 256, 512, 1024):
            for in_regs, two, gamma in itertools.product((True, False), repeat=3):
                if (threads > 128 and threads > packs) or (two and pack * item < 4) or \
                        (in_regs and math.ceil(packs / threads) > apt) or \
                        (gamma and csize == 8):
                    continue
                smem = (2 if two else 1) * 2 * item * cols + align + \
                    (0 if in_regs else sums_per_value * cols) + (4 * cols if gamma else 0)
                per_sm = device.model_occupancy(threads, smem) if smem <= limit else 0
                if per_sm == 0:
                    continue
                passes = math.ceil(packs / threads)
                rank = (gamma, -abs(math.log2(threads * per_sm) - 10),
                        in_regs == (packs <= 128), packs / (threads * passes), threads, two)
                if best is None or rank > best[0]:
                    best = (rank, (threads, smem, in_regs, gamma))
        return None if best is None else best[1]

    found = []
    for in_regs, two in itertools.product((False, True), (True, False)):
        if (two and pack * item < 4) or (in_regs and packs > apt * 1024):
            continue
        threads = min(512, _dispatch.block_threads_for(packs))
        while in_regs and threads < min(1024, -(-packs // apt)):
            threads *= 2
        sums = 0 if in_regs else sums_per_value * packs * pack
        smem = (2 if two else 1) * 2 * item * packs * pack + sums + align
        if smem > limit:
            continue
        per_sm = device.model_occupancy(threads, smem)
        if per_sm > 0:
            found.append(((threads, smem, in_regs), per_sm, two))
    if not found:
        return None
    pick = next((f for f in found if f[1] >= 2), None) or \
        next((f for f in found if f[2]), None) or found[0]
    (threads, smem, in_regs), per_sm, two = pick
    with_gamma = smem + 4 * packs * pack
    if two and csize == 4 and with_gamma <= limit and \
            device.model_occupancy(threads, with_gamma) >= per_sm:
        return threads, with_gamma, in_regs, True
    return threads, smem, in_regs, False
