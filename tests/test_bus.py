"""The bus client against a real nats-server: streams, dedupe, fencing, retries, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import pytest
import structlog
from nats.js.api import DiscardPolicy, StorageType

from rove.control.bus import lease_bucket, records, streams
from rove.control.bus.client import Bus, BusOptions, Fence
from rove.control.bus.embedded import EmbeddedServer
from rove.control.bus.feed import Feed, StreamMark, stalled
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import (
    BusUnavailableError,
    ConfigError,
    FencedError,
    NotAuthorizedError,
    PublishDeadlineError,
    TemporaryError,
)
from tests import factories
from tests.support import Cluster, eventually, free_port, patience


async def stored(bus: Bus, job: str = "j1") -> list[records.Recorded | records.Rejection]:
    got: list[records.Recorded | records.Rejection] = []
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM, subjects.job_events(job), got.append, got.append
    )
    await feed.caught_up.wait()
    await feed.stop()
    return got


async def test_streams_and_lease_bucket_are_created_idempotently(bus: Bus) -> None:
    await bus.ensure_streams()
    await bus.ensure_streams()
    names = {s.config.name for s in await bus.js.streams_info()}
    assert {
        subjects.EVENTS_STREAM,
        subjects.HEARTBEAT_STREAM,
        subjects.ANSWER_STREAM,
        subjects.SNAPSHOT_STREAM,
    } <= names
    _kv, ttl = await bus.lease_bucket()
    assert ttl == pytest.approx(2.0)


async def test_a_lease_bucket_not_found_as_its_status_is_read_is_found_or_made_again(
    bus: Bus,
) -> None:
    """On a fresh cluster a bucket just made may be "stream not found" for a moment by
    the next server asked: a `rove master` died of that NotFoundError as the job's first
    nodes made the streams. Here the bucket's stream really goes between finding it
    and reading its status: one try says so as a TemporaryError (retried), and the
    bus's call finds or makes it again."""
    kv, _ttl = await bus.lease_bucket()
    await bus.js.delete_key_value(subjects.LEASE_BUCKET)
    with pytest.raises(TemporaryError, match="the lease bucket's stream: stream not found"):
        await lease_bucket.open(bus.js, bus.options, kv)
    again, ttl = await bus.lease_bucket()  # its handle was the gone bucket's: made again
    assert ttl == pytest.approx(2.0)
    assert (await again.status()).bucket == subjects.LEASE_BUCKET


async def test_a_retried_publish_with_the_same_id_is_stored_once(any_bus: Bus) -> None:
    bus = any_bus
    event = factories.joined("n1")
    first = await bus.publish(event)
    again = await bus.publish(event)
    assert first == again
    assert [r.event for r in await stored(bus)] == [event]
    copies = factories.joined("n2")
    seqs = await asyncio.gather(*(bus.publish(copies) for _ in range(8)))
    assert len(set(seqs)) == 1, "copies sent at once (10158 on a cluster) are stored once"
    assert [r.event for r in await stored(bus)] == [event, copies]


async def test_pipelined_publish_keeps_order_and_dedupes(bus: Bus) -> None:
    batch = [factories.joined(f"n{i}", n=i) for i in range(500)]
    seqs = await bus.publish_many(batch)
    assert seqs == sorted(seqs) and len(set(seqs)) == 500
    assert await bus.publish_many(batch[:10]) == seqs[:10]
    assert [r.event for r in await stored(bus)] == batch


async def test_deposed_master_write_is_rejected_by_the_server(any_bus: Bus) -> None:
    bus = any_bus
    elected_subject = subjects.master_elected("j1")
    seq_a = await bus.publish(factories.elected("a", 1), fence=Fence(elected_subject, 0))
    fence_a = Fence(elected_subject, seq_a)
    await bus.publish(factories.lost("n1", 1), fence=fence_a)  # accepted while A is newest
    await bus.publish(factories.elected("b", 2), fence=Fence(elected_subject, seq_a))
    with pytest.raises(FencedError, match="newer master"):
        await bus.publish(factories.lost("n2", 1), fence=fence_a)
    kinds = [ev.kind(r.event) for r in await stored(bus)]
    assert kinds == ["master_elected", "node_lost", "master_elected"]


async def test_fenced_writes_sent_together_are_all_stored_on_one_server_and_a_cluster(
    any_bus: Bus,
) -> None:
    """A clustered stream refuses a fenced write while another checked against the same
    subject is being proposed (10164): that is no deposition, and the write is retried.
    (8 at once x 20 was 140 refusals of 160 on a cluster, and the master crash-looped.)"""
    bus = any_bus
    subject = subjects.master_elected("j1")
    fence = Fence(subject, await bus.publish(factories.elected("a", 1), fence=Fence(subject, 0)))
    sent = [factories.joined(f"n{t}-{i}", n=t * 8 + i) for t in range(20) for i in range(8)]
    for t in range(20):
        await asyncio.gather(*(bus.publish(e, fence=fence) for e in sent[t * 8 : t * 8 + 8]))
    got = [r.event for r in await stored(bus) if isinstance(r.event, ev.NodeJoined)]
    assert sorted(e.id for e in got) == sorted(e.id for e in sent), "every one stored, once"
    await bus.publish(factories.elected("b", 2), fence=fence)
    with pytest.raises(FencedError, match="newer master"):
        await asyncio.gather(
            *(bus.publish(factories.lost(f"x{i}", 1), fence=fence) for i in range(8))
        )


async def test_two_candidates_cannot_both_be_elected_on_the_same_fence(any_bus: Bus) -> None:
    bus = any_bus
    subject = subjects.master_elected("j1")
    await bus.publish(factories.elected("a", 1), fence=Fence(subject, 0))
    with pytest.raises(FencedError):
        await bus.publish(factories.elected("b", 2), fence=Fence(subject, 0))


async def test_garbage_is_handed_to_on_rejected_and_the_feed_goes_on(bus: Bus) -> None:
    await bus.publish(factories.joined("n1"))
    await bus.publish_raw("rove.ev.j1.node.n1", b"\xc1garbage")
    wrong_schema = msgspec.msgpack.encode({"type": "node_joined", "job": "j1", "node": 7})
    await bus.publish_raw("rove.ev.j1.node.n1", wrong_schema)
    await bus.publish_raw("rove.ev.j1.node.n2", ev.encode(factories.joined("n9", n=9)))
    await bus.publish(factories.joined("n2", n=2))
    got = await stored(bus)
    assert [type(x).__name__ for x in got] == [
        "Recorded",
        "Rejection",
        "Rejection",
        "Rejection",
        "Recorded",
    ]
    rejections = [x for x in got if isinstance(x, records.Rejection)]
    assert "not msgpack" in rejections[0].error
    assert "belongs on rove.ev.j1.node.n9" in rejections[2].error
    assert [r.seq for r in rejections] == [2, 3, 4]


def test_a_feed_is_stalled_only_when_it_stood_still_for_every_check_while_behind() -> None:
    assert stalled([7, 7, 7], newest=9)
    assert not stalled([7, 7, 7], newest=7), "caught up: just quiet"
    assert not stalled([6, 7, 7], newest=9), "moved during the window"
    assert not stalled([7, 7], newest=9), "not watched long enough"


async def test_a_feed_whose_consumer_dies_unhealed_is_resubscribed_and_loses_nothing(
    bus: Bus,
) -> None:
    """What the ordered consumer of nats-py does not survive: its server-side consumer
    is gone and its own healing task died (here: cancelled). The feed's watchdog
    resubscribes from the next sequence; every event arrives once, in order."""
    bus.stall_check_s = 0.2
    got: list[records.Recorded | records.Rejection] = []
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM, subjects.job_events("j1"), got.append, got.append
    )
    await bus.publish(factories.joined("n1"))
    await eventually(lambda: len(got) == 1, timeout=30)
    feed.sub._sub._jsi._hbtask.cancel()  # nats-py's healing, gone
    await bus.js.delete_consumer(subjects.EVENTS_STREAM, feed.sub._consumer)
    for n in range(2, 6):
        await bus.publish(factories.joined(f"n{n}", n=n))
    await eventually(lambda: len(got) == 5, timeout=60)
    assert [r.seq for r in got] == [1, 2, 3, 4, 5]
    assert feed.resubscribed >= 1
    await feed.stop()


async def test_a_handler_that_raises_a_bug_is_said_with_its_traceback_and_ends_a_reader(
    any_bus: Bus,
) -> None:
    """A handler's own bug (not a RoveError) on a message that arrives live: it used to
    reach nats-py's error callback, said as "NATS client error" without a traceback,
    and a reader waiting for the backlog waited for ever. Now the feed says it with the
    stream, sequence and traceback, goes on with the next message, and a reader
    (`Bus.read`, `Feed.settled`) raises it."""
    got: list[str] = []

    def handle(rec: records.Recorded | records.Rejection) -> None:
        assert isinstance(rec, records.Recorded) and isinstance(rec.event, ev.NodeJoined)
        if rec.event.node == "n2":
            raise KeyError("a bug in the handler")
        got.append(rec.event.node)

    with structlog.testing.capture_logs() as logs:
        feed = await any_bus.subscribe(
            subjects.EVENTS_STREAM, subjects.job_events("j1"), handle, handle
        )
        for n in (1, 2, 3):
            await any_bus.publish(factories.joined(f"n{n}", n=n))
        await eventually(lambda: got == ["n1", "n3"], timeout=30)
        await feed.stop()
    assert isinstance(feed.error, KeyError) and feed.failed.is_set()
    said = [e for e in logs if e["event"] == "a handler failed on a message; skipped"]
    assert [(e["seq"], e["log_level"]) for e in said] == [(2, "error")], logs
    assert isinstance(said[0]["exc_info"], KeyError)
    assert not any(e["event"] == "NATS client error" for e in logs), logs
    with pytest.raises(KeyError, match="a bug in the handler"):
        await asyncio.wait_for(
            any_bus.read(subjects.EVENTS_STREAM, subjects.job_events("j1"), handle), patience(30)
        )


async def test_publish_survives_a_server_restart_within_its_deadline(tmp_path: Path) -> None:
    port = free_port()
    server = EmbeddedServer(tmp_path / "nats", port=port)
    server.start()
    bus = await Bus.connect(BusOptions(url=server.url, reconnect_forever=True))
    try:
        await bus.publish(factories.joined("n1"))
        server.kill()

        async def restart_later() -> None:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(server.start)

        restart = asyncio.create_task(restart_later())
        seq = await bus.publish(factories.joined("n2", n=2), deadline_s=20.0)
        await restart
        assert seq == 2
        assert [r.event.node for r in await stored(bus)] == ["n1", "n2"]  # type: ignore[union-attr]
    finally:
        await bus.close()
        server.stop()


@contextlib.asynccontextmanager
async def server_of_its_own(
    tmp_path: Path, *, stall_check_s: float
) -> AsyncIterator[tuple[EmbeddedServer, Bus]]:
    """A server on a fixed port (a test restarts it there) and a bus to it."""
    server = EmbeddedServer(tmp_path / "nats", port=free_port())
    server.start()
    bus = await Bus.connect(BusOptions(url=server.url, reconnect_forever=True))
    bus.stall_check_s = stall_check_s
    try:
        yield server, bus
    finally:
        await bus.close()
        server.stop()


def leases(*requests: int) -> list[ev.ShardLeased]:
    """The master's answers to client c1 of dataset ds (stream ROVE_ANSWERS, in memory)."""
    leased = next(e for e in factories.data_events() if isinstance(e, ev.ShardLeased))
    return [msgspec.structs.replace(leased, id=f"l{r}", request=r) for r in requests]


async def answers_feed(bus: Bus, got: list[int]) -> Feed:
    return await bus.subscribe(
        subjects.ANSWER_STREAM,
        subjects.lease_answer("j1", "ds", "c1"),
        lambda rec: got.append(rec.event.request),  # type: ignore[attr-defined]
        lambda rej: None,
    )


async def test_a_feed_of_a_memory_stream_lost_with_its_server_reads_the_new_one(
    tmp_path: Path,
) -> None:
    """A memory stream is lost when its one server restarts, and the one a master makes
    again numbers its messages from 1: a feed that skipped what it had delivered by
    sequence never read another lease (a job stalled after a NATS restart)."""
    got: list[int] = []
    async with server_of_its_own(tmp_path, stall_check_s=0.2) as (server, bus):
        feed = await answers_feed(bus, got)
        for leased in leases(1, 2, 3):
            await bus.publish(leased)
        await eventually(lambda: got == [1, 2, 3], timeout=30)
        server.kill()
        await asyncio.to_thread(server.start)  # same port, same store: the answers are gone
        await bus.ensure_streams()  # what a master does as it leads again
        (after,) = leases(4)
        assert await bus.publish(after, deadline_s=30.0) == 1, "numbered from 1 again"
        await eventually(lambda: got == [1, 2, 3, 4], timeout=30)
        assert feed.renewed == 1
        await feed.stop()


@pytest.mark.slow
@pytest.mark.restarts_nats
@pytest.mark.xdist_group("nats-a")
async def test_a_feed_of_a_memory_stream_whose_every_server_restarted_reads_it_from_its_start(
    nats_cluster: Cluster,
) -> None:
    """A cluster all of whose servers restart at once (a power cut, every pod deleted)
    keeps a memory stream's definition, its creation time too, and loses its messages:
    the stream numbers them from 1 again. Before, each data client's feed waited for the
    sequences after those it had delivered and never read another lease: a real job hung
    (`tests/nemesis`, nats-restart-all)."""
    got: list[int] = []
    bus = await Bus.connect(BusOptions(url=nats_cluster.url, replicas=3, reconnect_forever=True))
    bus.stall_check_s = 0.2
    try:
        feed = await answers_feed(bus, got)
        for leased in leases(1, 2, 3):
            await bus.publish(leased)
        await eventually(lambda: got == [1, 2, 3], timeout=30)
        created = feed.created
        for node in nats_cluster.nodes:
            node.kill()
        for node in nats_cluster.nodes:
            await asyncio.to_thread(node.start)
        (after,) = leases(4)
        assert await bus.publish(after, deadline_s=60.0) == 1, "numbered from 1 again"
        await eventually(lambda: got == [1, 2, 3, 4], timeout=60)
        assert feed.renewed == 1
        assert feed.created == created, "the same stream, as its creation time says"
        await feed.stop()
    finally:
        await bus.close()


async def test_a_feed_whose_consumer_its_server_lost_is_resubscribed_as_it_reconnects(
    tmp_path: Path,
) -> None:
    """A restarted server has lost the feeds' ephemeral consumers: each feed resubscribes
    from its next sequence as its client reconnects, not after its stall checks."""
    got: list[records.Recorded | records.Rejection] = []
    # (no stall check comes: the reconnection alone)
    async with server_of_its_own(tmp_path, stall_check_s=3600.0) as (server, bus):
        feed = await bus.subscribe(
            subjects.EVENTS_STREAM, subjects.job_events("j1"), got.append, got.append
        )
        await bus.publish(factories.joined("n1"))
        await eventually(lambda: len(got) == 1, timeout=30)
        server.kill()
        await asyncio.to_thread(server.start)
        await eventually(lambda: feed.resubscribed == 1, timeout=30)
        await bus.publish(factories.joined("n2", n=2), deadline_s=30.0)
        await eventually(lambda: len(got) == 2, timeout=30)
        assert [r.seq for r in got] == [1, 2], "each once, in order"
        await feed.stop()


async def test_a_killed_embedded_server_is_started_again_on_its_port_with_its_streams(
    tmp_path: Path,
) -> None:
    """`rove run --standalone` owns its server: killed (or out of memory), it is started
    again on the same port and store, so that every client reconnects to the URL it
    knows; the stored events are all there, the memory streams are made again, and a
    feed of one reads on."""
    bus = await Bus.connect(BusOptions(embedded_dir=tmp_path / "emb"))
    bus.stall_check_s = 0.2
    server = bus.server
    assert server is not None
    got: list[int] = []
    try:
        feed = await answers_feed(bus, got)
        await bus.publish(factories.joined("n1"))
        await bus.publish(leases(1)[0])
        await eventually(lambda: got == [1], timeout=30)
        url, first = bus.url, server.pid
        with structlog.testing.capture_logs() as logs:
            assert first is not None
            os.kill(first, signal.SIGKILL)
            await eventually(lambda: server.pid != first and server.alive(), timeout=60)
            await bus.publish(factories.joined("n2", n=2), deadline_s=30.0)
            await bus.publish(leases(2)[0], deadline_s=30.0)
            await eventually(lambda: got == [1, 2], timeout=30)
        assert bus.url == url
        assert [r.event.node for r in await stored(bus)] == ["n1", "n2"]  # type: ignore[union-attr]
        said = [e["event"] for e in logs]
        lost = f"the job's NATS server (pid {first}) was killed by SIGKILL: starting it again"
        assert any(e.startswith(lost) for e in said), said
        await feed.stop()
    finally:
        await bus.close()
    assert not server.alive(), "closing the bus stops it for good"


async def test_a_keeper_whose_streams_cannot_be_put_back_says_so_and_still_tells_of_the_restart(
    tmp_path: Path,
) -> None:
    """Each step after a start again says its own failure: the server runs again, so a
    failed put-back of its streams is said as that (not as a failed start), and the
    listeners (the agent's event of the restart) are told all the same."""
    from rove.control.bus import embedded

    server = EmbeddedServer(tmp_path / "nats")
    server.start()
    told: list[embedded.Restarted] = []

    async def put_back() -> None:
        raise RuntimeError("no streams today")

    keeper = asyncio.create_task(embedded.keep(server, put_back, told=[told.append], check_s=0.05))
    try:
        first = server.pid
        assert first is not None
        with structlog.testing.capture_logs() as logs:
            os.kill(first, signal.SIGKILL)
            await eventually(lambda: told, timeout=60)
        assert told[0].pid_before == first and told[0].pid == server.pid != first
        said = [e["event"] for e in logs]
        assert "the job's NATS server runs again, but putting back its streams failed" in said
        assert not any("starting the job's NATS server again failed" in e for e in said), said
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        server.stop()


async def test_publish_gives_up_after_its_total_deadline(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "nats")
    server.start()
    bus = await Bus.connect(BusOptions(url=server.url, reconnect_forever=True))
    server.kill()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(PublishDeadlineError, match="no acknowledgement"):
            await bus.publish(factories.joined("n1"), deadline_s=1.5)
        assert loop.time() - started < 10  # bounded, not forever
    finally:
        await bus.close()


async def test_no_url_starts_an_embedded_server_and_close_stops_it(tmp_path: Path) -> None:
    bus = await Bus.connect(BusOptions(embedded_dir=tmp_path / "emb"))
    server = bus.server
    assert server is not None and server.alive()
    await bus.publish(factories.joined("n1"))
    assert await bus.job_exists("j1")
    assert not await bus.job_exists("other")
    await bus.close()
    assert not server.alive()


async def test_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(BusUnavailableError, match=r"cannot connect to NATS at nats://127\.0\.0\.1"):
        await Bus.connect(BusOptions(url=f"nats://127.0.0.1:{free_port()}"))


async def test_a_host_name_that_does_not_resolve_is_said_as_such() -> None:
    """(nats-py says only "no servers available for connection".)"""
    with pytest.raises(BusUnavailableError, match=r"no address for host nats-x\.invalid "):
        await Bus.connect(BusOptions(url="nats://nats-x.invalid:4222"))


async def test_malformed_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="invalid NATS URL"):
        await Bus.connect(BusOptions(url="localhost:4222"))


async def test_user_and_password_are_sent_and_wrong_ones_refused(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "auth", extra_args=["--user", "rove", "--pass", "s3cret"])
    server.start()
    try:
        bus = await Bus.connect(BusOptions(url=server.url, user="rove", password="s3cret"))
        await bus.publish(factories.joined("n1"))
        await bus.close()
        with pytest.raises(NotAuthorizedError):
            await Bus.connect(BusOptions(url=server.url, user="rove", password="wrong"))
    finally:
        server.stop()


async def test_caught_up_is_set_for_an_empty_job_and_after_the_backlog(bus: Bus) -> None:
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM, subjects.job_events("empty"), lambda r: None, lambda r: None
    )
    await asyncio.wait_for(feed.caught_up.wait(), patience(5))
    await feed.stop()
    await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(50)])
    seen: list[int] = []
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM,
        subjects.job_events("j1"),
        lambda r: seen.append(r.seq),
        lambda r: None,
    )
    await asyncio.wait_for(feed.caught_up.wait(), patience(5))
    assert seen == list(range(1, 51))
    await bus.publish(factories.joined("late", n=99))
    await eventually(lambda: len(seen) == 51)
    await feed.stop()


@pytest.mark.parametrize(
    "raw",
    [
        b"Nats-Msg-Id: j1:n1:3\r\n\r\n",
        b"Nats-Msg-Id:abc\r\nX-Other:  spaced value \r\n\r\n",
        b"Bad Name: x\r\nGood:\tv\r\nnocolon\r\n\xc3\xa9: skipped\r\nK: \xc3\xa9\xff\r\n\r\n",
        b"",
    ],
)
def test_fast_header_parser_agrees_with_nats_py(raw: bytes) -> None:
    from nats.aio.client import Client

    from rove.control.bus.natsclient import parse_header_lines

    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


async def test_a_worker_reaches_an_authenticated_server_with_the_agents_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rove run` hands its workers the URL and credentials (`options_env`); a data
    client in the worker connects with them (`options_from_env`)."""
    from rove.control.bus.options import options_env, options_from_env
    from rove.shard_service.client import DataClient

    server = EmbeddedServer(tmp_path / "auth", extra_args=["--user", "rove", "--pass", "s3cret"])
    server.start()
    try:
        assert server.url is not None
        agent = BusOptions(url=server.url, user="rove", password="s3cret", tls_ca_file=None)
        env = options_env(agent, server.url, tmp_path / "agent")
        secrets = tmp_path / "agent" / "nats-secrets.json"
        assert env == {
            "ROVE_NATS_URL": server.url,
            "ROVE_NATS_USER": "rove",
            "ROVE_NATS_SECRETS": str(secrets),
        }, "the password is in a file, not in the environment"
        assert secrets.stat().st_mode & 0o777 == 0o600
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        assert options_from_env(server.url).password == "s3cret"
        client = await asyncio.to_thread(DataClient, job="j1", dataset="ds", url=server.url)
        client.close()
        secrets.write_text('{"password": "wrong"}')
        with pytest.raises(NotAuthorizedError):
            await asyncio.to_thread(DataClient, job="j1", dataset="ds", url=server.url)
    finally:
        server.stop()


async def test_a_feed_from_a_time_with_nothing_after_it_is_caught_up_and_never_replays(
    bus: Bus,
) -> None:
    """A feed that starts at a time holds no message older than it, even when its
    watchdog looks at it (a feed with nothing to deliver is not a stalled one)."""
    import datetime as dt

    await bus.publish(factories.joined("old"))
    bus.stall_check_s = 0.1
    got: list[records.Recorded | records.Rejection] = []
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM,
        subjects.job_events("j1"),
        got.append,
        got.append,
        start_time=dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=1),
    )
    try:
        assert feed.caught_up.is_set(), "nothing after its start: caught up at once"
        await asyncio.sleep(1.0)  # ten watchdog checks
        assert got == [] and feed.resubscribed == 0
        await bus.publish(factories.joined("new", n=1))
        await eventually(lambda: len(got) == 1, timeout=patience(10))
        assert isinstance(got[0], records.Recorded) and got[0].event.node == "new"  # type: ignore[attr-defined]
    finally:
        await feed.stop()


async def test_a_feed_from_a_time_is_settled_only_once_what_the_server_sent_is_handled(
    bus: Bus,
) -> None:
    """A feed from a time whose messages the server had sent, but whose handler had not
    finished yet, looked empty (nothing pending, nothing handled) and said it had caught
    up: `rove events --since` printed nothing, once in CI. It settles once the sent
    message is handled."""
    import datetime as dt

    await bus.publish(factories.joined("old"))
    await asyncio.sleep(0.2)
    between = dt.datetime.now(dt.UTC)
    await asyncio.sleep(0.2)
    await bus.publish(factories.joined("new", n=1))
    handled: list[str] = []

    async def slow(rec: records.Recorded) -> None:
        await asyncio.sleep(0.5)  # (a loaded machine: the handler runs late)
        handled.append(rec.event.node)  # type: ignore[attr-defined]

    async def rejected(_rej: records.Rejection) -> None:
        raise AssertionError("no rejection here")

    feed = await bus.subscribe(
        subjects.EVENTS_STREAM, subjects.job_events("j1"), slow, rejected, start_time=between
    )
    try:
        await asyncio.wait_for(feed.settled(), patience(10))
        assert handled == ["new"], "settled before the message it was sent was handled"
    finally:
        await feed.stop()


async def test_heartbeats_live_in_memory_and_events_on_disk(bus: Bus) -> None:
    """Heartbeats (the newest per node) are worth nothing after a restart and must not
    share the fsync budget of the facts that matter."""
    from nats.js.api import StorageType

    hb = await bus.js.stream_info(subjects.HEARTBEAT_STREAM)
    events = await bus.js.stream_info(subjects.EVENTS_STREAM)
    assert hb.config.storage == StorageType.MEMORY
    assert events.config.storage == StorageType.FILE


def test_the_embedded_server_fsyncs_every_message_before_acknowledging_it(tmp_path: Path) -> None:
    """The server itself says so (its monitoring endpoint); the default would be every 2
    minutes, which loses acknowledged writes on a power failure."""
    import json
    import urllib.request

    port = free_port()
    server = EmbeddedServer(tmp_path / "nats", extra_args=["-m", str(port)])
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=10) as answer:
            config = json.load(answer)["jetstream"]["config"]
        assert config["sync_always"] is True
    finally:
        server.stop()


async def test_every_stream_is_bounded_and_old_events_are_retired(tmp_path: Path) -> None:
    import argparse

    from rove.control.flags import options

    server = EmbeddedServer(tmp_path / "nats")
    server.start()
    env = {"ROVE_EVENTS_MAX_AGE": "7d", "ROVE_EVENTS_MAX_BYTES": "2G"}
    args = argparse.Namespace(
        nats=server.url,
        **{a: None for a in ("nats_user", "nats_password", "nats_token", "nats_creds")},
        **{a: None for a in ("nats_nkey", "nats_auth", "nats_tls_ca", "nats_tls_cert")},
        nats_tls_key=None,
        replicas=0,
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        opts = options.bus_options(args, name="t")
    bus = await Bus.connect(opts)
    try:
        events = (await bus.js.stream_info(subjects.EVENTS_STREAM)).config
        assert events.max_age == 7 * 86400 and events.max_bytes == 2 * 2**30
        assert events.discard in ("old", DiscardPolicy.OLD)
        for name in (subjects.HEARTBEAT_STREAM, subjects.ANSWER_STREAM, subjects.SNAPSHOT_STREAM):
            assert (await bus.js.stream_info(name)).config.max_age > 0, name
        answers = (await bus.js.stream_info(subjects.ANSWER_STREAM)).config
        assert answers.storage in ("memory", StorageType.MEMORY), "leases spend no fsync"
        assert answers.max_bytes == streams.ANSWER_MAX_BYTES
    finally:
        await bus.close()
        server.stop()


def test_one_store_takes_one_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second server on a store another one uses is refused, saying who holds it (two
    servers on one store would write the same files); a restart of the same server, and a
    server once the first has stopped, are not."""
    from rove.control.bus import embedded
    from rove.control.errors import ConfigError

    monkeypatch.setattr(embedded, "STORE_WAIT_S", 0.5)
    first = EmbeddedServer(tmp_path / "nats")
    first.start()
    second = EmbeddedServer(tmp_path / "nats")
    try:
        assert embedded.store_user(tmp_path / "nats") == os.getpid()
        with pytest.raises(ConfigError, match=r"another nats-server uses the store") as refused:
            second.start()
        assert f"pid {first.pid}" in str(refused.value), "it names the holders"
        assert second.proc is None, "no second server was started"
        first.kill()
        first.start()  # the same server again: it holds the store already
        assert first.alive()
    finally:
        first.stop()
    assert embedded.store_user(tmp_path / "nats") is None
    second.start()
    second.stop()


def test_a_server_whose_starter_died_holds_the_store_until_it_stops(tmp_path: Path) -> None:
    """The server holds the store's lock too: its starter killed with SIGKILL, the store is
    not free until the server (stopped by its parent-death signal) is gone, and then it is."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from rove.control.bus.embedded import EmbeddedServer\n"
        "s = EmbeddedServer(Path(sys.argv[1]))\n"
        "s.start()\n"
        "print('pid', s.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "nats")], stdout=subprocess.PIPE, text=True
    )
    assert starter.stdout is not None
    server_pid = int(next(line for line in starter.stdout if line.startswith("pid ")).split()[1])
    from rove.control.bus import embedded

    assert embedded.store_user(tmp_path / "nats") == starter.pid
    starter.kill()
    starter.wait(30)
    assert embedded.store_user(tmp_path / "nats") is None, "its starter is gone: stopping"
    again = EmbeddedServer(tmp_path / "nats")
    again.start()  # waits for the dying server to let go of the store
    try:
        stat = Path(f"/proc/{server_pid}/stat")
        # gone, or dead and not yet reaped by whoever adopted it
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        again.stop()


async def test_a_feed_that_cannot_resubscribe_after_losing_its_consumer_tries_again() -> None:
    """A consumer lost with its server, and the first resubscribe fails (the stream is
    not back yet): the feed keeps its subscription, says so, and tries again at the next
    check; the one that works replaces the old subscription."""

    class LostSub:
        unsubscribed = False

        async def consumer_info(self) -> None:
            raise nats.js.errors.NotFoundError

        async def unsubscribe(self) -> None:
            self.unsubscribed = True

    old, new = LostSub(), object()
    answers: list[object] = [nats.errors.TimeoutError(), new]

    async def resubscribe(start: int) -> object:
        assert start == 8, "from the message after the last delivered"
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def created() -> StreamMark:
        return StreamMark("the same stream", 7)

    feed = Feed(sub=old, target_seq=0, last_seq=7, created="the same stream", recheck=True)
    with structlog.testing.capture_logs() as logs:
        await feed._renew(created, resubscribe, "test")
    assert feed.sub is old and feed.resubscribed == 0 and not old.unsubscribed
    assert feed.recheck, "asked again at the next check"
    assert any(e["event"] == "could not resubscribe; will try again" for e in logs)
    await feed._renew(created, resubscribe, "test")
    assert feed.sub is new and feed.resubscribed == 1 and old.unsubscribed
    assert not feed.recheck


async def test_a_feed_whose_resubscribe_to_a_stream_made_anew_fails_is_not_left_unsubscribed() -> (
    None
):
    """A cluster restarted at once, then again while the feed resubscribed to the stream
    numbering from 1: the new subscription failed. Before, the feed kept the one it had
    unsubscribed, with nothing delivered: its consumer still existed on the server, so
    the feed looked healthy and read nothing (a real job's workers waited for leases
    until gloo timed out). Now the next look subscribes again, from the start of a
    stream that went back, or after what was delivered of one that did not."""

    class OldSub:
        unsubscribed = False

        async def consumer_info(self) -> None:
            return None  # (its consumer outlives the unsubscription on the server)

        async def unsubscribe(self) -> None:
            self.unsubscribed = True

    for later_mark, restart_from in ((StreamMark("s", 2), 0), (StreamMark("s", 120), 94)):
        old, new = OldSub(), object()
        marks = [StreamMark("s", 2), later_mark]
        answers: list[object] = [nats.errors.TimeoutError(), new]
        starts: list[int] = []

        async def created(marks: list[StreamMark] = marks) -> StreamMark:
            return marks.pop(0)

        async def resubscribe(
            start: int, answers: list[object] = answers, starts: list[int] = starts
        ) -> object:
            starts.append(start)
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        feed = Feed(sub=old, target_seq=0, last_seq=93, created="s", recheck=True)
        with pytest.raises(nats.errors.TimeoutError):
            await feed._renew(created, resubscribe, "test")
        assert old.unsubscribed and feed.unsubscribed and feed.recheck
        assert feed.last_seq == 93, "what was delivered is not forgotten"
        await feed._renew(created, resubscribe, "test")
        assert starts == [0, restart_from]
        assert feed.sub is new and not feed.unsubscribed and not feed.recheck
