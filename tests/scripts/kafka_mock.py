"""Holds a librdkafka mock cluster (a real Kafka-protocol server on loopback) for tests.

The cluster lives in the process that created it, so tests run this script:
it prints the bootstrap address, then obeys lines on stdin:

    produce TOPIC PARTITION N   append N records "TOPIC/PARTITION/OFFSET"; prints "ok"
    garbage TOPIC PARTITION     append one record no decoder reads; prints "ok"
    bulk TOPIC PARTITION N SIZE append N records of SIZE bytes; prints "ok" (the mock
                                keeps a few MB per partition: older records are deleted,
                                as retention would)
"""

from __future__ import annotations

import logging
import sys

from confluent_kafka import Producer


def main() -> None:
    quiet = logging.getLogger("kafka-mock")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    producer = Producer(
        {"test.mock.num.brokers": 1, "logger": quiet, "message.max.bytes": 2_000_000}
    )
    meta = producer.list_topics(timeout=10)
    print(",".join(f"{b.host}:{b.port}" for b in meta.brokers.values()), flush=True)
    counts: dict[tuple[str, int], int] = {}
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "produce":
            topic, partition, n = cmd[1], int(cmd[2]), int(cmd[3])
            for _ in range(n):
                at = counts.get((topic, partition), 0)
                producer.produce(
                    topic, value=f"{topic}/{partition}/{at}".encode(), partition=partition
                )
                counts[topic, partition] = at + 1
            producer.flush(30)
            print("ok", flush=True)
        elif cmd[0] == "bulk":
            topic, partition, n, size = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
            for _ in range(n):
                producer.produce(topic, value=b"b" * size, partition=partition)
                counts[topic, partition] = counts.get((topic, partition), 0) + 1
                producer.poll(0)
            producer.flush(30)
            print("ok", flush=True)
        elif cmd[0] == "garbage":
            topic, partition = cmd[1], int(cmd[2])
            producer.produce(topic, value=b"\xff not a record", partition=partition)
            counts[topic, partition] = counts.get((topic, partition), 0) + 1
            producer.flush(30)
            print("ok", flush=True)


if __name__ == "__main__":
    main()
