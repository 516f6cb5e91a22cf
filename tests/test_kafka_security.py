"""A secured Kafka cluster's settings (TLS, SASL) reach rove's Kafka clients from a file,
never from the command line (`rove.control.process.kafka_settings`).

The parsing is pure. Against librdkafka's mock cluster, which has no SASL: the
bridge and the reader given SASL settings through the file fail to log in, and say
librdkafka's reason (so the settings did reach the client), without ever showing the
password. A setting librdkafka does not know, or a file that cannot be read, is a
clear error at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import ConfigError
from rove.control.process import kafka_settings
from rove.shard_service.keeper import DataError
from tests import factories
from tests.kafkamock import KafkaCluster
from tests.support import rove_cli

JOB = factories.JOB
PASSWORD = "hunter2-not-shown"
SASL = f"""\
# the cluster's login (librdkafka's names)
security.protocol=SASL_PLAINTEXT
sasl.mechanism = SCRAM-SHA-256
sasl.username=trainer

sasl.password={PASSWORD}
! a comment too
"""


def test_a_properties_file_reads_as_kafkas_clients_read_it() -> None:
    settings = kafka_settings.parse(SASL + "sasl.oauthbearer.config=a=b c=d\n", "f")
    assert settings == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "trainer",
        "sasl.password": PASSWORD,
        "sasl.oauthbearer.config": "a=b c=d",  # the first = splits
    }
    shown = kafka_settings.shown(settings)
    assert shown["sasl.password"] == "***" and shown["sasl.username"] == "trainer"
    # rove's own settings stay rove's
    assert kafka_settings.merged(settings, {"group.id": "g"})["group.id"] == "g"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f"sasl.password {PASSWORD}\n", "f, line 1: not a `key=value` setting"),
        ("ssl.ca.location=/ca.pem\ngroup.id=mine\n", "f, line 2: group.id is set by rove"),
        ("bootstrap.servers=b:9092\n", "line 1: bootstrap.servers is set by rove"),
        ("a.b=1\na.b=2\n", "line 2: a.b is set twice"),
    ],
)
def test_a_bad_line_is_named_without_its_value(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        kafka_settings.parse(text, "f")
    assert says in str(caught.value)
    assert PASSWORD not in str(caught.value)


def test_the_file_comes_from_the_option_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text(SASL)
    assert kafka_settings.load(None, {}) == {}
    assert kafka_settings.load(None, {kafka_settings.ENV: str(path)})["sasl.username"] == "trainer"
    assert kafka_settings.load(str(path), {kafka_settings.ENV: "/elsewhere"})["sasl.username"]
    with pytest.raises(ConfigError, match="cannot read the Kafka settings file /no/such"):
        kafka_settings.load("/no/such", {})


@pytest.mark.slow
async def test_the_bridge_logs_in_with_the_files_settings_and_never_shows_the_password(
    bus: Bus, kafka: KafkaCluster, tmp_path: Path
) -> None:
    kafka.produce("clicks", 0, 3)
    config = tmp_path / "client.properties"
    config.write_text(SASL)
    await bus.publish(factories.joined("n1"))
    done = rove_cli(
        "kafka-bridge",
        *("--job", JOB, "--nats", bus.url, "--topic", "clicks", "--connect-deadline", "2"),
        *("--bootstrap", kafka.bootstrap, "--kafka-config", str(config)),
        timeout=120,
    )
    assert done.returncode != 0
    said = done.stdout + done.stderr
    # the mock has no SASL: librdkafka's reason is said, so the settings reached it
    assert "cannot reach the Kafka brokers" in said and "SASL" in said, said[-2000:]
    assert PASSWORD not in said

    # a setting librdkafka does not know: refused at once, named
    config.write_text("ssl.ca.locaton=/etc/ca.pem\n")
    done = rove_cli(
        "kafka-bridge",
        *("--job", JOB, "--nats", bus.url, "--topic", "clicks"),
        *("--bootstrap", kafka.bootstrap, "--kafka-config", str(config)),
        timeout=60,
    )
    assert done.returncode != 0
    assert "the Kafka client refuses its settings" in done.stderr, done.stderr[-2000:]
    assert "ssl.ca.locaton" in done.stderr


@pytest.mark.slow
def test_the_reader_uses_the_files_settings_and_says_why_no_record_comes(
    kafka: KafkaCluster,
) -> None:
    from rove.shard_service.kafka import RangeReader

    kafka.produce("clicks", 0, 3)
    settings = kafka_settings.parse(SASL, "f")
    reader = RangeReader(kafka.bootstrap, "clicks", poll_s=0.2, stall_s=2.0, settings=settings)
    shard = ev.StreamShard(partition=0, start=0, end=3)
    try:
        with pytest.raises(DataError) as caught:
            for _ in range(100):  # 20 s at most: it stalls after 2
                reader.take({0: (shard, 0)})
    finally:
        reader.close()
    assert "no record of partition 0 came" in str(caught.value)
    assert "SASL" in str(caught.value), str(caught.value)
    assert PASSWORD not in str(caught.value)


def test_rove_run_gives_the_workers_the_files_path_never_its_contents(tmp_path: Path) -> None:
    import argparse

    from rove.agent.launcher import _kafka_env

    def env(**given: object) -> dict[str, str]:
        args = {"kafka_bootstrap": None, "kafka_topic": None, "kafka_config": None}
        args |= {"kafka_shard_records": 256, **given}
        return dict(_kafka_env(argparse.Namespace(**args)))

    config = tmp_path / "client.properties"
    config.write_text(SASL)
    got = env(kafka_bootstrap="b:9092", kafka_topic="clicks", kafka_config=str(config))
    assert got[kafka_settings.ENV] == str(config.resolve())
    assert PASSWORD not in repr(got)
    with pytest.raises(ConfigError, match="--kafka-config is for a job that streams from Kafka"):
        env(kafka_config=str(config))
    with pytest.raises(ConfigError, match="cannot read the Kafka settings file"):
        env(kafka_bootstrap="b:9092", kafka_topic="clicks", kafka_config=str(tmp_path / "no"))
