"""GPUs before Ampere, without a GPU: the T4 and V100 presets and the planner on them (no
clusters, their shared memory), the minimum-GPU error raised before any compile, the
``CUKERN_FORCE_FALLBACKS`` switch reaching NVRTC's options (and CuPy's cache key), and the
fallback code compiled for sm_90 (where only the forcing macro selects it), its PTX free of the
sm_80 instructions it replaces. Their results bit for bit: tests/test_fallbacks_gpu.py."""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest

from cukern import _compile, _device, registry, runner
from cukern import plan as planner
from cukern._device import DeviceSpec, UnsupportedDeviceError
from cukern.plan import Variant, plan_rowwise, tuning_for
from cukern.plan import batch_norm as bp
from cukern.plan import permute as pp

from .conftest import DTYPES, nvrtc_programs
from .test_permute_cpu import simple_of

T4, V100, A100 = DeviceSpec.t4(), DeviceSpec.v100(), DeviceSpec.a100()
OLD = (T4, V100)
ROWWISE = [name for name, op in registry.OPS.items() if op.rowwise]


# ---------------------------------------------------------------------------------------------
# Presets and tuning.

def test_presets():
    assert T4.arch == "sm_75" and V100.arch == "sm_70"
    assert (T4.sms, T4.max_threads_per_sm, T4.smem_per_block_optin) == (40, 1024, 65536)
    assert (V100.sms, V100.max_threads_per_sm, V100.smem_per_block_optin) == (80, 2048, 98304)
    for dev in OLD:
        assert not dev.has_clusters and dev.reserved_smem_per_block == 0
        assert tuning_for(dev).arch == dev.arch
        # no reserved shared memory before Ampere: no division by zero at smem 0
        assert dev.model_occupancy(1024, 0) == dev.max_threads_per_sm // 1024
    assert T4.model_occupancy(256, 32768) == 2 and T4.model_occupancy(256, 65537) == 0
    assert V100.model_occupancy(128, 0) == 16 and V100.model_occupancy(128, 49152) == 2


# ---------------------------------------------------------------------------------------------
# The planner on them.

def _cols(rng):
    return sorted({*range(1, 80, 7), 127, 1000, 1024, 1025, 2048, 4096, 8192, 12288, 16000, 16384,
                   24576, 32768, 65536, 131072, 1 << 20,
                   *(int(c) for c in rng.integers(1, 3_000_000, 25))})


@pytest.mark.parametrize("dev", OLD, ids=lambda d: d.arch)
def test_rowwise_plans_fit(dev):
    rng = np.random.default_rng(1)
    cols = _cols(rng)
    for op in ROWWISE:
        pol = registry.policy(op)
        for dt in DTYPES:
            reach = planner.reachable_plans(op, dt, dev)
            for sw in {pol.switch_sets[0], pol.switch_sets[-1]}:
                for c in cols:
                    for rows, align in ((1, 16), (4096, 16), (7, 1)):
                        p = plan_rowwise(op, rows, c, dt, dev, align_elems=align, switches=sw)
                        where = f"{op} {dt} {rows}x{c} align {align}: {p}"
                        assert p.cluster <= 1 and p.variant is not Variant.CLUSTER, where
                        assert p.smem_bytes <= dev.smem_per_block_optin, where
                        assert dev.model_occupancy(p.threads, p.smem_bytes) >= 1, where
                        assert p.name_expression() in reach, where
                        grad = planner.plan_param_grad(p, dev)
                        if grad is not None:
                            assert "cluster" not in str(grad).lower(), where


def test_smaller_shared_memory_moves_rows_off_chip():
    # float32 layer norm of 16000 columns: 64000 bytes a row, cached on an A100 (163 KiB a
    # block) and on a V100 (96 KiB), past a T4's 64 KiB less the kernels' static memory
    def variant(dev):
        return plan_rowwise("layer_norm", 4096, 16000, "float32", dev).variant

    assert variant(A100) is Variant.BLOCK_SMEM and variant(V100) is Variant.BLOCK_SMEM
    assert variant(T4) is not Variant.BLOCK_SMEM
    assert planner.max_dynamic_smem(T4) < 64000 < planner.max_dynamic_smem(V100)


@pytest.mark.parametrize("dev", OLD, ids=lambda d: d.arch)
def test_batch_norm_and_permute_plans_fit(dev):
    for shape, layout in [((64, 256, 56, 56), "NCHW"), ((64, 256, 56, 56), "NHWC"),
                          ((256, 2048, 7, 7), "NHWC"), ((16384, 1024), "NCHW"), ((3, 5), "NCHW")]:
        strides = bp.layout_strides(shape, 1, layout)
        view = bp.channel_view(shape, strides, 1)
        for op in ("batch_norm", "batch_norm_backward", "batch_stats"):
            for dt in DTYPES:
                p = bp.plan_batch_norm(op, view, dt, dev, signature=lambda *a: "")
                for s in p.steps:
                    threads = int(np.prod(s.block))
                    assert s.smem <= dev.smem_per_block_optin, (op, dt, shape, s)
                    assert dev.model_occupancy(threads, s.smem) >= 1, (op, dt, shape, s)
    for shape, axes, item in [((64, 256, 56, 56), (0, 2, 3, 1), 2), ((4096, 4096), (1, 0), 1),
                              ((64, 3, 224, 224), (0, 2, 3, 1), 4), ((7, 9, 11), (2, 0, 1), 8)]:
        x = np.lib.stride_tricks.as_strided(np.empty(1, f"V{item}"), shape,
                                            [s * item for s in pp.c_strides(shape)])
        p = pp.plan_permute(simple_of(x, axes), item, dev)
        assert p.smem <= dev.smem_per_block_optin, (shape, axes, p)
        assert dev.model_occupancy(p.block[0] * p.block[1], p.smem) >= 1, (shape, axes, p)


# ---------------------------------------------------------------------------------------------
# The minimum GPU: one clear error, before anything is compiled.

@pytest.fixture
def live(monkeypatch):
    """Pretends device 0 is ``spec`` under NVRTC ``major`` (no GPU needed); any kernel compile
    fails the test."""
    def pretend(spec, major):
        monkeypatch.setattr(_device, "_live_spec", lambda i: spec)
        monkeypatch.setattr(_device, "_nvrtc_major", lambda: major)
        _device.supported_spec.cache_clear()

    def no_compile(*args, **kwargs):
        raise AssertionError("a kernel was compiled for an unsupported GPU")

    monkeypatch.setattr(_compile, "get_kernel", no_compile)
    monkeypatch.setattr(_compile, "compile_check", no_compile)
    yield pretend
    _device.supported_spec.cache_clear()


def _as_live(spec, name, cc):
    import dataclasses

    return dataclasses.replace(spec, name=name, compute_capability=cc, device_id=0)


def test_minimum_compute_capability():
    assert _device.min_compute_capability(13) == (7, 5)
    assert _device.min_compute_capability(14) == (7, 5)
    assert _device.min_compute_capability(12) == (7, 0)


def test_volta_under_cuda13_names_gpu_and_minimum(live):
    v100 = _as_live(V100, "Tesla V100-SXM2-16GB", (7, 0))
    live(v100, 13)
    for call in (lambda: runner.device_spec(0), lambda: DeviceSpec.from_device(0)):
        with pytest.raises(UnsupportedDeviceError) as err:
            call()
        msg = str(err.value)
        assert "GPU 0 'Tesla V100-SXM2-16GB'" in msg and "compute capability 7.0" in msg
        assert "needs 7.5 (sm_75) or newer" in msg and "cuda12" in msg, msg
    assert isinstance(err.value, RuntimeError)
    # reported, not refused, where asked (cukern info)
    assert DeviceSpec.from_device(0, check=False) is v100


def test_volta_under_cuda12_and_turing_are_supported(live):
    v100 = _as_live(V100, "Tesla V100-SXM2-16GB", (7, 0))
    live(v100, 12)
    assert runner.device_spec(0) is v100
    t4 = _as_live(T4, "Tesla T4", (7, 5))
    live(t4, 13)
    assert runner.device_spec(0) is t4 and DeviceSpec.from_device(0) is t4


def test_pascal_is_refused_by_every_nvrtc(live):
    p100 = _as_live(V100, "Tesla P100-PCIE-16GB", (6, 0))
    for major, least in ((12, "7.0 (sm_70)"), (13, "7.5 (sm_75)")):
        live(p100, major)
        with pytest.raises(UnsupportedDeviceError, match=re.escape(least)) as err:
            runner.device_spec(0)
        assert "P100" in str(err.value) and "6.0 (sm_60)" in str(err.value)
        assert "cuda12" not in str(err.value)  # no extra helps a Pascal


def test_presets_check_without_a_device():
    DeviceSpec.t4().check_supported()  # whatever NVRTC: 7.5 is the highest minimum
    A100.check_supported()


# ---------------------------------------------------------------------------------------------
# CUKERN_FORCE_FALLBACKS: NVRTC's options, hence CuPy's cache key (cupy.cuda.compiler keys a
# module on its options beside the source), and cukern's own per-process cache.

def test_force_fallbacks_env(monkeypatch):
    monkeypatch.delenv("CUKERN_FORCE_FALLBACKS", raising=False)
    assert not _compile.fallbacks_forced() and _compile.nvrtc_options() == ("-std=c++17",)
    for value, forced in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("CUKERN_FORCE_FALLBACKS", value)
        assert _compile.fallbacks_forced() is forced
        assert ("-DCUKERN_FORCE_FALLBACKS" in _compile.nvrtc_options()) is forced
    assert "-DCUKERN_FORCE_FALLBACKS" in _compile.nvrtc_options(True)
    monkeypatch.setenv("CUKERN_FORCE_FALLBACKS", "1")
    assert _compile.nvrtc_options(False) == ("-std=c++17",)


def test_get_kernel_builds_forced_and_normal_apart(monkeypatch):
    built = []

    class Module:
        def __init__(self, code, options, name_expressions):
            built.append(options)
            self.options = options

        def get_function(self, name):
            return (name, self.options)

    class Device:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.SimpleNamespace(RawModule=Module, cuda=types.SimpleNamespace(Device=Device))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_compile, "_kernels", {})
    name = "cukern::softmax_warp<float, 0, 1, 1, 1, false>"
    monkeypatch.delenv("CUKERN_FORCE_FALLBACKS", raising=False)
    normal = _compile.get_kernel("softmax", name, 0)
    monkeypatch.setenv("CUKERN_FORCE_FALLBACKS", "1")
    forced = _compile.get_kernel("softmax", name, 0)
    assert forced is _compile.get_kernel("softmax", name, 0)  # cached, once
    monkeypatch.delenv("CUKERN_FORCE_FALLBACKS")
    assert normal is _compile.get_kernel("softmax", name, 0)
    assert built == [("-std=c++17",), ("-std=c++17", "-DCUKERN_FORCE_FALLBACKS")]
    assert forced[1] == built[1]


# ---------------------------------------------------------------------------------------------
# The fallback code, compiled where only the forcing macro selects it.

SM80_ONLY = re.compile(r"max\.NaN|cvt\.rn\.bf16|cp\.async\.(?!bulk\.prefetch)")


def _sample(family: str) -> dict[str, list[str]]:
    """A few names a source of ``family`` (sm_90, clusters included): of bfloat16 (the
    conversion) and float32 (max.NaN), the first, the first and last block kernels with a row
    cache (cp.async from the wider packs) and the first cluster."""
    by: dict[tuple[str, str], list[str]] = {}
    for source, dt, names in nvrtc_programs(family, "sm_90"):
        by.setdefault((source, dt), []).extend(sorted(names))
    picked: dict[str, list[str]] = {}
    for (source, dt), names in sorted(by.items()):
        if family != "permute" and dt not in ("bfloat16", "float32"):
            continue
        block = [n for n in names if "block_smem" in n]
        cluster = [n for n in names if "cluster" in n]
        for n in [names[0], *block[:1], *block[-1:], *cluster[:1]]:
            if n not in picked.setdefault(source, []):
                picked[source].append(n)
    return picked


def _ptx(source: str, names, arch: str, fallbacks: bool) -> str:
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(_compile.source(source), f"{source}.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        nvrtc.compileProgram(prog, [*_compile.nvrtc_options(fallbacks),
                                    f"-arch={arch.replace('sm', 'compute')}"])
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@pytest.mark.nvrtc
@pytest.mark.parametrize("family", ["softmax", "norm", "batch_norm", "permute"])
def test_forced_fallbacks_compile_for_sm90(family):
    for source, names in _sample(family).items():
        lowered = _compile.compile_check(source, names, "sm_90", fallbacks=True)
        assert set(lowered) == set(names) and all(lowered.values())
        ptx = _ptx(source, names, "sm_90", fallbacks=True)
        assert not SM80_ONLY.findall(ptx), (source, sorted(set(SM80_ONLY.findall(ptx))))


@pytest.mark.nvrtc
def test_fallbacks_replace_the_sm80_instructions():
    # the normal sm_80 build has each instruction the fallbacks replace; sm_75 has none
    names = {"softmax": _sample("softmax")["softmax"][:2],
             "layer_norm_grad": _sample("norm")["layer_norm_grad"][:2]}
    found = set()
    for source, ns in names.items():
        found |= {m[:6] for m in SM80_ONLY.findall(_ptx(source, ns, "sm_80", fallbacks=False))}
        assert not SM80_ONLY.findall(_ptx(source, ns, "sm_75", fallbacks=False)), source
    assert found == {"max.Na", "cvt.rn", "cp.asy"}, found
