"""``cukern info`` (also ``cukern doctor``): versions, GPUs, the kernel cache and whether each
kernel family compiles here, as a table or (``--json``) as the dict of :func:`cukern._env.report`.
"""

from __future__ import annotations

import json

import click

from .. import _env, _io
from .common import _command

__all__ = ["info_cmd"]


@_command("info")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON (keys in docs/cli.md).")
@click.option("--no-compile", is_flag=True,
              help="Skip the NVRTC compile check of each kernel family (about 2 s).")
def info_cmd(as_json, no_compile):
    """Driver, CUDA runtime, NVRTC, GPUs, the kernel cache, and what compiles here.

    \b
    For each GPU: name, compute capability, SMs, memory. Then one small NVRTC
    compile per kernel family for each GPU's architecture (sm_90 with no GPU):
    whether cukern's kernels build with this NVRTC. Exits 0 whatever it finds;
    the compile check fails only if a family does not build (exit 1).
    """
    rep = _env.report(compile_check=not no_compile)
    if as_json:
        click.echo(json.dumps(rep, indent=1))
    else:
        _table(_rows(rep))
    bad = [c for c in rep["compile"] if not c["ok"]]
    if bad:
        raise _io.RunError(f"{len(bad)} kernel famil{'y' if len(bad) == 1 else 'ies'} failed "
                           f"to compile: {', '.join(c['family'] for c in bad)} "
                           f"({bad[0]['error']})")


def _rows(rep: dict) -> list[tuple[str, str]]:
    na = "none"
    rows = [("cukern", rep["cukern"]), ("NumPy", rep["numpy"]),
            ("CuPy", rep["cupy"] or "not importable"),
            ("CUDA runtime", rep["cuda_runtime"] or na),
            ("NVIDIA driver", rep["nvidia_driver"] or "not found"),
            ("CUDA driver", rep["cuda_driver"] or "none (no NVIDIA driver found)"),
            ("NVRTC", rep["nvrtc"] or f"not available ({rep.get('nvrtc_error', '?')})")]
    cache = rep["cache"]
    rows.append(("kernel cache", f"{cache['dir']} ({cache['files']} files, "
                                 f"{_io._size(cache['bytes'])})"))
    if cache["fallback_from"]:
        rows.append(("", f"(instead of {cache['fallback_from']}, which cannot be used)"))
    if rep["gpu_problem"]:
        rows.append(("GPU", f"none: {rep['gpu_problem']}"))
    for g in rep["gpus"]:
        rows += [
            (f"GPU {g['id']}", g["name"]),
            ("  compute", f"{g['arch']} (compute capability {g['compute_capability']}), "
                          f"{g['sms']} SMs"),
            ("  memory", f"{g['memory_bytes'] / 2**30:.1f} GiB, "
                         f"{g['free_bytes'] / 2**30:.1f} GiB free"),
            ("  shared memory", f"{g['smem_per_block_optin'] // 1024} KiB per block (opt-in), "
                                f"{g['smem_per_sm'] // 1024} KiB per SM"),
        ]
    for c in rep["compile"]:
        state = f"ok ({c['seconds']:.1f} s)" if c["ok"] else f"FAILED: {c['error']}"
        rows.append((f"compiles {c['arch']}", f"{c['family']:<16} {state}"))
    return rows


def _table(rows) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")
