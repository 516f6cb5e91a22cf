"""A round whose rendezvous store port another process took starts again on fresh ports
and spends no restart: the job ends well under `--max-restarts 0` (torchrun's default),
where a worker's own failure would end it.

Real processes: `rove run --standalone` with two torch ranks over gloo; in the first
round rank 0 waits while this test listens on its `MASTER_PORT`, so its store cannot.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from tests.support import RunProc, eventually, rove_cli

SCRIPT = Path(__file__).parent / "scripts" / "store_port_taken.py"


async def test_a_store_port_taken_by_another_process_starts_the_round_again_for_free(
    tmp_path: Path,
) -> None:
    here = tmp_path / "job"
    here.mkdir()
    node = RunProc(
        tmp_path,
        "solo",
        *("--standalone", "--job", "taken", "--nproc-per-node", "2", "--max-restarts", "0"),
        *(str(SCRIPT), str(here)),
    )
    with socket.socket() as thief:
        await eventually(lambda: (here / "port").exists(), timeout=120)
        port = int((here / "port").read_text())
        thief.bind(("", port))
        thief.listen()
        (here / "held").touch()
        code = node.wait(180)
    out = node.log()
    assert code == 0, out[-4000:]
    said = f"port {port} of node "
    assert said in out and "was taken by another process" in out, out[-4000:]
    assert "no restart spent" in out
    assert int((here / "joined-0").read_text()) != port, "the new round's store: a fresh port"
    shown = rove_cli("events", "--job", "taken", "--json", check=True)
    events = [json.loads(line) for line in shown.stdout.splitlines() if line.startswith("{")]
    exited = [e for e in events if e["type"] == "worker_exited"]
    assert [(e["rank"], e["port_taken"]) for e in exited if e["port_taken"]] == [(0, port)]
    rounds = [e for e in events if e["type"] == "round_completed"]
    assert [(r["round"], r["cause"], r["restart_count"]) for r in rounds] == [
        (1, "formed", 0),
        (2, "reformed", 0),
    ]
    assert rounds[1]["master_port"] != port
    status = rove_cli("status", "--job", "taken", check=True).stdout
    assert "1 round started again on fresh ports" in status and "no restart spent" in status, status
