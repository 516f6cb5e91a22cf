"""The README's recipes, followed as written: only the host, the port, the store's
folder and the length of training are put in for this machine."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import free_port, patience

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent


def text_of(title: str) -> str:
    """The README section `title`."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def section(title: str) -> list[list[str]]:
    """The commands of the README section `title`: each code block's lines, with their
    continuations joined, split as a shell would."""
    body = text_of(title)
    commands = []
    for block in re.findall(r"```\n(.*?)```", body, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                commands.append(shlex.split(line.split("#")[0]))
    return commands


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_the_several_nodes_recipe_runs_as_written(tmp_path: Path) -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"

    def local(argv: list[str]) -> list[str]:
        out = []
        for arg in argv:
            arg = arg.replace("nats://nats:4222", url).replace("/var/lib/rove-nats", "store")
            if arg == "examples/train.py":
                out += [str(ROOT / arg), "--steps", "20"]
            else:
                out.append(arg)
        if out[:1] == ["nats-server"]:
            out[out.index("-p") + 1] = str(port)
        return [str(BIN / out[0]), *out[1:]]

    commands = section("Several nodes")
    assert [c[0] for c in commands] == ["rove", "nats-server", *["rove"] * 4], commands
    env = {**os.environ, "ROVE_HOME": str(tmp_path / "home"), "PATH": f"{BIN}:{os.environ['PATH']}"}
    init = subprocess.run(local(commands[0]), cwd=tmp_path, env=env, capture_output=True)
    assert init.returncode == 0, init.stderr
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], name: str) -> subprocess.Popen[bytes]:
        with (logs / f"{name}.log").open("wb") as out:
            p = subprocess.Popen(local(argv), cwd=tmp_path, env=env, stdout=out, stderr=out)
        procs.append(p)
        return p

    def said() -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-2500:]}" for f in logs.iterdir())

    server = start(commands[1], "nats-server")
    try:
        wait_for_port(port, patience(30))
        masters = [start(c, f"master-{i}") for i, c in enumerate(commands[2:4])]
        nodes = [start(c, f"node-{i}") for i, c in enumerate(commands[4:6])]
        for node in nodes:
            assert node.wait(patience(240)) == 0, said()
        for master in masters:
            assert master.wait(patience(60)) == 0, "a master stops once its job ends\n" + said()
        status = re.search(r"`(rove status [^`]*)`", text_of("Several nodes"))
        assert status is not None
        out = subprocess.run(
            local(shlex.split(status.group(1))), cwd=tmp_path, env=env, capture_output=True
        )
        assert out.returncode == 0 and out.stdout.startswith(b"job j1"), out.stderr
        assert b"finished" in out.stdout.splitlines()[0], out.stdout
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert server is procs[0]
