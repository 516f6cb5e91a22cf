"""rove's loggers in a user's process (a worker): rove's lines go to stderr as short
lines naming the rank, and the process's structlog, stdout and stamina stay its user's.
Each case runs in a fresh interpreter, as a worker is one rove did not configure."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import structlog

from rove.control.process import logs


def worker(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ROVE_", "RANK"))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **env},
        check=False,
    )


def test_in_a_workers_process_rove_says_short_lines_on_stderr_and_leaves_structlog_alone() -> None:
    done = worker(
        """
        import structlog
        mine = []
        def keep(logger, method, event):
            mine.append(event["event"])
            raise structlog.DropEvent
        structlog.configure(processors=[keep])  # the user's own configuration

        from rove.control.bus import connection
        from rove.shard_service import client

        client.log.debug("a debug line")
        client.log.info("an info line")
        client.log.bind(dataset="d").warning("no answer from the master yet", error="late")
        client.log.warning("restored an older step", wanted=60, step=5, why="a bad file")
        try:
            1 / 0
        except ZeroDivisionError:
            connection.log.exception("the feed failed")
        structlog.get_logger().info("the user's own line")
        print("stdout:", mine)
        """,
        RANK="3",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == 'stdout: ["the user\'s own line"]\n', "the user's, untouched"
    lines = done.stderr.splitlines()
    assert lines[0] == "rove: rank 3: no answer from the master yet: late dataset=d"
    assert lines[1] == "rove: rank 3: restored an older step wanted=60 step=5 why='a bad file'"
    assert lines[2] == "rove: rank 3: the feed failed"
    assert lines[3] == "Traceback (most recent call last):" and lines[-1].startswith(
        "ZeroDivisionError"
    )
    assert "debug line" not in done.stderr and "info line" not in done.stderr


def test_rove_log_level_opens_a_workers_info_lines_and_no_rank_is_no_prefix() -> None:
    done = worker(
        "from rove.shard_service import client; client.log.info('an info line')",
        ROVE_LOG_LEVEL="info",
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "rove: an info line\n" and done.stdout == ""


def test_stamina_retry_lines_are_off_in_a_worker_unless_its_user_chose_hooks() -> None:
    code = """
        import stamina.instrumentation as si
        from stamina import _config
        assert _config.CONFIG._on_retry is None, "stamina's private: nobody set hooks"
        {choose}
        from rove.shard_service import client
        client.log.warning("first line")
        print(len(si.get_on_retry_hooks()))
        """
    quiet = worker(code.format(choose=""))
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "0\n", "rove's retries are its own lines"
    chosen = worker(code.format(choose="si.set_on_retry_hooks([lambda details: None])"))
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout == "1\n", "the user's hooks stay"


def test_in_roves_own_processes_its_loggers_follow_structlogs_configuration() -> None:
    # (conftest configured logging as rove's processes do)
    log = logs.get("rove.test").bind(job="j1")
    with structlog.testing.capture_logs() as seen:
        log.warning("said", node="na")
    assert seen == [{"event": "said", "job": "j1", "node": "na", "log_level": "warning"}]
