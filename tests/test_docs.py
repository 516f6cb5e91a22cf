"""Documentation that cannot go stale: the generated catalogue and the README's commands."""

from __future__ import annotations

from pathlib import Path

from rove.control import eventdoc

ROOT = Path(__file__).parent.parent


def test_events_md_is_generated_from_the_catalogue() -> None:
    checked_in = (ROOT / "docs" / "events.md").read_text()
    assert checked_in == eventdoc.render(), (
        "docs/events.md is stale: run `python -m rove.control.eventdoc > docs/events.md`"
    )


def test_readme_opens_with_the_two_commands() -> None:
    lines = [x.strip() for x in (ROOT / "README.md").read_text().splitlines()]
    commands = [x for x in lines if x.startswith("make ")][:2]
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _code_commands(path: Path) -> list[str]:
    commands, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        text = line.split("#", 1)[0].strip()
        if inside and text.startswith("rove "):
            commands.append(text)
    return commands


def test_every_rove_command_in_the_docs_parses() -> None:
    import shlex

    from rove.control.cli.main import build_parser

    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands = [c for d in docs for c in _code_commands(d)]
    assert len(commands) >= 8
    from rove.agent.launcher import build_parser as run_parser

    parser = build_parser()
    for command in commands:
        words = shlex.split(command)[1:]
        if words[0] == "run":
            args = run_parser().parse_args(words[1:])
            assert args.training_script, command
        else:
            args = parser.parse_args(words)
            assert args.func is not None, command
