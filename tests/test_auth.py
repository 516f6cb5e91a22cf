"""rove's roles as NATS permissions (rove.control.bus.auth), against a real nats-server running
the generated configuration: every denial is asserted (the publish raises, nothing is
stored), not assumed. And a `--standalone` job's embedded server accepts only the job's
own credentials, which reach its workers as a file, never as a secret in their
environment."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from msgspec.structs import replace

from rove.control.bus import auth
from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import BusUnavailableError, NotAuthorizedError, PermissionDeniedError
from tests import factories
from tests.support import ROOT, RunProc, rove_cli, stored_events

JOB = factories.JOB


class Secured:
    """A nats-server whose users are rove's roles for job j1 (agents n0 and n1)."""

    def __init__(self, root: Path) -> None:
        self.creds = {
            "admin": auth.new_credentials("admin"),
            "master": auth.new_credentials("master", JOB),
            "n0": auth.new_credentials("agent", JOB, "n0"),
            "n1": auth.new_credentials("agent", JOB, "n1"),
            "trainer": auth.new_credentials("trainer", JOB),
            "scaler": auth.new_credentials("scaler", JOB),
            "operator": auth.new_credentials("operator", JOB),
            "cli": auth.new_credentials("cli", JOB),
        }
        self.files = {k: auth.write(c, root / f"{k}.json") for k, c in self.creds.items()}
        config = root / "nats.conf"
        config.write_text(auth.server_config(list(self.creds.values())))
        self.server = EmbeddedServer(root / "nats", config=config)
        self.url = self.server.start()

    async def bus(self, who: str, **kw: object) -> Bus:
        return await Bus.connect(
            BusOptions(url=self.url, auth_file=str(self.files[who]), **kw)  # type: ignore[arg-type]
        )


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    s = Secured(tmp_path)
    master = await s.bus("master")  # creates the streams and the lease bucket
    await master.close()
    try:
        yield s
    finally:
        s.server.stop()


async def denied(bus: Bus, event: ev.Event) -> None:
    with pytest.raises(PermissionDeniedError, match="refused a publish to"):
        await bus.publish(event, deadline_s=10.0)


async def test_an_agent_cannot_forge_a_decision_another_nodes_facts_a_snapshot_or_a_stop(
    secured: Secured,
) -> None:
    agent = await secured.bus("n0", create_streams=False)
    try:
        await agent.publish(factories.joined("n0"))  # its own facts: fine
        await agent.publish(factories.heartbeat("n0"))
        await denied(agent, factories.elected("m-forged", 99))  # a master decision
        await denied(agent, factories.stop())  # an operator's stop
        await denied(agent, factories.joined("n1"))  # another node's facts
        with pytest.raises(PermissionDeniedError):  # a snapshot
            await agent.publish_raw(subjects.snapshot(JOB), b"forged state", deadline_s=10.0)
        with pytest.raises(PermissionDeniedError):  # the leader lease
            await agent.publish_raw(f"$KV.{subjects.LEASE_BUCKET}.{JOB}", b"me", deadline_s=10.0)
    finally:
        await agent.close()
    admin = await secured.bus("admin")
    try:
        kinds = [(type(r.event).__name__, r.event.producer) for r in await stored_events(admin)]
        assert kinds == [("NodeJoined", "agent:n0")], "only the agent's own fact is stored"
        beat = await admin.js.get_last_msg(subjects.HEARTBEAT_STREAM, subjects.heartbeat(JOB, "n0"))
        assert beat.seq, "its heartbeat is stored"
    finally:
        await admin.close()


async def test_no_role_but_admin_may_delete_the_event_stream(secured: Secured) -> None:
    for who in ("master", "n0", "cli"):
        bus = await secured.bus(who, create_streams=False)
        try:
            with pytest.raises(Exception, match=r"timeout|[Pp]ermission"):
                await bus.js.delete_stream(subjects.EVENTS_STREAM, timeout=2.0)
        finally:
            await bus.close()
    admin = await secured.bus("admin")
    try:
        info = await admin.js.stream_info(subjects.EVENTS_STREAM)
        assert info.config.name == subjects.EVENTS_STREAM, "the stream is still there"
    finally:
        await admin.close()


async def test_a_trainer_asks_for_shards_but_cannot_forge_the_masters_answer(
    secured: Secured,
) -> None:
    trainer = await secured.bus("trainer", create_streams=False)
    try:
        request = next(e for e in factories.data_events() if isinstance(e, ev.ShardRequested))
        await trainer.publish(request)
        leased = next(e for e in factories.data_events() if isinstance(e, ev.ShardLeased))
        await denied(trainer, leased)  # rove.ans.j1.<dataset>.<client>
        refused = next(e for e in factories.data_events() if isinstance(e, ev.DataRejected))
        await denied(trainer, refused)  # rove.ev.j1.data.<dataset>.<client>
    finally:
        await trainer.close()
    master = await secured.bus("master", create_streams=False)
    try:
        await master.publish(leased)  # the answers stream is the master's to write
        stored = await master.js.get_last_msg(
            subjects.ANSWER_STREAM, subjects.lease_answer(JOB, leased.dataset, leased.client)
        )
        assert ev.decode(stored.data).id == leased.id
    finally:
        await master.close()


async def test_the_scaler_publishes_a_large_fact_in_parts_but_no_master_part(
    secured: Secured,
) -> None:
    """A plan of 20,000 nodes applied: the scaler's answer lists them all (about 1 MB),
    so it goes in parts, on the scaler's subjects, which its role may write."""
    scaler = await secured.bus("scaler", create_streams=False)
    created = tuple(f"pool-a100-highmem-8-node-{i:06d}.internal" for i in range(20_000))
    applied = ev.PlanApplied(
        job=JOB,
        id="applied-7",
        producer="scaler:s1",
        ts=1.0,
        plan=7,
        scaler="s1",
        backend="local",
        created=created,
    )
    try:
        await scaler.publish(applied)
        round_part = ev.EventPart(
            job=JOB, id="x.part0", producer="scaler:s1", ts=1.0, epoch=1, whole="x",
            kind="round_completed", index=0, items=msgspec.Raw(b"\x90"),
        )  # fmt: skip
        await denied(scaler, round_part)  # a master decision's part
    finally:
        await scaler.close()
    admin = await secured.bus("admin")
    try:
        stored = await stored_events(admin)
        assert [r.event for r in stored] == [applied], "read whole"
        last = await admin.js.get_last_msg(
            subjects.EVENTS_STREAM, subjects.part(JOB, "plan_applied", 0)
        )
        assert last.subject.startswith(subjects.scaler(JOB) + ".")
    finally:
        await admin.close()


async def test_without_credentials_a_client_is_refused(secured: Secured) -> None:
    with pytest.raises(NotAuthorizedError, match="refused these credentials"):
        await Bus.connect(BusOptions(url=secured.url, connect_timeout_s=2.0))
    stranger = auth.write(auth.new_credentials("admin"), secured.files["admin"].with_name("x.json"))
    with pytest.raises(NotAuthorizedError):  # well-formed, but not one the server knows
        await Bus.connect(BusOptions(url=secured.url, auth_file=str(stranger)))


async def test_the_read_only_cli_reads_events_and_status_but_cannot_publish(
    secured: Secured,
) -> None:
    master = await secured.bus("master")
    try:
        await master.publish(factories.joined("n0"))
    finally:
        await master.close()
    common = ("--job", JOB, "--nats", secured.url, "--nats-auth", str(secured.files["cli"]))
    events = await asyncio.to_thread(rove_cli, "events", *common)
    assert events.returncode == 0 and "node_joined" in events.stdout, events.stderr
    status = await asyncio.to_thread(rove_cli, "status", *common)
    assert status.returncode == 0 and f"job {JOB}" in status.stdout, status.stderr
    stop = await asyncio.to_thread(rove_cli, "stop", *common)
    assert stop.returncode != 0 and "refused a publish" in stop.stderr
    operator = ("--nats-auth", str(secured.files["operator"]))
    stopped = await asyncio.to_thread(rove_cli, "stop", *common[:4], *operator)
    assert stopped.returncode == 0, stopped.stderr


async def test_a_standalone_job_admits_only_its_own_credentials_and_hides_them_from_environ(
    tmp_path: Path,
) -> None:
    """The workers of a `--standalone` job get the trainer's credentials as a file (mode
    0600), nothing secret in their environment, and cannot write a master decision."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import asyncio, json, os, sys\n"
        "from rove.control.bus.client import Bus, BusOptions\n"
        "from rove.control.bus.options import options_from_env\n"
        "from rove.control.errors import NotAuthorizedError, PermissionDeniedError\n"
        "from tests import factories\n"
        f"out = {str(tmp_path / 'probe.json')!r}\n"
        "environ = open(f'/proc/{os.getpid()}/environ', 'rb').read().decode()\n"
        "async def main():\n"
        "    bus = await Bus.connect(options_from_env(os.environ['ROVE_NATS_URL'],\n"
        "                            create_streams=False))\n"
        "    try:\n"
        "        await bus.publish(factories.elected('forged', 99, job=os.environ['ROVE_JOB']))\n"
        "        forged = 'stored'\n"
        "    except PermissionDeniedError as exc:\n"
        "        forged = str(exc)\n"
        "    await bus.close()\n"
        "    try:\n"
        "        await Bus.connect(BusOptions(url=os.environ['ROVE_NATS_URL'],\n"
        "                                     connect_timeout_s=2.0))\n"
        "        anonymous = 'connected'\n"
        "    except NotAuthorizedError as exc:\n"
        "        anonymous = str(exc)\n"
        "    json.dump({'environ': environ, 'auth': os.environ.get('ROVE_NATS_AUTH'),\n"
        "               'forged': forged, 'anonymous': anonymous}, open(out, 'w'))\n"
        "asyncio.run(main())\n"
    )
    home = tmp_path / "home"
    run = RunProc(
        tmp_path,
        "standalone",
        *("--standalone", "--job", "closed", "--nproc-per-node", "1", "--no-warm-start"),
        str(script),
        env={"ROVE_HOME": str(home), "PYTHONPATH": str(ROOT)},
    )
    assert run.wait(240) == 0, run.log()[-3000:]
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["auth"] == str(home / "jobs" / "closed" / "auth" / "trainer.json")
    assert "refused a publish to rove.ev.closed.master" in probe["forged"]
    creds = auth.read(probe["auth"])
    assert creds.role == "trainer" and creds.seed not in probe["environ"]
    assert "ROVE_NATS_AUTH=" in probe["environ"], "a path, not a secret"
    for f in (home / "jobs" / "closed" / "auth").iterdir():
        assert f.stat().st_mode & 0o077 == 0, f"{f.name} is readable by others"
    assert "refused these credentials" in probe["anonymous"], "no credentials: refused"


async def test_the_master_role_writes_and_reads_its_snapshots(secured: Secured) -> None:
    """Snapshots go through the object store and the snapshot stream: the master's
    permissions must allow every call they make (an agent's must not)."""
    from rove.control.master import snapshots
    from rove.control.master.state import initial

    master = await secured.bus("master")
    try:
        await snapshots.save(master, replace(initial(JOB), applied_seq=5), master="m1", now=1.0)
    finally:
        await master.close()
    agent = await secured.bus("n0", create_streams=False)
    try:
        with pytest.raises(Exception):  # noqa: B017 - denied as a timeout or a permission error
            await snapshots.save(agent, replace(initial(JOB), applied_seq=999), master="x", now=2.0)
    finally:
        await agent.close()
    master = await secured.bus("master")
    try:
        loaded = await snapshots.load(master, JOB)
        assert loaded is not None and loaded.state.applied_seq == 5, "the master's, not the forgery"
    finally:
        await master.close()


async def test_rove_auth_init_writes_a_config_the_server_accepts_and_a_file_per_role(
    tmp_path: Path,
) -> None:
    out = tmp_path / "auth"
    made = await asyncio.to_thread(
        rove_cli, "auth", "init", "--job", JOB, "--nodes", "n0,n1", "--out", str(out)
    )
    assert made.returncode == 0, made.stderr
    roles = ("admin", "master", "scaler", "bridge", "trainer", "operator", "cli")
    expected = {f"{r}.json" for r in (*roles, "agent-n0", "agent-n1")} | {"nats-auth.conf"}
    assert {p.name for p in out.iterdir()} == expected
    assert all(p.stat().st_mode & 0o077 == 0 for p in out.iterdir()), "readable by the user only"
    server = EmbeddedServer(tmp_path / "nats", config=out / "nats-auth.conf")
    url = server.start()
    try:
        master = await Bus.connect(BusOptions(url=url, auth_file=str(out / "master.json")))
        await master.close()
        n1 = await Bus.connect(
            BusOptions(url=url, auth_file=str(out / "agent-n1.json"), create_streams=False)
        )
        try:
            await n1.publish(factories.joined("n1"))
            await denied(n1, factories.joined("n0"))
        finally:
            await n1.close()
    finally:
        server.stop()


async def test_with_tls_verify_and_map_a_client_is_its_certificate(tmp_path: Path) -> None:
    """`rove auth init --verify-and-map`: the server asks for a client certificate and maps
    its email SAN to the role; no certificate, no connection; the agent's certificate
    cannot write another node's facts."""
    import trustme

    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    files = tmp_path / "tls"
    files.mkdir()
    ca.cert_pem.write_to_path(str(files / "ca.pem"))
    server_cert.private_key_pem.write_to_path(str(files / "server.key"))
    server_cert.cert_chain_pems[0].write_to_path(str(files / "server.pem"))
    for who in ("master", "agent-n0"):
        cert = ca.issue_cert(f"{who}@{JOB}")
        cert.private_key_pem.write_to_path(str(files / f"{who}.key"))
        cert.cert_chain_pems[0].write_to_path(str(files / f"{who}.pem"))
    out = tmp_path / "auth"
    made = await asyncio.to_thread(
        rove_cli,
        *("auth", "init", "--job", JOB, "--nodes", "n0", "--out", str(out), "--verify-and-map"),
        *("--tls-cert", str(files / "server.pem"), "--tls-key", str(files / "server.key")),
        *("--tls-ca", str(files / "ca.pem")),
    )
    assert made.returncode == 0, made.stderr
    assert auth.read(out / "agent-n0.json").seed == "", "the certificate is the credential"
    server = EmbeddedServer(tmp_path / "nats", config=out / "nats-auth.conf")
    url = server.start().replace("nats://", "tls://")

    def options(who: str, **kw: object) -> BusOptions:
        return BusOptions(
            url=url,
            auth_file=str(out / f"{who}.json"),
            tls_ca_file=str(files / "ca.pem"),
            tls_cert_file=str(files / f"{who}.pem"),
            tls_key_file=str(files / f"{who}.key"),
            **kw,  # type: ignore[arg-type]
        )

    try:
        master = await Bus.connect(options("master"))
        await master.close()
        agent = await Bus.connect(options("agent-n0", create_streams=False))
        try:
            await agent.publish(factories.joined("n0"))
            await denied(agent, factories.joined("n1"))
            await denied(agent, factories.elected("forged", 99))
        finally:
            await agent.close()
        with pytest.raises((NotAuthorizedError, BusUnavailableError)):
            await Bus.connect(
                BusOptions(url=url, tls_ca_file=str(files / "ca.pem"), connect_timeout_s=2.0)
            )
    finally:
        server.stop()


async def test_a_node_added_to_a_closed_job_is_admitted_after_a_reload_and_only_as_itself(
    tmp_path: Path,
) -> None:
    """`--standalone --auto-scale`: the launcher's set, then a node's credentials made as
    the scaler launches it; the running server admits them once it reloads."""
    job_auth = auth.embedded_job(tmp_path / "auth", JOB)
    server = EmbeddedServer(tmp_path / "nats", config=job_auth.config)
    url = server.start()
    try:
        launcher = await Bus.connect(BusOptions(url=url, auth_file=str(job_auth.launcher)))
        await launcher.close()
        node, _config = auth.add_agent(tmp_path / "auth", JOB, "n5")
        with pytest.raises(NotAuthorizedError):
            await Bus.connect(BusOptions(url=url, auth_file=str(node), connect_timeout_s=2.0))
        server.reload()
        n5 = await Bus.connect(BusOptions(url=url, auth_file=str(node)))
        try:
            await n5.publish(factories.joined("n5"))
            await denied(n5, factories.joined("n6"))
            await denied(n5, factories.round_completed(1, 1, "n5"))
        finally:
            await n5.close()
        assert [e.event.node for e in await stored_events_of(url, job_auth.cli)] == ["n5"]
        # a later run of the job starts from a fresh set: its earlier nodes are gone
        auth.embedded_job(tmp_path / "auth", JOB)
        assert not list((tmp_path / "auth" / "agents").glob("*.json"))
    finally:
        server.stop()


async def stored_events_of(url: str, cli: Path) -> list:  # type: ignore[type-arg]
    bus = await Bus.connect(BusOptions(url=url, auth_file=str(cli), create_streams=False))
    try:
        return await stored_events(bus, JOB)
    finally:
        await bus.close()


def test_the_workers_credentials_must_be_a_trainers(tmp_path: Path) -> None:
    from rove.agent.launcher import _worker_auth
    from rove.control.errors import ConfigError

    trainer = auth.write(auth.new_credentials("trainer", JOB), tmp_path / "trainer.json")
    agent = auth.write(auth.new_credentials("agent", JOB, "n0"), tmp_path / "n0.json")
    assert _worker_auth(str(trainer)) == trainer
    with pytest.raises(ConfigError, match="holds the agent role's credentials"):
        _worker_auth(str(agent))
    with pytest.raises(ConfigError, match="not a readable rove credentials file"):
        _worker_auth(str(tmp_path / "missing.json"))


async def test_the_master_role_hears_its_jobs_heartbeats_live_and_an_agent_may_not(
    secured: Secured,
) -> None:
    """(A secured job's leader lost every node once the node timeout passed: the server
    had refused its live subscription to the heartbeats, and said so only in an
    asynchronous error. Found by the nemesis, tests/nemesis.)"""
    from rove.control.bus import live
    from tests.support import eventually

    master = await secured.bus("master", create_streams=False)
    agent = await secured.bus("n0", create_streams=False)
    heard: list[str] = []
    try:
        stop = await live.listen(
            master, subjects.job_heartbeats(JOB), lambda s, _d: heard.append(s)
        )
        await agent.publish(factories.heartbeat("n0"))
        await eventually(lambda: heard)
        assert heard == [subjects.heartbeat(JOB, "n0")]
        await stop()
        with pytest.raises(PermissionDeniedError, match=r"refused a subscription to rove\.hb"):
            await live.listen(agent, subjects.job_heartbeats(JOB), lambda _s, _d: None)
    finally:
        await master.close()
        await agent.close()
