"""Device facts and occupancy.

A :class:`DeviceSpec` is a frozen description of a GPU: enough to plan kernels. It comes from a
real device (:meth:`DeviceSpec.from_device`) or from a preset (:meth:`DeviceSpec.h100`,
:meth:`DeviceSpec.a100`, :meth:`DeviceSpec.t4`, :meth:`DeviceSpec.v100`) so plans can be inspected
on a machine with no GPU.

The oldest GPU cukern runs on (:func:`min_compute_capability`) is a Turing (sm_75) with CUDA 13's
NVRTC, which no longer compiles for Volta, and a Volta (sm_70) with CUDA 12's. A live device
below it raises :class:`UnsupportedDeviceError` before any kernel is compiled.

Occupancy (resident blocks per multiprocessor) is what the planner asks of a device. On a real
device the CUDA driver answers for the compiled kernel; a preset answers from a model of the
limits that do not depend on the compiled code:

    blocks = min(max_blocks_per_sm,
                 max_threads_per_sm // threads,
                 smem_per_sm // (smem + reserved_smem_per_block))   if smem <= smem_per_block_optin
    blocks = 0                                                       otherwise

The model ignores registers: cukern's kernels are built for at most 64 registers a thread at
128 threads and 32 at 1024 (``__launch_bounds__``), where registers do not limit residency.
The planner's model (``plan.common.model_occupancy``) adds the one register limit it knows: a
block kernel with its width compiled in may use that width's whole budget.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DeviceSpec", "PRESETS", "UnsupportedDeviceError", "min_compute_capability"]


class UnsupportedDeviceError(RuntimeError):
    """A GPU older than cukern's minimum for the NVRTC it runs with (min_compute_capability)."""


@functools.cache
def _nvrtc_major() -> int:
    from cupy.cuda import nvrtc

    return int(nvrtc.getVersion()[0])


def min_compute_capability(nvrtc_major: int | None = None) -> tuple[int, int]:
    """The oldest compute capability cukern supports with NVRTC of this major version (the one
    CuPy loads by default): (7, 5) with CUDA 13 and newer, whose NVRTC dropped sm_70; (7, 0)
    with CUDA 12."""
    major = _nvrtc_major() if nvrtc_major is None else nvrtc_major
    return (7, 5) if major >= 13 else (7, 0)


@dataclass(frozen=True)
class DeviceSpec:
    """What the planner needs to know about a GPU."""

    name: str
    compute_capability: tuple[int, int]
    sms: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int
    smem_per_block_optin: int
    reserved_smem_per_block: int = 1024
    device_id: int | None = None  # None: a preset, not a live device

    @property
    def arch(self) -> str:
        """The NVRTC target, e.g. ``sm_90``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def has_clusters(self) -> bool:
        """Thread-block clusters and distributed shared memory (Hopper and newer)."""
        return self.compute_capability >= (9, 0)

    @classmethod
    def h100(cls) -> DeviceSpec:
        """NVIDIA H100 SXM (80 GB HBM3): 132 SMs, 227 KiB of shared memory per block."""
        return cls("NVIDIA H100 80GB HBM3 (preset)", (9, 0), 132, 2048, 32, 233472, 232448)

    @classmethod
    def h200(cls) -> DeviceSpec:
        """NVIDIA H200 SXM (141 GB HBM3e): the H100's SMs and shared memory; the H100's plans
        but for the rules the H200's own tuning changes (``cukern.plan.policy._MODELS``)."""
        return cls("NVIDIA H200 (preset)", (9, 0), 132, 2048, 32, 233472, 232448)

    @classmethod
    def a100(cls) -> DeviceSpec:
        """NVIDIA A100 SXM: 108 SMs, 163 KiB of shared memory per block."""
        return cls("NVIDIA A100-SXM4 (preset)", (8, 0), 108, 2048, 32, 167936, 166912)

    @classmethod
    def preset(cls, name: str) -> DeviceSpec:
        """The preset called ``name`` (a key of :data:`PRESETS`, any case), e.g. ``"h100"``."""
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in PRESETS:
            raise ValueError(f"unknown device preset {name!r}; expected one of "
                             f"{', '.join(PRESETS)}")
        return PRESETS[key]()

    @classmethod
    def t4(cls) -> DeviceSpec:
        """NVIDIA T4 (Turing, sm_75): 40 SMs, 1024 threads and 64 KiB of shared memory per SM,
        all of it for one block."""
        return cls("NVIDIA Tesla T4 (preset)", (7, 5), 40, 1024, 16, 65536, 65536, 0)

    @classmethod
    def v100(cls) -> DeviceSpec:
        """NVIDIA V100 SXM2 (Volta, sm_70): 80 SMs, 96 KiB of shared memory per block (opt-in)."""
        return cls("NVIDIA Tesla V100-SXM2 (preset)", (7, 0), 80, 2048, 32, 98304, 98304, 0)

    @classmethod
    def from_device(cls, device_id: int | None = None, check: bool = True) -> DeviceSpec:
        """The spec of a live CUDA device (the current one by default). ``check``: raise
        :class:`UnsupportedDeviceError` for a GPU below :func:`min_compute_capability`."""
        device_id = _current_device_id() if device_id is None else int(device_id)
        return supported_spec(device_id) if check else _live_spec(device_id)

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedDeviceError`, naming the GPU, its compute capability and the
        minimum, where this device is older than :func:`min_compute_capability`."""
        least = min_compute_capability()
        if tuple(self.compute_capability) >= least:
            return
        cc = "{}.{}".format(*self.compute_capability)
        where = "" if self.device_id is None else f"GPU {self.device_id} "
        extra = " (CUDA 13's NVRTC no longer compiles for sm_70; cukern[cuda12] supports 7.0)" \
            if least == (7, 5) and tuple(self.compute_capability) >= (7, 0) else ""
        raise UnsupportedDeviceError(
            f"cukern: {where}{self.name!r} has compute capability {cc} ({self.arch}); cukern "
            f"needs {least[0]}.{least[1]} (sm_{least[0]}{least[1]}) or newer with this NVRTC "
            f"{_nvrtc_major()}.x{extra}")

    def model_occupancy(self, threads: int, smem: int) -> int:
        """Resident blocks per SM from threads and dynamic shared memory (see module doc)."""
        if threads <= 0 or threads > 1024:
            return 0
        if smem > self.smem_per_block_optin:
            return 0
        warps_threads = -(-threads // 32) * 32
        blocks = min(self.max_blocks_per_sm, self.max_threads_per_sm // warps_threads)
        if smem + self.reserved_smem_per_block > 0:  # no block reserve before sm_80
            blocks = min(blocks, self.smem_per_sm // (smem + self.reserved_smem_per_block))
        return max(blocks, 0)

    def describe(self) -> str:
        major, minor = self.compute_capability
        return (
            f"{self.name}: sm_{major}{minor}, {self.sms} SMs, "
            f"{self.smem_per_block_optin // 1024} KiB shared memory per block (opt-in)"
        )


# The presets by name: what ``explain(device="h100")`` and ``cukern explain --device`` accept.
PRESETS: dict[str, Callable[[], DeviceSpec]] = {
    "h100": DeviceSpec.h100,
    "h200": DeviceSpec.h200,
    "a100": DeviceSpec.a100,
    "t4": DeviceSpec.t4,
    "v100": DeviceSpec.v100,
}


def _current_device_id() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


@functools.cache
def supported_spec(device_id: int) -> DeviceSpec:
    """The live spec of a device cukern supports (else UnsupportedDeviceError), cached: what the
    ops plan with, checked before any kernel of theirs is compiled."""
    spec = _live_spec(device_id)
    spec.check_supported()
    return spec


@functools.cache
def _live_spec(device_id: int) -> DeviceSpec:
    import cupy

    dev = cupy.cuda.Device(device_id)
    attrs = dev.attributes
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return DeviceSpec(
        name=name,
        compute_capability=(int(props["major"]), int(props["minor"])),
        sms=attrs["MultiProcessorCount"],
        max_threads_per_sm=attrs["MaxThreadsPerMultiProcessor"],
        max_blocks_per_sm=int(props.get("maxBlocksPerMultiProcessor", 32)),
        smem_per_sm=attrs["MaxSharedMemoryPerMultiprocessor"],
        smem_per_block_optin=attrs["MaxSharedMemoryPerBlockOptin"],
        reserved_smem_per_block=int(props.get("reservedSharedMemPerBlock",
                                              1024 if props["major"] >= 8 else 0)),
        device_id=device_id,
    )
