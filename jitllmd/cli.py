"""The jitllmd command line: wires one module per verb, nothing else."""

from __future__ import annotations

import typer

from .commands import convert, run, serve

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
app.command("convert")(convert.convert)
app.command("run")(run.run)
app.command("serve")(serve.serve)


def main() -> None:
    app()
