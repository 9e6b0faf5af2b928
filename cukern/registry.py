"""The one table of ops: what the API, ``explain``, the command line, ``bench``, ``selftest``
and ``precompile`` read. An op's row names its family, its policy (planning), its public
function, its float64 reference and the row-sized arrays it moves. Row-wise ops (softmax, the
norms) are planned by ``plan.rowwise`` from their policy; other families (batch norm) have no
policy and declare the kernel instantiations they can reach themselves (``OpSpec.kernels``):
batch norm, and permute (its kernels move words by size, the same for every dtype)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import reference
from .families import batch_norm, norm, permute, softmax
from .plan import ITEMSIZE, OpPolicy, reachable_plans

__all__ = ["OpSpec", "OPS", "get", "names", "policy", "kernel_names"]


@dataclass(frozen=True)
class OpSpec:
    name: str
    family: str  # "softmax" | "norm" | "batch_norm" | "permute"
    policy: OpPolicy | None  # row-wise planning (None: the family plans itself)
    reference: Callable | None  # the float64 NumPy reference, same arguments as the op
    inputs: tuple[str, ...]  # full-size array arguments, in order (a backward's dy first)
    traffic: tuple[int, int]  # full-size arrays read, written (parameters and statistics aside)
    forward: str | None = None  # a backward op's forward
    # (dtype, pack) -> the auxiliary kernels the op may launch beside its planned kernel
    aux: Callable | None = None
    # non-row-wise families: (dtype, device) -> every kernel instantiation the op can reach, in
    # kernels/<kernel_source>.cuh
    kernels: Callable | None = None
    kernel_source: str = ""
    # non-row-wise families: a planned step -> its kernel's C++ name expression
    signature: Callable | None = None

    @property
    def rowwise(self) -> bool:
        """Planned by ``plan.rowwise`` (softmax, the norms), with a policy."""
        return self.policy is not None

    @property
    def source(self) -> str:
        """The kernel source (``kernels/<source>.cuh``) of the op's kernels."""
        return self.policy.source if self.policy is not None else self.kernel_source

    @property
    def cli_name(self) -> str:
        return self.name.replace("_", "-")

    @property
    def fn(self) -> Callable:
        """The public function (``cukern.<name>``)."""
        import cukern

        return getattr(cukern, self.name)

    @property
    def is_backward(self) -> bool:
        return self.forward is not None


def _op(name: str, family: str, policies: dict, inputs: tuple[str, ...],
        traffic: tuple[int, int], forward: str | None = None, aux=None) -> OpSpec:
    return OpSpec(name, family, policies[name], getattr(reference, name), inputs, traffic,
                  forward, aux)


def _bn(name: str, inputs: tuple[str, ...], traffic: tuple[int, int],
        forward: str | None = None) -> OpSpec:
    return OpSpec(name, "batch_norm", None, getattr(reference, name, None), inputs, traffic,
                  forward, kernels=batch_norm.kernel_names(name), kernel_source=batch_norm.SOURCE,
                  signature=batch_norm.name_expression)


OPS: dict[str, OpSpec] = {o.name: o for o in (
    _op("softmax", "softmax", softmax.POLICIES, ("x",), (1, 1)),
    _op("log_softmax", "softmax", softmax.POLICIES, ("x",), (1, 1)),
    _op("softmax_backward", "softmax", softmax.POLICIES, ("dy", "y"), (2, 1), "softmax"),
    _op("log_softmax_backward", "softmax", softmax.POLICIES, ("dy", "y"), (2, 1), "log_softmax"),
    _op("layer_norm", "norm", norm.POLICIES, ("x",), (1, 1)),
    _op("rms_norm", "norm", norm.POLICIES, ("x",), (1, 1)),
    _op("layer_norm_backward", "norm", norm.POLICIES, ("dy", "x"), (2, 1), "layer_norm",
        norm.aux_kernels("layer_norm_backward")),
    _op("rms_norm_backward", "norm", norm.POLICIES, ("dy", "x"), (2, 1), "rms_norm",
        norm.aux_kernels("rms_norm_backward")),
    # traffic as the kernels move it: x read twice in training (statistics, then y)
    _bn("batch_norm", ("x",), (2, 1)),
    _bn("batch_norm_backward", ("dy", "x"), (4, 1), "batch_norm"),
    _bn("batch_stats", ("x",), (1, 0)),
    # reference: numpy.transpose materialised (bit-exact, x's dtype)
    OpSpec("permute", "permute", None, reference.permute, ("x",), (1, 1),
           kernels=permute.kernel_names("permute"), kernel_source=permute.SOURCE,
           signature=permute.name_expression),
)}


def names() -> list[str]:
    return list(OPS)


def get(name: str) -> OpSpec:
    """The op called ``name`` (``"layer_norm"`` or the command line's ``"layer-norm"``)."""
    key = name.replace("-", "_") if isinstance(name, str) else name
    spec = OPS.get(key)
    if spec is None:
        raise ValueError(f"unknown op {name!r}; expected one of "
                         f"{', '.join(o.cli_name for o in OPS.values())}")
    return spec


def policy(op: str) -> OpPolicy:
    """The planning policy of ``op`` (ValueError for an unknown op)."""
    spec = OPS.get(op)
    if spec is None:
        raise ValueError(f"plan: unknown op {op!r}; expected one of {sorted(OPS)}")
    if spec.policy is None:
        raise ValueError(f"plan: {op} is not a row-wise op (family {spec.family}); it has no "
                         f"row-wise policy")
    return spec.policy


def kernel_names(ops, dtypes, device) -> dict[str, set[str]]:
    """Every kernel instantiation the planner can reach for ``ops`` and ``dtypes`` on a device
    of ``device``'s architecture, by kernel source (``kernels/<source>.cuh``)."""
    by_source: dict[str, set[str]] = {}
    for op in ops:
        spec = get(op)
        for dt in dtypes:
            names = by_source.setdefault(spec.source, set())
            if spec.kernels is not None:
                names.update(spec.kernels(dt, device))
                continue
            names.update(reachable_plans(spec.policy, dt, device))
            if spec.aux is not None:  # for every pack size
                for pack in (p for p in (1, 2, 4, 8) if p * ITEMSIZE[dt] <= 16):
                    names.update(spec.aux(dt, pack))
    return by_source
