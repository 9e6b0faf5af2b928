"""bench_permute.py's A/B of the tile kernel's phase 2 switches against the gather of one
element a shared-memory load: perm_byte_regs (the register transpose of 1- and 2-byte
elements, output rows), perm_flat_regs (the interleave of flat output runs of 3-element
blocks) and perm_skew_regs (skewed 32-bit columns of flat output runs of channels: 7x7, 14x14,
int8 28x28 planes NHWC -> NCHW; off, those plan as before: the gather of 7x7 runs, row tiles
of the rest) and perm_async_copy (phase 1 of tiles with a flat side by cp.async; off, through
registers), each by a changed table for the whole run (``--byte-regs``, ``--flat-regs``,
``--skew-regs``, ``--async-regs``) or timed against the plan without it in the same rounds
(``--ab-byte-regs``, ``--ab-flat-regs``, ``--ab-skew-regs``, ``--ab-async-regs``; peer
``gather``)."""

from __future__ import annotations

import argparse
import dataclasses

__all__ = ["SWITCHES", "force_regs", "force_byte_regs", "sizes_arg", "byte_regs_arg",
           "flat_regs_arg", "skew_regs_arg", "add_args", "from_args", "gather_fn",
           "ab_summary"]

# switch -> (Tuning field, PermutePlan attribute set where the plan takes it, sizes it takes)
SWITCHES = {"byte": ("perm_byte_regs", "regs", (1, 2)),
            "flat": ("perm_flat_regs", "flat_regs", (1, 2, 4)),
            "skew": ("perm_skew_regs", "skew_regs", (1, 2)),
            "async": ("perm_async_copy", "async_copy", (1, 2, 4, 8, 16))}


def force_regs(changes: dict) -> None:
    """Plan every permute of this process with the tuning's fields in ``changes`` (field ->
    element sizes) replaced (the planner's table lookup wrapped, as the tests change a rule)."""
    from cukern.plan import permute as pp

    real = pp.tuning_for
    pp.tuning_for = lambda device: dataclasses.replace(real(device), **changes)


def force_byte_regs(sizes: tuple[int, ...]) -> None:
    """:func:`force_regs` of perm_byte_regs alone."""
    force_regs({"perm_byte_regs": sizes})


def sizes_arg(switch: str):
    """The argparse type of ``--<switch>-regs``: "none" or element sizes the switch takes,
    comma-separated."""
    allowed = SWITCHES[switch][2]
    choices = ",".join(map(str, allowed))

    def parse(text: str) -> tuple[int, ...]:
        if text.strip().lower() == "none":
            return ()
        try:
            sizes = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected element sizes among {choices} or none, got {text!r}") from None
        if not sizes or not set(sizes) <= set(allowed):
            raise argparse.ArgumentTypeError(
                f"element sizes among {choices} or none, got {text!r}")
        return sizes

    return parse


byte_regs_arg = sizes_arg("byte")  # --byte-regs: "none" or sizes among 1 and 2
flat_regs_arg = sizes_arg("flat")  # --flat-regs: "none" or sizes among 1, 2 and 4
skew_regs_arg = sizes_arg("skew")  # --skew-regs: "none" or sizes among 1 and 2

_HELP = {"byte": ("element sizes whose tile phase 2 transposes in registers (1,2 / 1 / 2), or "
                  "none (the gather everywhere)", "transposes in registers"),
         "flat": ("element sizes whose flat output runs of 3-element blocks interleave (1,2,4 "
                  "/ ... / none)", "interleaves a flat output run"),
         "skew": ("element sizes whose flat output runs of channels read skewed columns (1,2 "
                  "/ 1 / 2 / none: 7x7 runs gathered, 14x14 and int8 28x28 row tiles)",
                  "reads skewed columns"),
         "async": ("element sizes whose tiles with a flat side copy phase 1 by cp.async "
                   "(1,2,4,8,16 / ... / none: through registers)", "copies by cp.async")}


def add_args(ap: argparse.ArgumentParser) -> None:
    """``--<switch>-regs SIZES`` and ``--ab-<switch>-regs`` for every switch of SWITCHES."""
    for key, (field, _, _) in SWITCHES.items():
        table, where = _HELP[key]
        ap.add_argument(f"--{key}-regs", type=sizes_arg(key), default=None, metavar="SIZES",
                        help=f"the tuning's {field} for this run: {table}; default: the "
                             f"table's")
        ap.add_argument(f"--ab-{key}-regs", action="store_true",
                        help=f"also time cukern's plan without it wherever the plan {where}, "
                             f"interleaved in the same rounds (peer 'gather')")
    ap.add_argument("--skew-words", type=int, choices=(1, 2, 4, 8, 16), default=None,
                    help="the tuning's perm_skew_words for this run, for every element size: "
                         "consecutive 16-byte words of a channel the skewed columns' lanes "
                         "store; default: the table's")


def from_args(args) -> tuple[dict, tuple[str, ...]]:
    """(Tuning field -> sizes forced for the run, switches to A/B) from :func:`add_args`'s
    flags."""
    changes = {field: getattr(args, f"{key}_regs") for key, (field, _, _) in SWITCHES.items()
               if getattr(args, f"{key}_regs") is not None}
    if args.skew_words is not None:
        from cukern.plan import permute as pp

        changes["perm_skew_words"] = (args.skew_words,) * len(pp.SKEW_SIZES)
    ab = tuple(key for key in SWITCHES if getattr(args, f"ab_{key}_regs"))
    return changes, ab


def gather_fn(xs, outs, axes, switches=("byte",)):
    """``fn(i)``: cukern's launch from ``xs[i]`` into ``outs[i]`` (CuPy arrays of one layout
    and alignment) planned with the ``switches`` (keys of SWITCHES) off (the gather), or None
    where cukern's own plan takes none of them (the same kernel)."""
    from cukern import runner
    from cukern.families import permute as fam
    from cukern.ops import permute as ops
    from cukern.plan import permute as pp

    x, o = xs[0], outs[0]
    if not any(getattr(ops.plan_for(x, axes, out=o), SWITCHES[s][1]) for s in switches):
        return None
    item, dev = x.itemsize, x.data.device_id
    _, dims = pp.output_dims(x.shape, [st // item for st in x.strides], axes,
                             [st // item for st in o.strides])
    simple = pp.simplify([d.size for d in dims], [d.in_stride for d in dims],
                         [d.out_stride for d in dims])
    spec = runner.device_spec(dev)
    off = dataclasses.replace(pp.tuning_for(spec), **{SWITCHES[s][0]: () for s in switches})
    plan = pp.plan_permute(simple, item, spec, in_align=ops._align(x.data.ptr),
                           out_align=ops._align(o.data.ptr), signature=fam.name_expression,
                           tuning=off)
    launch = ops._Launch(plan, dev)
    return lambda i: launch(xs[i], outs[i])


def ab_summary(by_case: dict) -> None:
    """Per layout change and dtype, the register phase 2's % of copy against the gather's over
    the shapes that ran both (``by_case``: (group, label, shape, dtype) -> peer -> row)."""
    pairs: dict[tuple, list[tuple[float, float]]] = {}
    for (group, _, _, dtype), by in by_case.items():
        if "gather" in by and "cukern" in by and not by["cukern"].get("error"):
            pairs.setdefault((group, dtype), []).append(
                (by["cukern"]["pct_copy"], by["gather"]["pct_copy"]))
    if not pairs:
        return
    print(f"\n{'registers vs gather':<22} {'n':>3} {'registers %':>12} {'gather %':>12} "
          f"{'gain (points)':>14}")
    for (group, dtype), v in pairs.items():
        regs, gath = [a for a, _ in v], [b for _, b in v]
        gain = [a - b for a, b in v]
        print(f"{group + ' ' + dtype:<22} {len(v):>3} {min(regs):5.1f}-{max(regs):5.1f} "
              f"{min(gath):5.1f}-{max(gath):5.1f} {min(gain):+6.1f}..{max(gain):+5.1f}")
