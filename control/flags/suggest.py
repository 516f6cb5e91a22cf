"""A mistyped flag or command gets the nearest real one suggested (pure but for the
parser it reads), as `git` does: `--jbo` → "did you mean --job?"."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Sequence
from typing import NoReturn

_CHOICE = re.compile(r"invalid choice: '([^']*)'")


def hint(parser: argparse.ArgumentParser, message: str, argv: Sequence[str]) -> str:
    """`message` with a "did you mean" for each unknown flag of `argv` and a mistyped
    choice (a command), when one is near."""
    known = list(parser._option_string_actions)
    script_at = getattr(parser, "script_at", None)  # `rove run`: the script's words are its own
    at = script_at(argv, lenient=True) if script_at is not None else None
    guesses = []
    for token in argv[:at]:
        flag = token.split("=", 1)[0]
        if flag.startswith("-") and not _known(flag, known) and not _is_number(flag):
            near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if near:
                guesses.append(f"{flag} → {near[0]}")
    choice = _CHOICE.search(message)
    if choice is not None:
        options = [c for a in parser._actions if a.choices is not None for c in a.choices]
        near = difflib.get_close_matches(choice.group(1), [str(o) for o in options], n=1)
        if near:
            guesses.append(f"{choice.group(1)} → {near[0]}")
    return message + (f" (did you mean: {', '.join(guesses)}?)" if guesses else "")


def _known(flag: str, known: list[str]) -> bool:
    """A flag, an abbreviation of flags (argparse names those it could be) or a short
    flag with its value attached (`-r3`)."""
    if flag.startswith("--"):
        return any(k.startswith(flag) for k in known)
    return flag in known or flag[:2] in known


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def install(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    reword: Callable[[str], str] = lambda message: message,
) -> None:
    """Make `parser` (and its subcommands' parsers) say an error in one line, with
    suggestions, and exit 2 (argparse printed its whole usage first: 45 lines for `rove
    run`, the error last). `reword`: a parser's own words for argparse's message."""

    def error(message: str) -> NoReturn:
        # (argparse says a subcommand's unknown flags as the top parser: said as theirs)
        unknown = message.startswith("unrecognized arguments")
        by = (_command(parser, argv) if unknown else None) or parser
        said = reword(message)
        if not (unknown and said != message):  # (unknown flags a rewording explained)
            said = hint(by, said, argv)
        parser.exit(2, f"{by.prog}: {said}; see {by.prog} --help\n")

    parser.error = error  # type: ignore[method-assign]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                install(sub, argv, reword)


def _command(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> argparse.ArgumentParser | None:
    """The parser of the subcommand `argv` names (its first word that is one), if any."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            named = next((w for w in argv if w in action.choices), None)
            return None if named is None else action.choices[named]
    return None
