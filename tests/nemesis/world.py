"""The world a nemesis run injects faults into: a real training job on a 3-node cluster.

Three `nats-server` nodes (R3 streams), two masters (a leader and a standby), two rove
nodes of two torch workers each over gloo (examples/train_sharded.py: leased data
shards, a flash checkpoint every step, every 5th persisted), and a witness that
publishes an event of its own every 50 ms and remembers which the server acknowledged.

Optional parts, for the faults that need them:
- `nats_netns`: NATS node n3 lives in a network namespace of its own, so that it can
  be cut off from the other two and from every client;
- `node_netns`: rove node nb (agent and workers) lives in a network namespace;
- `disk_mib`: the checkpoint directory is a tmpfs of that size, so that it can be filled;
- `secured`: the servers admit only rove's roles (`rove.control.bus.auth`), and every
  process runs with its own credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rove.control.bus import auth
from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from tests import lineage
from tests.netns import Netns
from tests.support import (
    ROOT,
    CliProc,
    Cluster,
    MasterProc,
    RunProc,
    eventually,
    free_port,
    log_tail,
    stored_events,
)

SCRIPT = ROOT / "examples" / "train_sharded.py"
JOB = "nemesis"
#: The witness's events are a job of their own, which no master reads.
WITNESS = "witness"
NODES = ("na", "nb")
RANKS = 4  # two nodes of two workers
NODE_TIMEOUT_S = 4


@dataclass
class Shape:
    """What a run's world has: the job's size, and the optional parts."""

    samples: int = 1500
    epochs: int = 2
    step_sleep: float = 0.12
    nats_netns: bool = False
    node_netns: bool = False
    disk_mib: int = 0
    secured: bool = False


@dataclass
class Witness:
    """Events published one by one beside the job; `acked` are those the server acknowledged."""

    sent: int = 0
    acked: list[str] = field(default_factory=list)
    failed: int = 0


class Nats3(Cluster):
    """Three routed `nats-server` nodes; n3 in `netns` when given. Clients on this host
    reach n1 and n2 at 127.0.0.1, n3 at its namespace's address; clients in another
    namespace reach n1 and n2 at that namespace's host address."""

    def __init__(self, root: Path, *, netns: Netns | None, config: Path | None) -> None:
        # (Cluster's start, stop and url serve; its nodes are built here instead)
        self.netns = netns
        self.client_ports = [free_port() for _ in range(3)]
        self.route_ports = [free_port() for _ in range(3)]
        host_side = netns.host_ip if netns else "127.0.0.1"
        route_hosts = [host_side, host_side, netns.ns_ip if netns else "127.0.0.1"]
        routes = ",".join(
            f"nats://{h}:{p}" for h, p in zip(route_hosts, self.route_ports, strict=True)
        )
        self.nodes = [
            EmbeddedServer(
                root / f"n{i + 1}",
                host="0.0.0.0",
                port=self.client_ports[i],
                server_name=f"n{i + 1}",
                config=config,
                preexec=netns.join if (netns and i == 2) else None,
                extra_args=[
                    *("--cluster_name", "rove-nemesis"),
                    *("--cluster", f"nats://0.0.0.0:{self.route_ports[i]}"),
                    *("--routes", routes),
                ],
            )
            for i in range(3)
        ]
        self._n3_host = netns.ns_ip if netns else "127.0.0.1"

    def url_at(self, ip: str) -> str:
        """The URL for a client on this host (`ip` 127.0.0.1) or in a namespace whose
        host address is `ip` (n3 unreachable from there when it has a namespace too)."""
        hosts = [ip, ip, self._n3_host if ip == "127.0.0.1" else ip]
        if self.netns is not None and ip != "127.0.0.1":
            hosts = hosts[:2]
        return ",".join(f"nats://{h}:{p}" for h, p in zip(hosts, self.client_ports, strict=False))

    def logs(self) -> dict[str, Path]:
        return {f"nats-server n{i + 1}": n.log_file for i, n in enumerate(self.nodes)}


class World:
    """Start with `await World(root, shape, seed).start()`; `await finish()` waits for the
    job's end; `stop()` always, in a `finally`."""

    def __init__(self, root: Path, shape: Shape, seed: int) -> None:
        self.root = root
        self.shape = shape
        self.seed = seed
        self.trace = root / "trace.jsonl"
        self.ckpt = root / "ckpt"
        self.shm = root / "shm"
        self.nats_ns = Netns(index=31) if shape.nats_netns else None
        self.node_ns = Netns(index=32) if shape.node_netns else None
        self.creds: dict[str, Path] = {}
        self.cluster: Nats3 | None = None
        self.bus: Bus | None = None
        self.masters: dict[str, MasterProc] = {}
        self.nodes: dict[str, RunProc] = {}
        self.procs: list[CliProc] = []
        self.witness = Witness()
        self._witness_task: asyncio.Task[None] | None = None
        self._witness_stopping = False
        self._mounted = False
        #: masters killed or stopped on purpose (their exit is no failure)
        self.gone: set[str] = set()

    # ------------------------------------------------------------------ start and stop

    async def start(self) -> World:
        self.root.mkdir(parents=True, exist_ok=True)
        for ns in (self.nats_ns, self.node_ns):
            if ns is not None:
                ns.create()
        config = self._secure() if self.shape.secured else None
        self.ckpt.mkdir(exist_ok=True)
        if self.shape.disk_mib:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={self.shape.disk_mib}m", "tmpfs", self.ckpt],
                check=True,
                capture_output=True,
            )
            self._mounted = True
        self.cluster = Nats3(self.root / "nats", netns=self.nats_ns, config=config)
        self.cluster.start()
        self.bus = await self.connect("admin")
        for m in ("m1", "m2"):
            self.start_master(m)
        await eventually(self.leader, timeout=60)
        self._witness_task = asyncio.create_task(self._witness())
        for node in NODES:
            self.start_node(node)
        return self

    def _secure(self) -> Path:
        creds = {
            "admin": auth.new_credentials("admin"),
            "master": auth.new_credentials("master", JOB),
            "trainer": auth.new_credentials("trainer", JOB),
            **{n: auth.new_credentials("agent", JOB, n) for n in NODES},
            # admitted, with another job's rights: none in this one
            "stranger": auth.new_credentials("agent", "another-job", "x"),
        }
        directory = self.root / "auth"
        directory.mkdir(parents=True, exist_ok=True)
        self.creds = {k: auth.write(c, directory / f"{k}.json") for k, c in creds.items()}
        config = directory / "users.conf"
        config.write_text(auth.server_config(list(creds.values())))
        return config

    async def connect(self, who: str | None = "admin", **kw: Any) -> Bus:
        """A bus client as `who` (a role's credentials; None: none at all)."""
        assert self.cluster is not None
        auth_file = str(self.creds[who]) if (who and self.creds) else None
        options = BusOptions(
            url=self.cluster.url, replicas=3, reconnect_forever=True, auth_file=auth_file, **kw
        )
        return await Bus.connect(options)

    def _auth(self, who: str) -> list[str]:
        return ["--nats-auth", str(self.creds[who])] if self.creds else []

    def start_master(self, name: str) -> MasterProc:
        assert self.cluster is not None
        m = MasterProc(
            self.cluster.url,
            JOB,
            name,
            self.root,
            *("--node-timeout", str(NODE_TIMEOUT_S)),
            *self._auth("master"),
        )
        self.masters[name] = m
        self.procs.append(m)
        return m

    def start_node(self, node: str) -> RunProc:
        assert self.cluster is not None
        s = self.shape
        url, addr, env, preexec = self.cluster.url, "127.0.0.1", {}, None
        if self.node_ns is not None:  # nb behind a link the fault can cut; na beside it
            inside = node == "nb"
            url = self.cluster.url_at(self.node_ns.host_ip) if inside else self.cluster.url
            addr = self.node_ns.ns_ip if inside else self.node_ns.host_ip
            env = {"GLOO_SOCKET_IFNAME": self.node_ns.ns_if if inside else self.node_ns.host_if}
            preexec = self.node_ns.enter if inside else None
        incarnation = sum(1 for p in self.procs if p.name.startswith(f"rove run {node}-")) + 1
        worker_auth = ["--worker-nats-auth", str(self.creds["trainer"])] if self.creds else []
        proc = RunProc(
            self.root,
            f"{node}-{incarnation}",
            *("--nats", url, "--job", JOB, "--node-id", node, "--local-addr", addr),
            *self._auth(node),
            *worker_auth,
            *("--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "30"),
            *("--heartbeat-interval", "0.5", "--last-call-timeout", "1"),
            *("--checkpoint-dir", str(self.ckpt), "--persist-every", "5"),
            str(SCRIPT),
            *("--samples", str(s.samples), "--epochs", str(s.epochs)),
            *("--step-sleep", str(s.step_sleep), "--seed", str(self.seed)),
            *("--trace", str(self.trace)),
            env={"ROVE_SHM_DIR": str(self.shm), **env},
            preexec=preexec,
        )
        self.nodes[node] = proc
        self.procs.append(proc)
        return proc

    async def finish(self) -> dict[str, int]:
        """The nodes' exit codes once both have ended (failing, with a diagnosis, if the
        job does not end)."""
        from tests.support import finished

        assert self.bus is not None
        return await finished(self.bus, JOB, self.nodes, self.procs)

    async def stop_witness(self) -> None:
        """Stop the witness (before its events are read back)."""
        if self._witness_task is not None:
            task, self._witness_task = self._witness_task, None
            # the flag too: a cancel that lands as a publish completes can be swallowed
            # (asyncio.wait_for in nats-py), and the loop would go on publishing
            self._witness_stopping = True
            task.cancel()
            await asyncio.wait({task}, timeout=30)
            if not task.done():
                raise AssertionError("the witness did not stop within 30 s of its cancel")
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()

    async def stop(self) -> None:
        await self.stop_witness()
        for p in reversed(self.procs):
            p.stop()
        for ns in (self.node_ns, self.nats_ns):
            if ns is not None:
                with contextlib.suppress(Exception):
                    ns.heal()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()
        if self.cluster is not None:
            self.cluster.stop()
        for ns in (self.node_ns, self.nats_ns):
            if ns is not None:
                ns.delete()
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.ckpt)], capture_output=True, check=False)
            self._mounted = False
        shutil.rmtree(self.shm, ignore_errors=True)

    # ------------------------------------------------------------------ what it sees

    async def _witness(self) -> None:
        """Publish a witness event every 50 ms; remember the acknowledged ones."""
        assert self.bus is not None
        while not self._witness_stopping:
            i = self.witness.sent = self.witness.sent + 1
            event = ev.NodeJoined(
                job=WITNESS,
                id=f"witness:{self.seed}:{i}",
                producer="agent:w",
                ts=time.time(),
                node="w",
                host="witness",
                pid=i,
                incarnation="w1",
            )
            try:
                await self.bus.publish(event, deadline_s=2.0)
                self.witness.acked.append(event.id)
            except Exception:  # not acknowledged: nothing is promised
                self.witness.failed += 1
            await asyncio.sleep(0.05)

    async def records(self, job: str = JOB) -> list[Any]:
        assert self.bus is not None
        return await stored_events(self.bus, job)

    async def leader(self) -> str:
        """The master named by the newest election ('' before the first)."""
        elected = [r.event for r in await self.records() if isinstance(r.event, ev.MasterElected)]
        return elected[-1].master if elected else ""

    def rows(self) -> list[dict[str, Any]]:
        return lineage.rows(self.trace)

    def progress(self) -> int:
        return lineage.progress(self.trace)

    def total_steps(self) -> int:
        """About how many steps the job trains at full size."""
        return self.shape.samples * self.shape.epochs // (RANKS * 8)

    def full_speed_at(self, since: float, after_round: int = 0) -> float | None:
        """When the job next trained at full size after `since`: the moment every rank of
        a 4-rank round (after `after_round`) had stepped after it (None if it has not)."""
        rows = self.rows()
        worlds = {r["round"]: r["world"] for r in rows if "world" in r}
        firsts: dict[int, dict[int, float]] = {}
        for r in rows:
            if (
                "t" in r
                and r["t"] > since
                and r["round"] > after_round
                and worlds.get(r["round"]) == RANKS
            ):
                firsts.setdefault(r["round"], {}).setdefault(r["rank"], r["t"])
        done = [max(ranks.values()) for ranks in firsts.values() if len(ranks) == RANKS]
        return min(done) if done else None

    def logs(self, limit: int = 4000) -> str:
        """The tails of every process's log (and the NATS servers'), for a failure."""
        parts = [f"--- {p.name} ({p.log_path}):\n{log_tail(p.log_path, limit)}" for p in self.procs]
        if self.cluster is not None:
            parts += [
                f"--- {name}:\n{log_tail(path, 1500)}" for name, path in self.cluster.logs().items()
            ]
        return "\n".join(parts)
