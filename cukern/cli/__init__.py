"""The ``cukern`` command line: cukern's ops on arrays in ``.npy``/``.npz`` files, and tools.

The op commands (:mod:`cukern.cli.ops`: softmax, layer-norm, rms-norm; batch-norm in
:mod:`cukern.cli.batch_norm`; permute in :mod:`cukern.cli.permute`) run on files of any size,
in chunks; the tools (:mod:`cukern.cli.tools`: explain, selftest, precompile; bench in
:mod:`cukern.cli.bench`; info, also called doctor, in :mod:`cukern.cli.info`) read the op list
from :mod:`cukern.registry`. What they share, the error policy included, is in
:mod:`cukern.cli.common`.

Errors are one line on stderr and exit status 2 (the files or arguments are wrong) or 1 (the
machine cannot do it); ``--debug`` shows the traceback too, with the same exit status. Ctrl-C
exits with status 130; SIGTERM and SIGHUP with 128 + the signal number.
"""

from __future__ import annotations

import click

from .. import __version__
from .batch_norm import batch_norm_cmd
from .bench import bench_cmd
from .common import HELP
from .info import info_cmd
from .ops import layer_norm_cmd, rms_norm_cmd, softmax_cmd
from .permute import permute_cmd
from .tools import explain_cmd, precompile_cmd, selftest_cmd

__all__ = ["main", "app"]


class _Group(click.Group):
    def list_commands(self, ctx):
        return list(self.commands)  # in the order they are added, not alphabetical


@click.group("cukern", cls=_Group, context_settings=HELP)
@click.version_option(__version__, prog_name="cukern", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, help="Show the full traceback when something fails.")
@click.pass_context
def app(ctx: click.Context, debug: bool) -> None:
    """Fast CUDA kernels for arrays on disk.

    \b
    Op commands read IN.npy (or ARRAY.npz:KEY) and write OUT.npy:
      cukern softmax logits.npy -o probs.npy --dtype float16
      cukern layer-norm x.npy -o y.npy --weight w.npy --bias b.npy --stats stats.npz
    Files larger than the GPU are processed in chunks of whole rows, with the
    same result as in one piece. The output appears only when complete: a
    failed or interrupted run leaves no partial file and never touches the input.
    --device cpu runs the float64 NumPy reference instead (slow; no GPU needed).

    Errors are one line on stderr, exit status 2 for bad files or arguments and 1
    when the machine cannot do it (no GPU, no disk space); --debug shows more.
    """
    ctx.ensure_object(dict)["debug"] = debug


for _cmd in (softmax_cmd, layer_norm_cmd, rms_norm_cmd, batch_norm_cmd, permute_cmd,
             explain_cmd, info_cmd, bench_cmd, selftest_cmd, precompile_cmd):
    app.add_command(_cmd)
app.add_command(info_cmd, "doctor")  # the same report under the name users look for


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``cukern`` console script. SIGTERM and SIGHUP end a run like Ctrl-C
    does: through the cleanup that removes its unfinished output files (exit 128 + signal)."""
    import signal

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is None:  # no SIGHUP on Windows
            continue
        try:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(signum, terminate)
        except ValueError:  # not the main thread: leave signals alone
            pass
    app.main(args=argv, prog_name="cukern")
