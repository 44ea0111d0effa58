"""The jitllmd command line: wires one module per verb, nothing else."""

from __future__ import annotations

import typer

from .commands import convert, devices, models, place, run, serve, sessions, stats

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
app.command("serve")(serve.serve)
app.command("models")(models.models)
app.command("devices")(devices.devices)
app.command("stats")(stats.stats)
app.command("sessions")(sessions.sessions)
app.command("place")(place.place)
app.command("run")(run.run)
app.command("convert")(convert.convert)


def main() -> None:
    app()
