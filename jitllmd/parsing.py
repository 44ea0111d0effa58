"""Option parsing for single-dash long flags (`-chat`, `-addr`): a misspelt one is named whole, with a suggestion."""

from __future__ import annotations

import difflib
from typing import Any

from typer.core import TyperCommand

__all__ = ["Command"]


class Command(TyperCommand):
    """A verb whose unknown-option error names the token the user typed.

    Click tries an unknown `-chta` as a long option first, then as the short-option cluster `-c -h -t -a`, and
    reports the first letter (`No such option: -c`). Here the error names `-chta` and suggests `-chat`, as it does
    for `--chta`. (Typer vendors its own Click, so its exception class is taken from the error itself.)
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        given = list(args)  # Click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except Exception as exc:
            names = [n for p in self.get_params(ctx) if p.param_type_name == "option" for n in (*p.opts, *p.secondary_opts)]
            typed = _typed_token(exc, given, set(names))
            if typed is None:
                raise
            close = difflib.get_close_matches(typed, [n for n in names if len(n) > 2 and not n.startswith("--")])
            no_such_option: Any = type(exc)
            raise no_such_option(typed, possibilities=close, ctx=ctx) from None


def _typed_token(exc: Exception, args: list[str], known: set[str]) -> str | None:
    """The single-dash word that Click cut to its first letter (-c of -chta) in a no-such-option error, or None: the
    first with that letter that is no option's name (`-model x -max-tokens 5` cuts -max-tokens, not -model)."""
    name = getattr(exc, "option_name", None)
    if type(exc).__name__ != "NoSuchOption" or not isinstance(name, str) or len(name) != 2 or name.startswith("--"):
        return None
    for arg in args:
        if arg == "--":
            break
        word = arg.split("=", 1)[0]
        if len(word) > 2 and word.startswith(name) and not word.startswith("--") and word not in known:
            return word
    return None
