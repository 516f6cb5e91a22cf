"""One checkpoint location, one job at a time: a running job marks its location, and
`rove run` of another job on it is refused before anything starts (two jobs that write
one location at once remove each other's steps)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgspec
import pytest

from rove.agent import run_checks
from rove.checkpoint import writers
from rove.checkpoint.storage import FileStorage
from rove.checkpoint.stores import open_storage
from rove.control.errors import ConfigError
from tests.support import TRAIN, RunProc, eventually, rove_cli


def mark(job: str, at: float, node: str = "n1") -> writers.WriterMark:
    return writers.WriterMark(job=job, node=node, at=at, since=at)


def test_only_other_jobs_marked_lately_count_as_writing() -> None:
    now = 1000.0
    marks = [
        mark("mine", now),
        mark("old", now - writers.LIVE_S - 1),  # killed without ending: stopped counting
        mark("b", now - 30),
        mark("c", now - 2),
        mark("ahead", now + 5),  # another machine's clock a little ahead
    ]
    assert [m.job for m in writers.live_others(marks, "mine", now)] == ["ahead", "c", "b"]
    assert writers.live_others([mark("mine", now)], "mine", now) == []


def test_marks_are_written_read_and_removed_on_files(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "ck")
    writers.mark(storage, "a", "n1", 10.0)
    writers.mark(storage, "a", "n2", 12.0)  # the job's other node: one mark per job
    writers.mark(storage, "b", "n9", 11.0)
    (tmp_path / "ck" / "writers" / "junk.json").write_text("not a mark")  # no rove's: left out
    assert sorted(writers.read(storage), key=lambda m: m.job) == [
        mark("a", 12.0, "n2"),
        mark("b", 11.0, "n9"),
    ]
    assert storage.steps() == []  # (the marks are no step)
    storage.drop_mark("a")
    storage.drop_mark("a")  # (gone already: nothing)
    assert [m.job for m in writers.read(storage)] == ["b"]


def test_rove_run_refuses_a_location_another_job_marked_lately(tmp_path: Path) -> None:
    location = str(tmp_path / "ck")
    storage = open_storage(location)
    writers.mark(storage, "a", "n1", time.time() - 3)
    with pytest.raises(ConfigError) as refused:
        run_checks.check_writers(location, "b", "n1")
    said = str(refused.value)
    assert f"--checkpoint-dir {location} is being written by another job, a" in said
    assert "its node n1 marked it 3 s ago" in said
    assert "Give job b a --checkpoint-dir of its own" in said
    assert f"{location}/writers/a.json stops counting" in said
    run_checks.check_writers(location, "a", "n2")  # its own mark: a job run again, or its node
    writers.mark(storage, "a", "n1", time.time() - writers.LIVE_S - 1)  # a, killed, went stale
    run_checks.check_writers(location, "b", "n1")
    run_checks.check_writers(str(tmp_path / "none"), "b", "n1")  # nothing there yet


def test_of_two_jobs_started_at_once_on_a_location_the_later_claim_gives_way(
    tmp_path: Path,
) -> None:
    """Each writes its claim before it reads: whichever reads first, the job that
    claimed second sees the first and is refused, and its claim is taken back; the
    first goes on, seeing nobody before it. Claims of one moment go by job name."""
    storage = FileStorage(tmp_path / "ck")
    now = time.time()
    # a claims and reads before b writes: a sees nobody; b sees a, and gives way
    assert writers.claim(storage, "a", "n1", now) == []
    refused = writers.claim(storage, "b", "n1", now + 0.5)
    assert [m.job for m in refused] == ["a"]
    assert [m.job for m in writers.read(storage)] == ["a"], "b's claim taken back"
    storage.drop_mark("a")
    # both wrote before either read: the later one still gives way, the earlier goes on
    writers.mark(storage, "b", "n1", now + 0.5)  # (b's claim, written; b reads later)
    assert writers.claim(storage, "a", "n1", now) == [], "a claimed first: b is after it"
    assert writers.claim(storage, "b", "n1", now + 0.5)[0].job == "a"
    storage.drop_mark("a")
    # the same moment: the first name goes on
    writers.mark(storage, "b", "n1", now)
    assert writers.claim(storage, "a", "n1", now) == []
    storage.drop_mark("a")


def test_a_jobs_claim_keeps_its_first_time_through_its_nodes_and_refreshes(
    tmp_path: Path,
) -> None:
    """The job's other nodes (and a `rove run` of it again) keep its claim's time, and
    are not refused for a job that claimed after it; an older rove's mark, with no
    claim time, dates from its last refresh."""
    storage = FileStorage(tmp_path / "ck")
    now = time.time()
    assert writers.claim(storage, "a", "n1", now - 20) == []
    writers.mark(storage, "b", "n1", now - 5)  # b got past somehow, after a
    assert writers.claim(storage, "a", "n2", now) == []  # a's second node
    [a] = [m for m in writers.read(storage) if m.job == "a"]
    assert (a.node, a.at, a.since) == ("n2", now, now - 20)
    assert [m.job for m in writers.claim(storage, "b", "n2", now)] == ["a"]
    assert "b" in [m.job for m in writers.read(storage)], "b's nodes keep b's own claim"
    old = msgspec.json.encode({"job": "x", "node": "n1", "at": now - 30})
    assert writers.decode(old) == writers.WriterMark(job="x", node="n1", at=now - 30)
    assert writers.WriterMark(job="x", node="n1", at=now - 30).first == now - 30


def test_a_location_that_does_not_answer_is_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung network file system: `rove run` starts without knowing, and does not hang."""
    release = threading.Event()

    def hung(_self: FileStorage) -> list[bytes]:
        release.wait(60)
        return []

    monkeypatch.setattr(FileStorage, "marks", hung)
    monkeypatch.setattr(run_checks, "WRITERS_READ_S", 0.5)
    try:
        began = time.monotonic()
        run_checks.check_writers(str(tmp_path / "ck"), "b", "n1")
        assert time.monotonic() - began < 30
    finally:
        release.set()


def test_marks_on_an_object_store(s3_url: str) -> None:
    storage = open_storage(s3_url)
    writers.mark(storage, "a", "n1", time.time())
    assert [m.job for m in writers.read(storage)] == ["a"]
    assert storage.steps() == []
    with pytest.raises(ConfigError, match=f"{s3_url}/writers/a.json"):
        run_checks.check_writers(s3_url, "b", "n1")
    storage.drop_mark("a")
    storage.drop_mark("a")
    assert writers.read(storage) == []
    run_checks.check_writers(s3_url, "b", "n1")


async def test_a_second_job_on_a_running_jobs_location_is_refused_and_the_first_keeps_its_steps(
    tmp_path: Path,
) -> None:
    """Job a trains on a --checkpoint-dir; job b given the same is refused (it used to go
    on from a's step, and each job's commits removed the other's steps: b ended saying
    its last step was committed, and it was gone). a is told of a job found writing
    beside it; a's end removes its mark, and its last step is there."""
    ck, home = tmp_path / "ck", tmp_path / "home"
    env = {"ROVE_HOME": str(home), "ROVE_SHM_DIR": str(tmp_path / "shm")}
    a = RunProc(
        tmp_path,
        "a",
        *("--standalone", "--job", "a", "--checkpoint-dir", str(ck), str(TRAIN)),
        *("--steps", "100", "--ckpt-every", "5", "--log-every", "5", "--step-sleep", "0.25"),
        env=env,
    )
    try:
        storage = open_storage(ck)
        await eventually(lambda: [m.job for m in writers.read(storage)] == ["a"], timeout=60)
        b = rove_cli(
            *("run", "--standalone", "--job", "b", "--checkpoint-dir", str(ck), str(TRAIN)),
            *("--steps", "10"),
            env=env,
            timeout=60,
        )
        assert b.returncode == 2, b.stdout + b.stderr
        assert "is being written by another job, a (its node" in b.stderr, b.stderr
        assert not (home / "jobs" / "b").exists()  # refused before anything started

        # a job that got past the check all the same (started in the same moment) is
        # said by a's agent at its next refresh of its mark
        def beside() -> bool:
            writers.mark(storage, "x", "n7", time.time())
            return "another job, x, writes checkpoints in" in a.log()

        await eventually(beside, timeout=60, every=1.0)
        storage.drop_mark("x")
        assert a.wait(180) == 0, a.log()[-3000:]
    finally:
        a.kill()
    assert writers.read(storage) == []  # its end removed its mark
    assert storage.committed() == 100 and 100 in storage.steps()


async def test_of_two_jobs_run_at_once_on_one_location_one_trains_and_one_is_refused(
    tmp_path: Path,
) -> None:
    """A sweep started with one --checkpoint-dir for all its jobs: each `rove run`
    claims the location before anything starts, so one job trains and the others are
    refused. (Before, all of them got past the check, since a job marked its location
    only once its agent ran, and each removed the others' steps.)"""
    ck = tmp_path / "ck"
    runs = {
        job: RunProc(
            tmp_path,
            job,
            *("--standalone", "--job", job, "--checkpoint-dir", str(ck), str(TRAIN)),
            *("--steps", "10", "--ckpt-every", "5"),
            env={"ROVE_HOME": str(tmp_path / "home")},
        )
        for job in ("sweep-a", "sweep-b")
    }
    codes = {job: run.wait(180) for job, run in runs.items()}
    assert sorted(codes.values()) == [0, 2], {job: r.log()[-2000:] for job, r in runs.items()}
    [refused] = [job for job, code in codes.items() if code == 2]
    [trained] = [job for job, code in codes.items() if code == 0]
    said = runs[refused].log()
    assert f"is being written by another job, {trained}" in said, said[-2000:]
    storage = open_storage(ck)
    assert storage.committed() == 10 and writers.read(storage) == []


def test_nodes_whose_processes_have_the_same_id_refresh_one_mark_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a file system several machines share, the nodes of a job write one mark, and
    containers' processes have the same small ids: the temporary file was named by the
    process id alone, and one node's rename took the other's file from under it."""
    monkeypatch.setattr("os.getpid", lambda: 1)
    storage = FileStorage(tmp_path / "ck")
    failed: list[Exception] = []

    def node(name: str) -> None:
        for i in range(300):
            try:
                writers.mark(storage, "a", name, float(i))
            except Exception as exc:
                failed.append(exc)

    threads = [threading.Thread(target=node, args=(n,)) for n in ("n1", "n2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed[:3]
    assert [m.job for m in writers.read(storage)] == ["a"]
    assert [p.name for p in (tmp_path / "ck" / "writers").iterdir()] == ["a.json"]


async def test_a_job_ends_though_its_location_does_not_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark's refresh and its removal hang on a store that does not answer: the
    node's end waits for them a few seconds, not for ever."""
    import asyncio

    import structlog

    from rove.agent import ckpt_mark

    release = threading.Event()

    class Hung(FileStorage):
        def put_mark(self, job: str, raw: bytes) -> None:
            release.wait(60)

        def drop_mark(self, job: str) -> None:
            release.wait(60)

    monkeypatch.setattr(ckpt_mark, "DROP_S", 0.3)
    mark = ckpt_mark.LocationMark(Hung(tmp_path), "a", "n1", structlog.get_logger())
    try:
        mark.tick()
        await asyncio.sleep(0.1)  # the refresh is under way, and hangs
        began = time.monotonic()
        await mark.stop()
        assert time.monotonic() - began < 10
    finally:
        release.set()
