"""Failure diagnosis from exit codes, signals, torch's error file and log tails."""

from __future__ import annotations

import json

import pytest

from rove.agent.diagnosis import (
    classify,
    last_exception,
    port_in_use,
    read_tail,
    signal_name,
    where,
)
from rove.control.catalogue.events import REASON_CHARS, FailureKind

TRACEBACK = """[default0]:Traceback (most recent call last):
[default0]:  File "train.py", line 3, in <module>
[default0]:    main()
[default0]:  File "train.py", line 2, in main
[default0]:    raise ValueError("learning rate must be positive, got -1")
[default0]:ValueError: learning rate must be positive, got -1
"""


@pytest.mark.parametrize(
    ("exit_code", "data", "tail", "kind", "reason_part"),
    [
        (1, None, TRACEBACK, FailureKind.USER_ERROR, "ValueError: learning rate must be positive"),
        (
            1,
            {"message": {"message": "KeyError: 'lr'", "extraInfo": {}}},
            "",
            FailureKind.USER_ERROR,
            "KeyError: 'lr'",
        ),
        (-9, None, "", FailureKind.KILLED, "SIGKILL"),
        (137, None, "", FailureKind.KILLED, "SIGKILL"),
        (-15, None, "", FailureKind.KILLED, "SIGTERM"),
        (-11, None, "", FailureKind.SEGFAULT, "SIGSEGV"),
        (
            1,
            None,
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            FailureKind.OOM,
            "CUDA out of memory",
        ),
        (
            1,
            None,
            "Traceback (most recent call last):\nMemoryError\n",
            FailureKind.OOM,
            "MemoryError",
        ),
        (
            1,
            None,
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
            "Connection closed by peer [127.0.0.1]:1234",
            FailureKind.COMMUNICATION,
            "gloo",
        ),
        (
            -6,
            None,
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
            FailureKind.COMMUNICATION,
            "NCCL error",
        ),
        (  # a TensorFlow task whose port another process took (rove.agent.tf_server)
            75,
            None,
            "rove: worker 0 cannot serve: port 20123 of this node is taken by another "
            "process (Address already in use); the round starts again on fresh ports",
            FailureKind.COMMUNICATION,
            "port 20123",
        ),
        (  # the same in a chief's own server: a port, not the user's code
            1,
            None,
            "tensorflow.python.framework.errors_impl.UnknownError: Could not start gRPC server",
            FailureKind.COMMUNICATION,
            "Could not start gRPC server",
        ),
        (
            1,
            None,
            "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
            FailureKind.HARDWARE,
            "Xid",
        ),
        (-6, None, "", FailureKind.SEGFAULT, "SIGABRT"),
        (3, None, "", FailureKind.UNKNOWN, "exited with code 3"),
        (  # sys.exit("...") says why on stderr, with no traceback
            1,
            None,
            "step 10/100\n[default0]:no data in /mnt/x: mount it first\n\n",
            FailureKind.UNKNOWN,
            "exited with code 1; the last line it wrote: no data in /mnt/x: mount it first",
        ),
        (  # argparse refused the script's arguments
            2,
            None,
            "usage: train.py [-h] [--epochs EPOCHS]\n"
            "train.py: error: unrecognized arguments: --steps 100\n",
            FailureKind.USER_ERROR,
            "its command line was refused: train.py: error: unrecognized arguments: --steps 100",
        ),
        (  # python -m without its module (rove's workers say it as python does)
            1,
            None,
            "/usr/bin/python3: No module named pkg.trian\n",
            FailureKind.USER_ERROR,
            "python -m: No module named pkg.trian",
        ),
        (
            1,
            None,
            "[1]:/usr/bin/python3: Error while finding module specification for 'a.b' "
            "(ModuleNotFoundError: No module named 'a')\n",
            FailureKind.USER_ERROR,
            "python -m: Error while finding module specification for 'a.b'",
        ),
        (  # the same words with another exit code: not argparse's
            3,
            None,
            "train.py: error: unrecognized arguments: --steps 100\n",
            FailureKind.UNKNOWN,
            "exited with code 3",
        ),
    ],
)
def test_classify(
    exit_code: int, data: object, tail: str, kind: FailureKind, reason_part: str
) -> None:
    d = classify(exit_code, data, tail)
    assert d.kind is kind
    assert reason_part in d.reason


def test_a_kill_is_not_mistaken_for_the_user_error_its_log_happens_to_contain() -> None:
    assert classify(-9, None, TRACEBACK).kind is FailureKind.KILLED


def test_a_worker_that_raised_and_was_torn_down_in_its_ending_is_its_exception() -> None:
    """Its error file records what it raised; torch's SIGTERM came after (its peer had
    failed meanwhile). (Once diagnosed 'killed by SIGTERM', and a repeated user error
    then took one more restart to be seen.)"""
    recorded = {"message": {"message": "ValueError: learning rate must be positive"}}
    d = classify(-15, recorded, "")
    assert d.kind is FailureKind.USER_ERROR and "learning rate" in d.reason
    assert classify(-15, None, TRACEBACK).kind is FailureKind.KILLED, "without the file: killed"


def test_the_reason_is_bounded_even_for_huge_messages() -> None:
    huge = "ValueError: " + "x" * 100_000
    d = classify(1, {"message": {"message": huge}}, "")
    assert len(d.reason) <= REASON_CHARS


def test_error_file_as_json_text() -> None:
    data = json.dumps({"message": {"message": "RuntimeError: boom\n"}})
    assert classify(1, data, "").reason == "RuntimeError: boom"


def test_last_exception_takes_the_last_traceback() -> None:
    tail = TRACEBACK + "Traceback (most recent call last):\n  File x\nTypeError: second\n"
    assert last_exception(tail) == "TypeError: second"


def test_signal_names() -> None:
    assert signal_name(-9) == "SIGKILL" and signal_name(139) == "SIGSEGV"
    assert signal_name(1) is None and signal_name(None) is None


def test_read_tail_is_bounded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "stderr.log"
    log.write_text("a" * 10_000 + "END")
    tail = read_tail(str(log), limit=100)
    assert len(tail) == 100 and tail.endswith("END")
    assert read_tail(str(tmp_path / "missing")) == ""


def test_the_root_failure_is_the_cause_not_the_peer_whose_collective_broke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rove.agent.procs import Failure, Result
    from rove.agent.workers import root_failure

    peer_log = tmp_path / "0.err"
    peer_log.write_text(
        "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer\n"
        "terminate called without an active exception\n"
    )
    killed_log = tmp_path / "1.err"
    killed_log.write_text("")
    # torch lists local rank 0 first, and both fail within the same second.
    peer = Failure(local_rank=0, pid=100, exitcode=-6, error_file="<N/A>")
    killed = Failure(local_rank=1, pid=101, exitcode=-9, error_file="<N/A>")
    killed.timestamp = peer.timestamp
    result = Result(failures={0: peer, 1: killed}, stderrs={0: str(peer_log), 1: str(killed_log)})
    root = root_failure(result)
    assert root is not None and root.local_rank == 1
    assert root.diagnosis.kind is FailureKind.KILLED and "SIGKILL" in root.diagnosis.reason


def test_a_kill_torch_noticed_after_the_peers_error_file_still_is_the_cause(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Seen on a 2-core machine: the killed worker's peer wrote its error file (the broken
    collective) in second N; torch noticed the kill, which has no error file, in N+1."""
    from rove.agent.procs import Failure, Result
    from rove.agent.workers import root_failure

    error_file = tmp_path / "0.error.json"
    message = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    error_file.write_text(
        json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "100"}}})
    )
    peer = Failure(local_rank=0, pid=100, exitcode=1, error_file=str(error_file))
    killed = Failure(local_rank=1, pid=101, exitcode=-9, error_file="<N/A>")
    killed.timestamp = peer.timestamp + 1
    result = Result(failures={0: peer, 1: killed})
    root = root_failure(result)
    assert root is not None and root.local_rank == 1, root
    assert root.diagnosis.kind is FailureKind.KILLED
    # a later kill is still no cause against an earlier worker's own exception
    own = json.dumps({"message": {"message": "ValueError: bad", "extraInfo": {"timestamp": "100"}}})
    error_file.write_text(own)
    raised = Failure(local_rank=0, pid=100, exitcode=1, error_file=str(error_file))
    root = root_failure(Result(failures={0: raised, 1: killed}))
    assert (
        root is not None and root.local_rank == 0 and root.diagnosis.kind is FailureKind.USER_ERROR
    )


def _failure_without_error_file(tmp_path, tail: str):  # type: ignore[no-untyped-def]
    """A failure as torch reports it for a script without `@record` (no error file)."""
    from rove.agent.procs import Failure, Result

    log = tmp_path / "0.err"
    log.write_text(tail)
    failure = Failure(local_rank=0, pid=100, exitcode=1, error_file="<N/A>")
    return Result(failures={0: failure}, stderrs={0: str(log)})


def test_a_script_without_record_is_diagnosed_from_its_log_not_torchs_placeholder(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    from rove.agent.workers import root_failure

    root = root_failure(_failure_without_error_file(tmp_path, TRACEBACK))
    assert root is not None
    assert root.diagnosis.kind is FailureKind.USER_ERROR
    assert root.diagnosis.reason == "ValueError: learning rate must be positive, got -1"


def test_a_gloo_failure_without_record_names_the_broken_connection(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rove.agent.workers import root_failure

    tail = (
        "[default1]:Traceback (most recent call last):\n"
        '[default1]:  File "train.py", line 9, in <module>\n'
        "[default1]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [127.0.0.1]:50123\n"
    )
    root = root_failure(_failure_without_error_file(tmp_path, tail))
    assert root is not None
    assert root.diagnosis.kind is FailureKind.COMMUNICATION
    assert "Connection closed by peer" in root.diagnosis.reason
    assert "<NONE>" not in root.diagnosis.reason


@pytest.mark.parametrize("placeholder", ["<NONE>", "<N/A>", {"message": "<NONE>"}])
def test_torchs_placeholders_are_no_message(placeholder: object) -> None:
    assert classify(1, placeholder, TRACEBACK).reason.startswith("ValueError: learning rate")


def test_where_names_the_scripts_innermost_frame_not_a_librarys() -> None:
    library = '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 9\n'
    tail = (
        "Traceback (most recent call last):\n"
        '  File "/home/me/train.py", line 30, in <module>\n'
        '  File "/home/me/model.py", line 12, in forward\n'
        f"{library}ValueError: shapes\n"
    )
    assert where(None, tail) == "/home/me/model.py:12"
    recorded = {"message": {"message": "E", "extraInfo": {"py_callstack": tail}}}
    assert where(json.dumps(recorded), "") == "/home/me/model.py:12", "from the error file"
    only_library = f"Traceback (most recent call last):\n{library}RuntimeError: x\n"
    assert where(None, only_library) == (
        "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:9"
    )
    assert where(None, "no traceback here") is None
    assert where({"message": "<NONE>"}, TRACEBACK) == "train.py:2", "torch's placeholder"


#: torch 2.13's words when rank 0's store cannot listen on MASTER_PORT (from a real
#: TCPStore on a port held by another socket)
_STORE_PORT_TAKEN = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
    "local network address. port: 23456, useIpv6: false, code: -98, name: EADDRINUSE, "
    "message: address already in use"
)


def test_a_port_held_by_another_process_is_read_from_torchs_and_rove_tfs_words() -> None:
    tail = f'Traceback (most recent call last):\n  File "train.py", line 3\n{_STORE_PORT_TAKEN}\n'
    assert classify(1, None, tail).kind is FailureKind.COMMUNICATION
    assert port_in_use(tail) == 23456
    tf = "rove: worker 0 cannot serve: port 24001 of this node is taken by another process"
    assert port_in_use(tf) == 24001
    assert port_in_use(f"{_STORE_PORT_TAKEN}\n{tf}") == 24001  # the newest line


@pytest.mark.parametrize(
    "text",
    [
        "OSError: [Errno 98] Address already in use",  # the script's own server: no port
        "port: 23456, useIpv6: false, code: -111, name: ECONNREFUSED",
        "",
    ],
)
def test_no_port_is_read_where_none_was_said_taken(text: str) -> None:
    assert port_in_use(text) is None
