"""Running this node's part of a network-check round (`rove.agent.netcheck`).

The check runs in its own process (through `rove.agent.child`, so it dies with
the agent), with the group's rendezvous in its environment. Its own report
(the check's time, start-up excluded) is what counts; a process that fails or
outlives its limit is a failed check, with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from rove.agent.facts import NodeFacts
from rove.control.catalogue import events as ev
from rove.control.master import netcheck as policy


@dataclass(frozen=True)
class CheckResult:
    check_round: int
    ok: bool
    elapsed_s: float
    matmul_s: float
    allreduce_s: float
    error: str


def my_place(
    a: ev.NetworkCheckAssigned, node: str, incarnation: str
) -> tuple[ev.CheckGroup, int] | None:
    """(the group this node checks in, its rank there), or None when it has no part."""
    for group in a.groups:
        pairs = list(zip(group.nodes, group.incarnations, strict=True))
        if (node, incarnation) in pairs:
            return group, pairs.index((node, incarnation))
    return None


def report(result: CheckResult, facts: NodeFacts, log: Any) -> None:
    """Say the node's result in its log, and send it as the node's fact."""
    outcome = "ok" if result.ok else f"failed: {result.error}"
    log.info(f"network check round {result.check_round}: {outcome}", elapsed_s=result.elapsed_s)
    facts.emit(reported(result, facts.envelope()))


def reported(result: CheckResult, envelope: ev.NodeEnvelope) -> ev.NetworkCheckReported:
    """The node's fact for its result."""
    return ev.NetworkCheckReported(
        **envelope,
        check_round=result.check_round,
        ok=result.ok,
        elapsed_s=result.elapsed_s,
        matmul_s=result.matmul_s,
        allreduce_s=result.allreduce_s,
        error=result.error,
    )


async def run_check(a: ev.NetworkCheckAssigned, group: ev.CheckGroup, rank: int) -> CheckResult:
    """Run this node's check process for assignment `a` in `group` as `rank`."""
    startup = policy.startup_s(a.timeout_s)
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(len(group.nodes)),
        "MASTER_ADDR": group.master_addr,
        "MASTER_PORT": str(group.master_port),
        "ROVE_NETCHECK_TIMEOUT": str(a.timeout_s),
        "ROVE_NETCHECK_STARTUP_TIMEOUT": str(startup),
    }
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rove.agent.child",
        sys.executable,
        "-m",
        "rove.agent.netcheck",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    limit = startup + a.timeout_s + 10.0  # the process bounds itself; this is a backstop
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        out, err = b"", f"timed out after {limit:g}s".encode()
    result: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        result = json.loads(out.decode().strip().splitlines()[-1]) if out.strip() else {}
    ok = proc.returncode == 0 and bool(result.get("ok"))
    error = ""
    if not ok:
        stderr = err.decode(errors="replace").strip().splitlines()
        error = str(result.get("error") or (stderr[-1] if stderr else "failed"))
    # the check's own time (start-up excluded), or the wall time of a failed one
    elapsed = float(result["elapsed_s"]) if ok else time.monotonic() - started
    return CheckResult(
        a.check_round,
        ok,
        round(elapsed, 4),
        float(result.get("matmul_s", 0.0)),
        float(result.get("allreduce_s", 0.0)),
        error[: ev.REASON_CHARS],
    )
