"""Documentation that cannot go stale: the generated catalogue and the README's commands."""

from __future__ import annotations

import re
from pathlib import Path

from rove.control.catalogue import eventdoc

ROOT = Path(__file__).parent.parent


def test_events_md_is_generated_from_the_catalogue() -> None:
    checked_in = (ROOT / "docs" / "events.md").read_text()
    assert checked_in == eventdoc.render(), (
        "docs/events.md is stale: run `python -m rove.control.catalogue.eventdoc > docs/events.md`"
    )


def test_readme_opens_with_the_two_commands() -> None:
    lines = [x.strip() for x in (ROOT / "README.md").read_text().splitlines()]
    commands = [x for x in lines if x.startswith("make ")][:2]
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _code_commands(path: Path) -> list[str]:
    """`rove ...` lines of the code blocks, with backslash continuations joined."""
    commands, inside, pending = [], False, ""
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        text = line.split("#", 1)[0].strip()
        if pending:
            text, pending = f"{pending} {text}", ""
        if text.endswith("\\"):
            pending = text[:-1].strip()
            continue
        if inside and text.startswith("rove "):
            commands.append(text)
    return commands


def test_every_rove_command_in_the_docs_parses() -> None:
    import shlex

    from rove.control.cli.main import build_parser

    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands = [c for d in docs for c in _code_commands(d)]
    assert len(commands) >= 8
    from rove.agent.run_args import build_parser as run_parser

    parser = build_parser()
    for command in commands:
        words = shlex.split(command)[1:]
        if words[0] == "run":
            args = run_parser().parse_args(words[1:])
            assert args.training_script, command
        else:
            args = parser.parse_args(words)
            assert args.func is not None, command


def _python_blocks(path: Path) -> list[str]:
    blocks, current, inside = [], [], False
    for line in path.read_text().splitlines():
        if line.startswith("```python"):
            inside, current = True, []
        elif line.startswith("```") and inside:
            inside = False
            blocks.append("\n".join(current))
        elif inside:
            current.append(line)
    return blocks


def test_python_in_the_docs_runs(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path))
    docs = [d for d in sorted((ROOT / "docs").glob("*.md")) if _python_blocks(d)]
    assert len(docs) >= 2
    for doc in docs:  # a document's snippets run in order, sharing their names
        model = torch.nn.Linear(2, 2)
        namespace = {
            "torch": torch,
            "model": model,
            "step": 1,
            "batch_size": 4,
            "tmp_dir": tmp_path / doc.stem,
            "opt": torch.optim.SGD(model.parameters(), lr=0.1),
        }
        for code in _python_blocks(doc):
            exec(compile(code, doc.name, "exec"), namespace)


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_link_in_the_docs_leads_to_a_file_of_the_project() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in docs:
        text = doc.read_text()
        assert "../shared" not in text, f"{doc.name} points outside the project"
        for target in _LINK.findall(text):
            if target.startswith(("http://", "https://", "#")):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            assert path.is_relative_to(ROOT), f"{doc.name}: {target} leaves the project"
            assert path.exists(), f"{doc.name}: {target} does not exist"


def _blocks(path: Path) -> list[list[str]]:
    blocks: list[list[str]] = []
    inside = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            if inside:
                blocks.append([])
            continue
        if inside:
            blocks[-1].append(line)
    return blocks


def test_the_readme_says_where_rove_and_nats_server_are() -> None:
    text = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in text, "rove is in .venv/bin, not on PATH"
    servers = [x for b in _blocks(ROOT / "README.md") for x in b if "nats-server" in x]
    assert any(" -js" in x for x in servers), "how to start a JetStream server"
