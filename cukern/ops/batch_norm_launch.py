"""Batch norm's launches (for :mod:`cukern.ops.batch_norm`): a planned step compiled with its
grid (``_Kernel``), a layout's steps (``_Launches``), the forward's launches with the arguments
that do not change from call to call converted once (``_Forward``, what the fast path runs), and
the reductions' and elementwise passes' scalar arguments."""

from __future__ import annotations

import numpy as np

from .. import _compile
from .. import runner as c
from .._launch import RawLaunch
from ..plan import batch_norm as bnplan
from .batch_norm_args import _empty_like, _stat_dtype

__all__: list[str] = []  # cukern.ops.batch_norm's internals

_NULL = 0  # a null pointer argument (cukern._launch slot value)
_SOURCE = "batch_norm"
_last: dict[str, bnplan.BatchNormPlan] = {}  # op -> the plan of its latest call


class _Kernel(RawLaunch):
    """One planned step, compiled, with its grid, block and dynamic shared memory."""

    __slots__ = ("kind", "pack")

    def __init__(self, step: bnplan.Step, device_id: int):
        self.kind = step.kind
        self.pack = step.targs[1] if len(step.targs) > 1 else 1  # elements a thread's access
        kern = _compile.get_kernel(_SOURCE, step.kernel, device_id)
        if step.smem > kern.max_dynamic_shared_size_bytes:  # past the default 48 KiB
            kern.max_dynamic_shared_size_bytes = step.smem
        if step.cluster > c.PORTABLE_CLUSTER:
            c.allow_non_portable_clusters(kern)
        super().__init__(kern.kernel.ptr, step.grid, step.block, step.smem,
                         cluster=step.cluster)


class _Launches:
    __slots__ = ("plan", "steps", "fwd", "bwd")

    def __init__(self, plan, steps):
        self.plan = plan
        self.steps = steps
        self.fwd: _Forward | None = None  # batch_norm's launches with their fixed arguments
        self.bwd: _Backward | None = None  # batch_norm_backward's


class _Forward:
    """batch_norm's launches for one layout and set of switches, with the arguments that do
    not change from call to call converted once; what both the full path and the fast path
    (a CuPy call of a layout seen before) run."""

    __slots__ = ("plan", "device", "cdt", "nch", "words", "want_mask", "stats", "finalize", "apply",
                 "coef", "part_shape", "count", "training", "stats_tail", "fin_head",
                 "apply_tail", "one_read", "one_read_tail")

    def __init__(self, plan, steps, device_id: int, relu: bool, want_mask: bool):
        a_, ch, inner = plan.view
        cdt = _stat_dtype(plan.dtype)
        self.plan, self.device, self.cdt, self.nch = plan, device_id, cdt, ch
        self.words, self.want_mask = -(-(a_ * ch * inner) // 32), want_mask
        self.stats = steps[0] if plan.training else None
        self.finalize = steps[-2] if len(steps) > 1 and steps[-2].kind == "finalize" else None
        self.apply = steps[-1]
        self.coef = len(steps) > 1  # training, or eval with mean and invstd asked for
        self.part_shape = (ch, plan.splits, 3) if plan.splits > 1 else None
        cs = c._c_scalars
        self.count, self.training = cs((cdt(a_ * inner), np.int32(plan.training)))
        self.stats_tail = () if self.stats is None else _reduction_tail(plan, self.stats)
        self.fin_head = cs((np.int32(plan.splits), np.int32(ch)))
        self.apply_tail = cs((*_flat_args(plan), np.int32(relu)))
        self.one_read = steps[0] if plan.one_read else None
        if self.one_read is not None and self.one_read.kind == "train_cols":
            # C / PACK in the step's packs (16-bit: bn_one_read_cols_max_pack_16bit)
            self.one_read_tail = cs((np.int32(relu), np.int64(a_),
                                     np.int32(ch // self.one_read.pack)))
        elif self.one_read is not None:
            packs = inner // plan.pack  # a plane's (B % PACK == 0)
            self.one_read_tail = cs((np.int32(relu), np.int64(a_), np.int32(ch),
                                     np.int32(packs), *map(np.uint32, bnplan.fast_div(packs))))

    def __call__(self, x, z, y, mask, mean, invstd, rm, rv, w, b, momentum, eps) -> None:
        cdt = self.cdt
        if self.one_read is not None:
            if mask is not None:  # the kernel ORs its bits into zeroed words
                c.cp.cuda.runtime.memsetAsync(mask.data.ptr, 0, 4 * self.words,
                                              c.cp.cuda.get_current_stream().ptr)
            self.one_read(x, _arg(z), y, _arg(mask), *self.one_read_tail, self.count,
                          self.training, _arg(rm), _arg(rv), _arg(w), _arg(b),
                          _scalar(cdt, momentum), _scalar(cdt, eps), _arg(mean), _arg(invstd),
                          _NULL, _NULL)
            return
        coef = None
        if self.coef:
            coef = c.new_array((self.nch, 4), cdt)
            finish = (self.count, self.training, _arg(rm), _arg(rv), _arg(w), _arg(b),
                      _scalar(cdt, momentum), _scalar(cdt, eps), _arg(mean), _arg(invstd),
                      _NULL, coef)
            part = None
            if self.stats is not None:
                if self.part_shape is not None:
                    part = c.new_array(self.part_shape, cdt)
                self.stats(x, _arg(part), *self.stats_tail, *finish)
            if self.finalize is not None:
                self.finalize(_arg(part), *self.fin_head, *finish)
            c.keep(coef, part)  # a captured graph writes them on every replay
        self.apply(x, _arg(z), _arg(coef), y, _arg(mask), *self.apply_tail, _arg(rm), _arg(rv),
                   _arg(w), _arg(b), _scalar(cdt, eps))

    def fresh(self, x, rm, rv, w, b, z, momentum, eps, return_stats: bool):
        """The fast path: new outputs for a validated layout, then the launches."""
        y = _empty_like(x)  # of x's kind: CuPy, or a tensor's TensorView
        mask = c.empty(x, (self.words,), np.int32) if self.want_mask else None
        mean = invstd = None
        if return_stats:
            mean = c.empty(x, (self.nch,), self.cdt)
            invstd = c.empty(x, (self.nch,), self.cdt)
        self(x, z, y, mask, mean, invstd, rm, rv, w, b, momentum, eps)
        _last["batch_norm"] = self.plan
        return (y, mean, invstd, mask) if return_stats else y


def _stats(step, xw, plan, view, finish):
    """Launches the statistics pass: partial states (returned), or with one split the
    finished channels (``finish``: the bn::Finish arguments; returns None)."""
    part = None
    if plan.splits > 1:
        part = c.new_array((view.channels, plan.splits, 3), _stat_dtype(plan.dtype))
    step(xw, _arg(part), *_reduction_tail(plan, step), *finish)
    return part


def _reduction_tail(plan, step) -> tuple:
    """A channel reduction's (statistics, gradient sums) scalar arguments after its pointers,
    converted: (A, C, B, W, w_m, w_s, splits) over planes, (A, C / PACK, splits) over
    columns."""
    a_, ch, _ = plan.view
    if plan.layout == bnplan.PLANES:
        return c._c_scalars((np.int64(a_), np.int32(ch), *_plane_args(plan),
                             np.int32(plan.splits)))
    return c._c_scalars((np.int64(a_), np.int32(ch // step.pack), np.int32(plan.splits)))


def _plane_args(plan):
    """The planes reductions' (B, W, w_m, w_s): elements and packs a plane (bnplan.plane_packs)
    and the fast_div constants of W."""
    inner = plan.view.inner
    w = bnplan.plane_packs(inner, plan.pack)
    mg, sh = bnplan.fast_div(w)
    return np.int32(inner), np.int32(w), np.uint32(mg), np.uint32(sh)


def _flat_args(plan):
    """The elementwise kernels' (total, CBp, d, d_m, d_s, upp) (bnplan.flat_args)."""
    total, cbp, d, mg, sh, upp = bnplan.flat_args(plan)
    return (np.int64(total), np.int32(cbp), np.int32(d), np.uint32(mg), np.uint32(sh),
            np.uint32(upp))


def _arg(a):
    return _NULL if a is None else a


_scalars: dict[tuple, int] = {}  # (compute dtype, value) -> the kernel argument's slot bits


def _scalar(cdt, v) -> int:
    """``cdt(v)`` as a launch slot value, converted once per value (momentum and eps repeat
    from call to call)."""
    key = (cdt, v)
    r = _scalars.get(key)
    if r is None:
        if len(_scalars) >= 256:
            _scalars.clear()
        r = _scalars[key] = c.bits(cdt(v))
    return r


class _Backward:
    """batch_norm_backward's launches for one layout and set of switches, with the arguments
    that do not change from call to call converted once; what both the full path and the fast
    path run. A call: the gradient sums per channel into ``dwt``, ``dbs`` and the coefficients
    (partials and their merge where the plan splits channels), then ``dx`` (and ``da``); the
    temporaries kept while capturing."""

    __slots__ = ("plan", "device", "sdt", "nch", "part_shape", "reduce", "merge", "apply",
                 "count", "training", "reduce_tail", "merge_head", "apply_tail")

    def __init__(self, plan, steps, device_id: int, training: bool):
        a_, ch, inner = plan.view
        sdt = _stat_dtype(plan.dtype)
        self.plan, self.device, self.sdt, self.nch = plan, device_id, sdt, ch
        self.part_shape = (ch, plan.splits, 2) if plan.splits > 1 else None
        self.reduce, self.apply = steps[0], steps[-1]
        self.merge = steps[1] if steps[1].kind == "grad_finalize" else None
        cs = c._c_scalars
        self.count, self.training = cs((sdt(a_ * inner), np.int32(training)))
        self.reduce_tail = _reduction_tail(plan, self.reduce)
        self.merge_head = cs((np.int32(plan.splits), np.int32(ch)))
        self.apply_tail = cs(_flat_args(plan))

    def __call__(self, dy, x, m, mu, ist, w, dx, da, dwt, dbs) -> None:
        sdt = self.sdt
        part = c.new_array(self.part_shape, sdt) if self.part_shape is not None else None
        coef = c.new_array((self.nch, 4), sdt)
        c.keep(part, coef)  # a captured graph writes them on every replay
        finish = (self.count, self.training, ist, _arg(w), dwt, dbs, coef)
        self.reduce(dy, x, _arg(m), mu, _arg(part), *self.reduce_tail, *finish)
        if self.merge is not None:
            self.merge(part, *self.merge_head, mu, *finish)
        self.apply(dy, x if self.training else _NULL, _arg(m), coef, dx, _arg(da),
                   *self.apply_tail)


def stats_launch(plan, steps, xw, mean, var) -> None:
    """batch_stats' launches (its full path's and its fast path's) into ``mean`` and ``var``;
    the partial states kept while capturing."""
    a_, ch, inner = plan.view
    sdt = _stat_dtype(plan.dtype)
    finish = (sdt(a_ * inner), np.int32(1), _NULL, _NULL, _NULL, _NULL, sdt(0), sdt(1), mean,
              _NULL, var, _NULL)
    part = _stats(steps[0], xw, plan, plan.view, finish)
    c.keep(part)
    if len(steps) > 1:
        steps[1](part, np.int32(plan.splits), np.int32(ch), *finish)
