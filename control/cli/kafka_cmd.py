"""`rove kafka-bridge`: cut a Kafka topic into a job's stream shards as records arrive.

rove kafka-bridge --job j1 --bootstrap broker:9092 --topic clicks

It follows the job, reads the topic's partitions and watermarks every
`--poll` seconds, and publishes new records as `stream_shards` events of
`--shard-records` offsets each (a smaller last one once its records waited
`--linger` seconds). Killed and started again, it continues where the
published shards end; partitions added to the topic are picked up. See
docs/streaming.md.
"""

from __future__ import annotations

import argparse

import structlog

from rove.control.bus.client import Bus
from rove.control.catalogue import subjects
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.process import aio

log = structlog.get_logger("rove.kafka")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "kafka-bridge",
        help="cut a Kafka topic into a job's stream shards as records arrive",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_job_arg(p)
    p.add_argument("--id", dest="bridge_id", help="this bridge's id (default: host-pid)")
    p.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers, host:port,...")
    p.add_argument("--topic", required=True, help="the topic to stream")
    p.add_argument("--dataset", help="the dataset name trainers ask for (default: the topic)")
    p.add_argument(
        "--group",
        default="",
        help="mirror the offsets of each committed checkpoint to this Kafka consumer group "
        "(for lag dashboards; restores never read it)",
    )
    p.add_argument(
        "--shard-records",
        type=int,
        default=256,
        metavar="N",
        help="records per shard (default 256)",
    )
    p.add_argument(
        "--linger",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="cut a smaller last shard once its oldest record waited this long (default 1)",
    )
    p.add_argument(
        "--poll",
        type=common.positive,
        default=0.5,
        metavar="SECONDS",
        help="how often to read the partitions' watermarks (default 0.5)",
    )
    p.add_argument(
        "--kafka-config",
        metavar="FILE",
        help="librdkafka settings for a secured cluster (security.protocol, ssl.*, sasl.*), "
        "one key=value per line, from this file (default: the file named in "
        "$ROVE_KAFKA_CONFIG); secrets never go on the command line (docs/streaming.md)",
    )
    p.add_argument(
        "--connect-deadline",
        type=common.positive,
        default=60.0,
        metavar="SECONDS",
        help="unreachable brokers or a missing topic end the bridge after this long (default 60)",
    )
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bridge_id = subjects.check_name("bridge id", args.bridge_id or common.process_id())
    dataset = subjects.check_name("dataset", args.dataset or args.topic)
    if args.shard_records < 1:
        raise ConfigError(f"--shard-records must be at least 1, got {args.shard_records}")
    if args.linger < 0:
        raise ConfigError(f"--linger must be 0 or more, got {args.linger}")
    return aio.run(_run(args, bridge_id, dataset), watch=f"Kafka bridge {bridge_id}")


async def _run(args: argparse.Namespace, bridge_id: str, dataset: str) -> int:
    try:
        from rove.control.services.kafka_bridge import BrokerReader, KafkaBridge
    except ImportError as exc:
        raise ConfigError(
            f"rove kafka-bridge needs confluent-kafka ({exc}): pip install 'rove[kafka]'"
        ) from exc
    options = common.bus_options(args, name=f"rove-bridge-{bridge_id}", job=args.job, daemon=True)
    starting = aio.Starting(f"kafka bridge {bridge_id}")
    bus = await starting.wait(Bus.connect(options))
    from rove.control.process import kafka_settings

    settings = kafka_settings.load(args.kafka_config)
    if settings:
        log.info("Kafka client settings", job=args.job, **kafka_settings.shown(settings))
    reader = BrokerReader(args.bootstrap, args.topic, group=args.group, settings=settings)
    bridge = KafkaBridge(
        bus,
        args.job,
        reader,
        dataset=dataset,
        bridge_id=bridge_id,
        shard_records=args.shard_records,
        linger_s=args.linger,
        poll_s=args.poll,
        connect_deadline_s=args.connect_deadline,
    )
    starting.started(bridge.stop)
    try:
        await bridge.run()
    finally:
        reader.close()
        await bus.close()
    log.info("bridge stopped", job=args.job, bridge=bridge_id)
    return common.EXIT_OK
