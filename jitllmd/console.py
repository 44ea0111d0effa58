"""The terminal side of the CLI: one rich console, one-line errors with exit code 1, progress bars."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Column

if TYPE_CHECKING:
    from .client import Client

__all__ = ["ApiKey", "connect", "console", "err_console", "fail", "progress_bar"]

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` on stderr and return the Exit to raise."""
    err_console.print(f"[red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    return typer.Exit(code)


ApiKey = Annotated[str | None, typer.Option("-api-key", "--api-key", envvar="JITLLMD_API_KEY", show_envvar=True, show_default=False,
                                           help="The server's API key, if it was started with one.")]


def connect(addr: str | None, api_key: str | None = None) -> Client:
    """The client of the server at -addr (default 127.0.0.1:8080); a malformed address is a usage error (exit 2)."""
    from .client import DEFAULT_ADDR, Client

    try:
        return Client(addr or DEFAULT_ADDR, api_key)
    except ValueError as exc:
        raise fail(str(exc), 2) from None


@contextlib.contextmanager
def progress_bar(label: str, *, as_bytes: bool = False, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar on stderr; yields update(done, total)."""
    if not enabled or not err_console.is_terminal:  # a bar on a pipe only leaves blank lines
        yield lambda done, total: None
        return
    # One line at any width: the figures never wrap, the bar shrinks first, then the label is cut with an ellipsis.
    columns = [
        TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis")),
        BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=5)),
        TaskProgressColumn(table_column=Column(no_wrap=True)),
    ]
    columns += [DownloadColumn(table_column=Column(no_wrap=True))] if as_bytes else []
    columns += [TimeRemainingColumn(table_column=Column(no_wrap=True))]
    with Progress(*columns, console=err_console, transient=True, expand=True) as progress:
        task = progress.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update
