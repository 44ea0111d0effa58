"""The jitllmd command line: wires one module per verb, nothing else."""

from __future__ import annotations

import typer

from .commands import convert, devices, models, place, run, serve, sessions, stats, worker
from .parsing import Command

__all__ = ["app", "main"]

app = typer.Typer(
    name="jitllmd",
    help="LLM inference whose model blocks live on devices or in a host pager.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
app.command("serve", cls=Command)(serve.serve)
app.command("models", cls=Command)(models.models)
app.command("devices", cls=Command)(devices.devices)
app.command("stats", cls=Command)(stats.stats)
app.command("sessions", cls=Command)(sessions.sessions)
app.command("place", cls=Command)(place.place)
app.command("run", cls=Command)(run.run)
app.command("convert", cls=Command)(convert.convert)
app.command("worker", cls=Command)(worker.worker)


def main() -> None:
    app()
