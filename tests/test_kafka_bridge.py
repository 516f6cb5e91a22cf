"""`rove kafka-bridge` against librdkafka's mock cluster (a real Kafka-protocol server on
loopback, held by tests/scripts/kafka_mock.py) and a real nats-server.

What is tested: shards cover every produced offset once and in order, also when
the bridge is killed -9 and started again while records arrive; a missing topic
and unreachable brokers end the bridge with an error that says which.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog
import structlog.testing

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.master import streams
from tests import factories
from tests.kafkamock import KafkaCluster
from tests.support import BridgeProc, eventually, job_events, rove_cli

pytestmark = pytest.mark.slow

JOB = factories.JOB


async def folded(bus: Bus) -> streams.StreamState:
    state = streams.StreamState()
    for e in await job_events(bus, JOB):
        if isinstance(e, ev.StreamShardsAdded):
            state = streams.on_shards(state, e)
    return state


async def covered(bus: Bus, want: dict[int, int]) -> bool:
    stream = (await folded(bus)).streams.get("clicks")
    return stream is not None and all(stream.next.get(p) == n for p, n in want.items())


async def test_shards_cover_every_offset_once_through_a_bridge_killed_and_restarted(
    bus: Bus, kafka: KafkaCluster, tmp_path: Path
) -> None:
    await bus.publish(factories.joined("n1"))  # the job exists
    kafka.produce("clicks", 0, 1)  # the topic exists (the mock makes 4 partitions)
    args = ("--bootstrap", kafka.bootstrap, "--topic", "clicks")
    args += ("--shard-records", "10", "--linger", "0.5", "--poll", "0.2")
    first = BridgeProc(bus.url, JOB, "b1", tmp_path, *args)
    kafka.produce("clicks", 0, 44)
    kafka.produce("clicks", 1, 23)
    await eventually(lambda: covered(bus, {0: 45, 1: 23}), timeout=60, every=0.3)
    first.kill()
    kafka.produce("clicks", 1, 30)
    kafka.produce("clicks", 3, 7)
    BridgeProc(bus.url, JOB, "b2", tmp_path, *args)
    await eventually(lambda: covered(bus, {0: 45, 1: 53, 3: 7}), timeout=60, every=0.3)

    stream = (await folded(bus)).streams["clicks"]
    for partition, end in {0: 45, 1: 53, 2: 0, 3: 7}.items():
        mine = [s for _, s in sorted(stream.shards.items()) if s.partition == partition]
        assert [o for s in mine for o in range(s.start, s.end)] == list(range(end)), mine
        assert all(s.records <= 10 for s in mine)
    assert not stream.gaps and stream.topic == "clicks"
    assert {w.partition: w.high for w in stream.watermarks}[1] == 53
    assert streams.lag(stream) == {0: 0, 1: 0, 2: 0, 3: 0}
    status = rove_cli("status", "--job", JOB, "--nats", bus.url, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "stream clicks (topic clicks): " in status.stdout
    assert "105 records cut" in status.stdout and "p1 53/53" in status.stdout, status.stdout


@pytest.mark.parametrize(
    ("bootstrap", "topic", "says"),
    [
        (None, "missing", "topic missing does not exist"),
        ("127.0.0.1:1", "clicks", "cannot reach the Kafka brokers 127.0.0.1:1"),
    ],
)
async def test_a_missing_topic_or_unreachable_brokers_end_the_bridge_saying_which(
    bus: Bus, kafka: KafkaCluster, bootstrap: str | None, topic: str, says: str
) -> None:
    await bus.publish(factories.joined("n1"))
    done = rove_cli(
        "kafka-bridge",
        *("--job", JOB, "--nats", bus.url, "--topic", topic, "--connect-deadline", "2"),
        *("--bootstrap", bootstrap or kafka.bootstrap),
        timeout=120,
    )
    assert done.returncode != 0
    assert says in done.stderr, done.stderr[-2000:]
    assert "check --bootstrap and --topic" in done.stderr


async def test_under_rove_run_unreachable_brokers_name_rove_runs_flags(bus: Bus) -> None:
    # the bridge inside `rove run --standalone` is told by --kafka-bootstrap and
    # --kafka-topic; it once said "check --bootstrap and --topic", flags rove run lacks
    from rove.agent.launcher import _bridge, agent_config
    from rove.agent.run_args import build_parser
    from rove.control.errors import ConfigError

    args = build_parser().parse_args(
        [
            *("--nats", bus.url, "--job", JOB, "--kafka-bootstrap", "127.0.0.1:1"),
            *("--kafka-topic", "clicks", str(Path(__file__).parent.parent / "examples/online.py")),
        ]
    )
    await bus.publish(factories.joined("n1"))
    kept = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        bridge = _bridge(bus, agent_config(args)[0], args)  # (its logger binds the level)
    finally:
        structlog.configure(**kept)
    bridge.connect_deadline_s = 3.0
    bridge.reader.timeout_s = 1.0  # (each try waits this out: librdkafka's 5 s by default)
    with (
        structlog.testing.capture_logs() as said,
        pytest.raises(ConfigError, match="check --kafka-bootstrap and --kafka-topic"),
    ):
        await bridge.run()
    tries = [e for e in said if "retrying for up to 3s" in e["event"]]
    assert len(tries) >= 2, [(e["log_level"], e.get("waited_s")) for e in said]
    assert [e["log_level"] for e in tries][:2] == ["warning", "info"], (
        "said on the console once a half minute, each try in the log"
    )
