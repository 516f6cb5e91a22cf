"""Which job folders retention keeps (pure)."""

from __future__ import annotations

from rove.control.history.jobs import Folder, to_prune


def _f(job: str, used: float, running: bool = False, pinned: bool = False) -> Folder:
    return Folder(job, used, running, pinned)


def test_retention_keeps_the_newest_the_running_and_the_pinned() -> None:
    folders = [
        _f("a", 1),
        _f("b", 2, running=True),
        _f("c", 3),
        _f("d", 4, pinned=True),
        _f("e", 5),
    ]
    assert to_prune(folders, 2) == ["c", "a"], "oldest last, b running and d pinned kept"
    assert to_prune(folders, 0) == ["e", "c", "a"]
    assert to_prune(folders, 10) == []
    assert to_prune([_f("x", 1, running=True)], 0) == []
