"""What every ``cukern`` command shares: the error policy, devices, files and argument parsing.

A command registered with :func:`_command` reports :class:`~cukern._io.InputError` as exit
status 2 and :class:`~cukern._io.RunError` or any other failure as exit status 1, each as one
``Error: ...`` line on stderr; ``--debug`` prints the traceback before it, with the same exit
status. Ctrl-C exits with status 130.
"""

from __future__ import annotations

import functools
import importlib
import sys
import traceback
from pathlib import Path

import click
import numpy as np

from .. import _io
from .._io import InputError, RunError

DTYPES = ("float16", "bfloat16", "float32", "float64")
# what only moves bytes (permute) takes besides: bool, integers, complex
MOVE_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
               "complex64", "complex128")
HELP = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# ------------------------------------------------------------------------------------------
# Errors


class _Fail(click.ClickException):
    """A one-line ``Error: ...`` on stderr with the given exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.exit_code = code


def _command(name: str):
    """A click command with a ``--debug`` option and the error policy above; the group in
    :mod:`cukern.cli` adds it."""

    def wrap(fn):
        @functools.wraps(fn)
        def run_it(*args, debug: bool = False, **kwargs):
            ctx = click.get_current_context()
            debug = debug or bool((ctx.find_root().obj or {}).get("debug"))
            try:
                # NaN and inf in the data are results (as on the GPU), not errors: no NumPy
                # RuntimeWarnings for them, e.g. when float64 results are cast to float16
                with np.errstate(invalid="ignore", over="ignore", divide="ignore",
                                 under="ignore"):
                    return fn(*args, **kwargs)
            except (click.exceptions.Exit, click.ClickException, click.Abort):
                raise
            except KeyboardInterrupt:  # the outputs are already removed; 130 as shells report
                click.echo("Aborted!", err=True)
                raise click.exceptions.Exit(130) from None
            except InputError as err:
                _traceback(debug)
                raise _Fail(str(err), 2) from None
            except RunError as err:
                _traceback(debug)
                raise _Fail(str(err), 1) from None
            except Exception as err:
                _traceback(debug)
                raise _Fail(_describe(err), 1) from None

        cmd = click.command(name, context_settings=HELP)(run_it)
        cmd.params.append(click.Option(["--debug"], is_flag=True,
                                       help="Show the full traceback when something fails."))
        return cmd

    return wrap


def _traceback(debug: bool) -> None:
    """With ``--debug``, the traceback of the error being handled on stderr (the exit status
    stays the same)."""
    if debug:
        click.echo(traceback.format_exc().rstrip(), err=True)


def _describe(err: BaseException) -> str:
    """One line for an unexpected error: its type and the first line of its message."""
    kind = type(err).__name__
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if "OutOfMemory" in kind:
        return (f"out of GPU memory ({text}); pass a smaller --chunk-rows "
                f"(run with --debug for the traceback)")
    return f"{kind}: {text} (run with --debug for the traceback)"


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split(": ", 1)[-1] if text.startswith("cuda") else text


# ------------------------------------------------------------------------------------------
# Devices. The commands call _gpu_problem and _require through this module (common._require),
# so that a test can replace them in one place.


def _gpu_problem(device_id: int = 0) -> str | None:
    """Why the GPU ``device_id`` cannot be used (no driver, a driver too old, no device), or
    None."""
    from .._env import gpu_problem

    return gpu_problem(device_id)


def _device(spec: str, instead: str = "--device cpu runs the NumPy reference instead"):
    """``--device``: ``"cpu"``, or a usable CUDA device id (else RunError, suggesting
    ``instead``)."""
    s = spec.strip().lower()
    if s == "cpu":
        return "cpu"
    if s in ("gpu", "cuda"):
        dev = 0
    else:
        tail = s.split(":", 1)[1] if s.startswith(("gpu:", "cuda:")) else s
        if not tail.isdigit():
            raise InputError(f"--device {spec}: expected gpu, gpu:N or cpu")
        dev = int(tail)
    problem = _gpu_problem(dev)
    if problem:
        raise RunError(f"{problem}; {instead}")
    return dev


def _require(device, name: str, command: str):
    """The op function ``name`` (cukern.NAME on a GPU, cukern.reference.NAME on the CPU)."""
    module = importlib.import_module("cukern.reference" if device == "cpu" else "cukern")
    fn = getattr(module, name, None)
    if fn is None:
        raise RunError(f"{command} is not available: this cukern has no "
                       f"{module.__name__}.{name}")
    return fn


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


def _show_progress(quiet: bool) -> bool:
    """A progress bar only on a terminal, and not with -q."""
    return not quiet and _isatty(sys.stderr)


# ------------------------------------------------------------------------------------------
# Files, dtypes, shapes and lists


def _open(spec: str, opt: str | None = None) -> np.ndarray:
    what = f"{opt} {spec}" if opt else spec
    return _io.open_array(spec, what)


def _output_path(value: str, opt: str, suffix: str) -> Path:
    path = Path(value)
    if path.suffix != suffix:
        raise InputError(f"{opt} {value}: the output must be a {suffix} file")
    return path


def _spec_path(spec: str) -> Path:
    return _io.split_spec(spec)[0]


def _work_dtype(dtype: str | None, like: np.dtype) -> np.dtype:
    return _io.float_dtype(like if dtype is None else _io.np_dtype(dtype), "--dtype")


def _fmt(shape) -> str:
    return "x".join(map(str, shape)) if len(shape) else "()"


def _same_shape(opt: str, path: str, a: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    if a.shape != ref.shape:
        raise InputError(f"{opt} {path} has shape {_fmt(a.shape)}, expected {_fmt(ref.shape)} "
                         f"(the shape of {ref_name})")


def _check_eps(op: str, eps: float, work: np.dtype) -> None:
    """``--eps`` as the op ``op`` checks its eps for ``work`` data, with the op's message, on
    the GPU and on the CPU alike."""
    from ..runner import check_eps

    try:
        check_eps(op, eps, np.dtype(work).name)
    except ValueError as err:
        raise InputError(str(err)) from None


def _check_row(device, cols: int, what: str) -> None:
    """Rows of ``cols`` values must fit the GPU kernels (the NumPy reference takes any)."""
    from ..plan import MAX_COLS

    if device != "cpu" and cols > MAX_COLS:
        raise InputError(f"{what} has rows of {cols} values; the GPU kernels take at most "
                         f"{MAX_COLS} (2^31 - 4096); --device cpu runs the NumPy reference "
                         f"instead")


def _parse_shape(text: str, opt: str) -> tuple[int, ...]:
    parts = [t for t in text.replace(",", "x").replace("*", "x").lower().split("x")]
    try:
        shape = tuple(int(t) for t in parts)
    except ValueError:
        raise InputError(f"{opt} {text}: expected sizes like 768 or 12x64") from None
    if not shape or any(n < 0 for n in shape):
        raise InputError(f"{opt} {text}: expected sizes like 768 or 12x64")
    return shape


def _parse_list(text: str, opt: str, allowed) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise InputError(f"{opt} is empty")
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise InputError(f"{opt}: unknown {', '.join(bad)}; expected {', '.join(allowed)}")
    return items
