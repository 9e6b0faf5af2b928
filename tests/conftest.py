"""Shared fixtures. GPU tests carry the ``gpu`` marker and skip, with the reason, where no CUDA
device is visible; everything else runs on any machine. Tests marked ``nvrtc(family)`` compile
every instantiation of a family with NVRTC, in the background from the end of collection
(``nvrtc_results``)."""

from __future__ import annotations

import concurrent.futures as cf
import os

import numpy as np
import pytest


def _gpu_reason() -> str | None:
    """Why no GPU test can run here (no driver, a driver too old, no device), in the words of
    ``cukern info``, or None."""
    from cukern._env import gpu_problem

    return gpu_problem(0)


GPU_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    # the family compile checks (nvrtc_results) last: every other test runs while the pool
    # compiles, and none waits behind a check whose programs are queued last
    items.sort(key=lambda item: _family_check(item) is not None)
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
    """Compile every kernel instantiation of a registry family's ops (``"softmax"``,
    ``"norm"``) the planner can reach on this GPU, auxiliary kernels included, in parallel, into
    CuPy's on-disk cache (once per session), so GPU tests do not wait on one compile after
    another. It doubles as the check that each of them compiles and loads on the device."""
    if GPU_REASON is not None:
        pytest.skip(f"GPU test: {GPU_REASON}")
    if family not in _warmed:
        from cukern import _compile, registry
        from cukern._device import DeviceSpec

        spec = DeviceSpec.from_device()
        ops = [name for name, op in registry.OPS.items() if op.family == family]
        assert ops, f"no ops in family {family!r}"
        by_source = registry.kernel_names(ops, DTYPES, spec)
        names = sorted((source, n) for source, kernels in by_source.items() for n in kernels)
        # each compiling process opens a context on the GPU: give back what earlier tests'
        # arrays left in CuPy's pools (tens of GB after the tests past 2^31 elements)
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        _warmed[family] = _compile.warm_cache(names, spec.device_id,
                                              processes=os.cpu_count() or 1)
    errors = _warmed[family]
    assert not errors, f"{len(errors)} {family} kernels failed to compile: {errors[:3]}"


@pytest.fixture(scope="session")
def warm_softmax():
    warm_family("softmax")


@pytest.fixture(scope="session")
def warm_layer_norm():
    warm_family("norm")


@pytest.fixture(scope="session")
def warm_kernels():
    """Every family (the CLI's selftest and precompile touch them all)."""
    warm_family("softmax")
    warm_family("norm")


def cluster_tail(op: str, dtype: str, threads: int, rows_per_pass: int = 1,
                 cluster: bool = True) -> int:
    """Bytes a forward or softmax cluster block's dynamic shared memory ends with: its block
    all-reduce's two buffers of a state a warp (one in a cluster of two rows a pass; in 16-byte
    units), then the cluster merge's four slots, in the compute type, for each row of a pass
    (``cluster=False``: a softmax block's, without the merge's). The states: softmax (max,
    sum), its backwards one sum; the norms' block sums one sum, merged as layer norm's (count,
    mean, M2) or RMS norm's sum."""
    partial, merged = {"softmax": (2, 2), "log_softmax": (2, 2), "softmax_backward": (1, 1),
                       "log_softmax_backward": (1, 1), "layer_norm": (1, 3),
                       "rms_norm": (1, 1)}[op]
    word = (8 if dtype == "float64" else 4) * rows_per_pass
    buffers = 1 if cluster and rows_per_pass > 1 else 2  # two rows a pass: one buffer
    return -(-buffers * (threads // 32) * partial * word // 16) * 16 + \
        4 * merged * word * cluster


def block_tail(op: str, dtype: str, threads: int) -> int:
    """Bytes of a softmax block kernel's all-reduce buffers at its dynamic tail: the forwards'
    in every dtype, the backwards' in float64 only (static buffers otherwise)."""
    if op.endswith("_backward") and dtype != "float64":
        return 0
    return cluster_tail(op, dtype, threads, cluster=False)


def col_sums_resident(op, dtype, cols, device, occ, size, threads, smem, in_regs, gamma) -> int:
    """Resident blocks an SM of one cached-backward way (a weight given): ``occ(plan)``, or the
    device model's where ``occ`` is None; 0 past the dynamic shared-memory limit."""
    from cukern import plan as planner
    from cukern import registry

    if smem > planner.max_dynamic_smem(device):
        return 0
    if occ is None:
        return device.model_occupancy(threads, smem)
    return occ(planner.Plan(
        op=op, dtype=dtype, rows=1, cols=cols, pack_size=planner.pack_size(dtype, cols, 16, False),
        strided=False, device=device.name, switches=planner.Switches(weight=True),
        policy=registry.policy(op),
        variant=planner.Variant.BLOCK_SMEM if size == 1 else planner.Variant.CLUSTER,
        block=(threads, 1), grid=size, smem_bytes=smem, cluster=size, sums_in_registers=in_regs,
        gamma_in_smem=gamma, cols_per_thread=0, thread_group_width=0, rows_per_access=0,
        padding=False))


def col_sums_expected(op: str, dtype: str, cols: int, device, occ=None):
    """:func:`col_sums_rule`'s way, with its sums in registers over float32 rows in 16-byte
    packs of at least the device table's norm_bwd_regs_min_cols_32bit columns where its slice
    fits them (four packs a thread) and it stays resident."""
    from cukern import plan as planner
    from cukern import registry
    from cukern.plan.policy import tuning_for

    way = col_sums_rule(op, dtype, cols, device, occ)
    least = tuning_for(device).norm_bwd_regs_min_cols_32bit
    if way is None or dtype != "float32" or not least or cols < least or way[3]:
        return way
    size, threads, smem, _, gamma = way
    pack = planner.pack_size(dtype, cols, 16, False)
    sp = -(-(cols // pack) // size)
    if pack != 4 or sp > 4 * threads:
        return way
    smem -= registry.policy(op).col_sums * 4 * sp * pack
    resident = col_sums_resident(op, dtype, cols, device, occ, size, threads, smem, True, gamma)
    return (size, threads, smem, True, gamma) if resident > 0 else way


def col_sums_rule(op: str, dtype: str, cols: int, device, occ=None):
    """(cluster size, threads, smem_bytes, sums_in_registers, gamma_in_smem) of a backward with
    column sums (dweight, dbias) over rows of ``cols`` (16-byte aligned), by the rules
    documented in ``cukern.plan.col_sums.ways``, or None where no way fits (the uncached
    kernel). ``occ(plan)``: resident blocks per SM (default: the device model's).

    First, over 16-bit rows (devices with clusters), the first of the device table's
    norm_bwd_narrow ways for the op that fits, past its columns, in 16-byte packs: "s2g" (the
    H100's for layer norm past 2048), the first of one block, clusters of 2, 4, 8, 16 (at
    least 128 packs a block in a cluster) whose slice, held by 128 threads with two buffers,
    gamma and shared sums, fits three times in an SM's shared memory and keeps three blocks
    per SM; "r2g", the first of one block, clusters of 2..16 whose slice the narrowest block
    (128..1024 threads) holds with register sums, two buffers and gamma, resident. Layer norm
    in 8-byte packs past 2048 columns: that "r2g" from clusters of 2.

    Ways: one block a row (size 1) or clusters from the smallest size any way fits up to four
    times it (each block with at least 128 packs); 128..1024 threads (each with a pack, but
    128; float32: the device table's norm_bwd_min_packs_32bit packs); sums in shared memory
    or registers (at most reg_sum_packs packs a thread); one or two buffers (two: packs of at
    least 4 bytes); gamma in shared memory or not (not float64).
    The block's best (gamma, resident threads nearest 1024, shared sums (registers for rows
    of at most 128 packs), busy threads, width, two buffers) stays where it keeps two blocks
    per SM or holds everything on chip (two buffers, or one for 4-byte values, beside gamma
    and shared sums); else clusters with two buffers, gamma and shared sums of the smallest
    size that has one and of twice that, by (layer norm: two blocks per SM, resident threads
    nearest 512, the smaller cluster, the wider block; RMS norm: the smaller cluster, blocks
    nearest 512 threads, more blocks per SM); else the block's best, else the fallback
    cluster (the first size that fits; of shared sums two buffers, one, register sums two,
    one: the first with two blocks per SM, else the first with two buffers, else the first;
    then gamma beside two buffers where it keeps the blocks per SM)."""
    import itertools
    import math

    from cukern import plan as planner
    from cukern import registry
    from cukern.plan.policy import tuning_for

    info = registry.policy(op)
    item = planner.ITEMSIZE[dtype]
    pack = planner.pack_size(dtype, cols, 16, False)
    packs = cols // pack
    apt = max(1, (8 if dtype == "float64" else 16) // pack)
    csize = 8 if dtype == "float64" else 4
    align = info.smem_align
    sums_per_value = info.col_sums * csize

    def blocks_per_sm(size, threads, smem, in_regs, gamma):
        return col_sums_resident(op, dtype, cols, device, occ, size, threads, smem, in_regs,
                                 gamma)

    sizes = [1] + (list(planner.CLUSTER_SIZES) if device.has_clusters else [])

    def r2g(from_sizes):  # sums in registers, two buffers, gamma
        for size in from_sizes:
            sp = -(-packs // size)
            threads = 128
            while threads < 1024 and threads * apt < sp:
                threads *= 2
            if threads * apt < sp:
                continue
            if size > 1 and sp < 128:
                return None
            smem = 2 * 2 * item * sp * pack + 4 * sp * pack + align
            if blocks_per_sm(size, threads, smem, True, True) > 0:
                return size, threads, smem, True, True
        return None

    def s2g():  # 128 threads, everything on chip, three blocks an SM
        for size in sizes:
            sp = -(-packs // size)
            if size > 1 and sp < 128:
                return None
            smem = 2 * 2 * item * sp * pack + sums_per_value * sp * pack + 4 * sp * pack + align
            if 3 * smem <= device.smem_per_sm and \
                    blocks_per_sm(size, 128, smem, False, True) >= 3:
                return size, 128, smem, False, True
        return None

    rule = {o: (named, past) for o, named, past in tuning_for(device).norm_bwd_narrow}.get(op)
    if item == 2 and device.has_clusters and info.col_sums:
        if rule is not None and cols > rule[1] and pack * item == 16:
            for way in rule[0]:
                found = s2g() if way == "s2g" else r2g(sizes)
                if found is not None:
                    return found
        elif op == "layer_norm_backward" and cols > 2048 and pack * item == 8:
            found = r2g(sizes[1:])
            if found is not None:
                return found

    ways, first = [], None  # (size, threads, smem, in_regs, gamma, two, per_sm, slice packs)
    least = tuning_for(device).norm_bwd_min_packs_32bit if item == 4 else 1
    for size in sizes:
        sp = -(-packs // size)
        if (first is not None and size > 4 * first) or (size > 1 and sp < 128):
            break
        for threads in (128, 256, 512, 1024):
            for in_regs, two, gamma in itertools.product((True, False), repeat=3):
                if (threads > 128 and threads * least > sp) or (two and pack * item < 4) or \
                        (in_regs and math.ceil(sp / threads) > apt) or (gamma and csize == 8):
                    continue
                values = sp * pack
                smem = (2 if two else 1) * 2 * item * values + align + \
                    (0 if in_regs else sums_per_value * values) + (4 * values if gamma else 0)
                n = blocks_per_sm(size, threads, smem, in_regs, gamma)
                if n > 0:
                    ways.append((size, threads, smem, in_regs, gamma, two, n, sp))
        if ways and first is None:
            first = size

    def block_rank(w):
        size, threads, smem, in_regs, gamma, two, n, sp = w
        passes = math.ceil(sp / threads)
        return (gamma, -abs(math.log2(threads * n) - 10), in_regs == (sp <= 128),
                sp / (threads * passes), threads, two)

    blocks = [w for w in ways if w[0] == 1]
    best_block = max(blocks, key=block_rank) if blocks else None
    s2g = [w for w in ways if w[0] > 1 and w[5] and w[4] and not w[3]]
    if s2g:
        s0 = min(w[0] for w in s2g)
        s2g = [w for w in s2g if w[0] <= 2 * s0]
    if best_block is not None:
        size, threads, smem, in_regs, gamma, two, n, sp = best_block
        if not s2g or n >= 2 or (gamma and not in_regs and (two or item == 4)):
            return best_block[:5]

    def cluster_rank(w):
        size, threads, smem, in_regs, gamma, two, n, sp = w
        resident = math.log2(threads * n)
        if op == "layer_norm_backward":
            return (n >= 2, -abs(resident - 9), -size, threads)
        return (-size, -abs(math.log2(threads) - 9), n)

    if s2g:
        return max(s2g, key=cluster_rank)[:5]
    if best_block is not None:
        return best_block[:5]
    for size in sizes[1:]:  # the fallback cluster (_cluster_fallback)
        sp = -(-packs // size)
        found = []
        for in_regs, two in itertools.product((False, True), (True, False)):
            if (two and pack * item < 4) or (in_regs and sp > apt * 1024):
                continue
            threads = min(512, planner.block_threads_for(sp))
            while in_regs and threads < min(1024, -(-sp // apt)):
                threads *= 2
            sums = 0 if in_regs else sums_per_value * sp * pack
            smem = (2 if two else 1) * 2 * item * sp * pack + sums + align
            n = blocks_per_sm(size, threads, smem, in_regs, False)
            if n > 0:
                found.append(((threads, smem, in_regs), n, two))
        if not found:
            continue
        pick = next((f for f in found if f[1] >= 2), None) or \
            next((f for f in found if f[2]), None) or found[0]
        (threads, smem, in_regs), n, two = pick
        with_gamma = smem + 4 * sp * pack
        if two and csize == 4 and blocks_per_sm(size, threads, with_gamma, in_regs, True) >= n:
            return size, threads, with_gamma, in_regs, True
        return size, threads, smem, in_regs, False
    return None


# ---------------------------------------------------------------------------------------------
# NVRTC compile checks without a GPU: every kernel instantiation a family's planner can reach
# (registry.kernel_names), compiled for sm_75, sm_80 and sm_90. A test marked
# ``nvrtc(family)`` and parametrised by ``arch`` gets its programs (one a source and dtype,
# split into near-equal parts of at most NVRTC_CHUNK names) submitted to one pool of processes
# when collection ends,
# the largest first: they compile while every other test runs (these run last), and no core
# waits at the end of one test for the last program of another. The test then waits for them
# (nvrtc_results).

# the device model whose plans each compiles; sm_75 (Turing) compiles the pre-Ampere fallbacks
NVRTC_ARCHS = {"sm_75": "t4", "sm_80": "a100", "sm_90": "h100"}
NVRTC_CHUNK = 64  # names a program: a part takes ~10-20 s on a core; the front end ~0.2 s
_nvrtc_pool: cf.ProcessPoolExecutor | None = None
_nvrtc_jobs: dict[tuple[str, str], list] = {}  # (family, arch) -> [(source, dtype, names, job)]


def nvrtc_programs(family: str, arch: str) -> list[tuple[str, str, list[str]]]:
    """(source, dtype, names) for every NVRTC program of ``family``'s compile check on
    ``arch``: each source's names of a dtype (all of the family's ops) in near-equal parts,
    each name once (permute's kernels are the same for every dtype: they come with the
    first)."""
    from cukern import registry
    from cukern._device import DeviceSpec

    device = getattr(DeviceSpec, NVRTC_ARCHS[arch])()
    ops = [name for name, op in registry.OPS.items() if op.family == family]
    assert ops, f"no ops in family {family!r}"
    programs = []
    seen: dict[str, set[str]] = {}  # a name reached by several dtypes compiles once
    for dt in DTYPES:
        for source, names in sorted(registry.kernel_names(ops, [dt], device).items()):
            names = sorted(set(names) - seen.setdefault(source, set()))
            seen[source].update(names)
            parts = -(-len(names) // NVRTC_CHUNK)
            programs += [(source, dt, names[i::parts]) for i in range(parts)]
    return programs


def _compile_check(source: str, names: list[str], arch: str) -> dict[str, str]:
    """``_compile.compile_check`` in a worker, looked up there: the pool pickles a job when a
    worker takes it, by reference, which fails while a test has that function monkeypatched."""
    from cukern import _compile

    return _compile.compile_check(source, names, arch)


def _nvrtc_submit(wanted) -> None:
    """Submits the programs of the (family, arch) pairs in ``wanted`` not yet submitted, the
    largest first (sm_90 programs, with their clusters, take longer a name)."""
    global _nvrtc_pool

    todo = [(key, prog) for key in dict.fromkeys(wanted) if key not in _nvrtc_jobs
            for prog in nvrtc_programs(*key)]
    if not todo:
        return
    if _nvrtc_pool is None:
        _nvrtc_pool = cf.ProcessPoolExecutor(max(1, os.cpu_count() or 1))
    for key, _ in todo:
        _nvrtc_jobs.setdefault(key, [])
    todo.sort(key=lambda t: len(t[1][2]) * (2 if t[0][1] == "sm_90" else 1), reverse=True)
    for (family, arch), (source, dt, names) in todo:
        job = _nvrtc_pool.submit(_compile_check, source, names, arch)
        _nvrtc_jobs[family, arch].append((source, dt, names, job))


def nvrtc_results(family: str, arch: str) -> list[tuple[str, str, list[str], dict]]:
    """(source, dtype, names, name -> lowered symbol) of every program of ``family``'s compile
    check on ``arch``, once compiled (a failure raises NVRTC's RuntimeError with its log)."""
    _nvrtc_submit([(family, arch)])
    return [(source, dt, names, job.result()) for source, dt, names, job in
            _nvrtc_jobs[family, arch]]


def pytest_configure(config):
    config.addinivalue_line("markers", "nvrtc(family): compiles the family's instantiations "
                            "(parametrised by arch; see nvrtc_results); nvrtc alone: a test "
                            "that calls NVRTC itself")


def _family_check(item) -> tuple[str, str] | None:
    """(family, arch) of a test marked ``nvrtc(family)``, else None (``nvrtc`` without a
    family marks a test that compiles on its own)."""
    mark = item.get_closest_marker("nvrtc")
    if mark is None or not mark.args:
        return None
    return mark.args[0], item.callspec.params["arch"]


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    _nvrtc_submit([key for key in map(_family_check, session.items) if key is not None])


def pytest_sessionfinish(session, exitstatus):
    global _nvrtc_pool
    if _nvrtc_pool is not None:
        _nvrtc_pool.shutdown(wait=True, cancel_futures=True)
        _nvrtc_pool = None


def static_smem(family: str, name: str, arch: str = "sm_90") -> int:
    """Static shared memory of the kernel ``name`` (``kernels/<family>.cuh``) on ``arch``, compiled
    alone as the ops compile it (``_compile.get_kernel``: a program a name), from NVRTC's machine
    code (the ELF section ``.nv.shared.<symbol>``), less that of a probe kernel that uses dynamic
    shared memory only (the block's reserved bytes): no GPU needed."""
    import struct

    from cupy.cuda import nvrtc

    from cukern import _compile

    probe = "cukern_dynamic_smem_probe"
    source = _compile.source(family) + (
        f'\nextern "C" __global__ void {probe}(float* p) {{ extern __shared__ float s[]; '
        "s[threadIdx.x] = p[threadIdx.x]; __syncthreads(); "
        "p[threadIdx.x] = s[threadIdx.x ^ 1]; }\n")
    prog = nvrtc.createProgram(source, f"{family}.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, [*_compile.nvrtc_options(), *_compile.check_options(),
                                    f"-arch={arch}"])
        symbol = nvrtc.getLoweredName(prog, name)
        elf = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entry, count, names_at = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entry) for i in range(count)]
    strings = headers[names_at][4]
    sizes = {}
    for h in headers:
        end = elf.index(b"\0", strings + h[0])
        sizes[elf[strings + h[0]:end].decode()] = h[5]
    reserved = sizes[".nv.shared." + probe]
    return sizes.get(".nv.shared." + symbol, reserved) - reserved
