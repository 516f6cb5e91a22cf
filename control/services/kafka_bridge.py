"""The Kafka bridge: cuts a topic into stream shards as records arrive (`rove kafka-bridge`).

A `JobService`: it follows the job, so it knows where the shards already
published end (`state.streams`, folded by every master alike), and every
`poll_s` it reads the topic's partitions and their watermarks from the
brokers, cuts the new records into shards (`rove.control.domain.streaming.cut`) and
publishes them as one `stream_shards` fact. A bridge killed and started again
continues where the folded shards end; two bridges are harmless (the fold
ignores shards published before). Partitions added to the topic while it
runs are picked up on the next read.

It reads metadata and watermarks only: trainers read the records themselves,
from the leased offset ranges.

With a consumer `group`, it also mirrors the trained offsets to Kafka for lag
dashboards: once a checkpoint step commits, the offset vector saved with it
(`stream_checkpointed`, folded into `Stream.saved`) is committed to the group.
The mirror is never the authority: a restore takes its position from the
checkpoint. It also says loudly when retention deleted records that the
newest restore point has not trained (a restore would fail on them).

Brokers that cannot be reached, or a topic that does not exist, are retried
until `connect_deadline_s`, then end the bridge with an error that says which.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import structlog
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.domain.streaming import cut
from rove.control.domain.words import counted
from rove.control.errors import ConfigError, TemporaryError
from rove.control.master import streams
from rove.control.master.service import JobService
from rove.control.process import kafka_settings, logs

log = structlog.get_logger("rove.kafka")

#: How often brokers that cannot be reached are said again on the console (each try
#: is in the log).
SAY_EVERY_S = 30.0


class BrokerReader:
    """Partitions and watermarks of one topic, read with a consumer that never joins a
    group or fetches a record (blocking calls: run it in a thread)."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        group: str = "",
        timeout_s: float = 5.0,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """`settings`: the user's librdkafka settings (TLS, SASL: see
        `rove.control.process.kafka_settings`), under the bridge's own.

        Raises:
            ConfigError: librdkafka refuses a setting.
        """
        self.bootstrap = bootstrap
        self.topic = topic
        self.group = group
        self.timeout_s = timeout_s
        #: the Kafka client's last error of its own (a refused login, a bad certificate)
        self.client_error = ""
        self.consumer = kafka_settings.consumer(
            settings or {},
            {
                "bootstrap.servers": bootstrap,
                "group.id": group or f"rove-bridge-{topic}",
                "enable.auto.commit": False,
                "allow.auto.create.topics": False,
                "logger": _LIBRDKAFKA,
                "error_cb": self._client_error,
            },
        )

    def _client_error(self, error: KafkaError) -> None:
        self.client_error = kafka_settings.kept_error(self.client_error, error)

    def watermarks(self) -> list[ev.Watermark]:
        try:
            meta = self.consumer.list_topics(self.topic, timeout=self.timeout_s)
        except KafkaException as exc:
            self.consumer.poll(0)  # (serves the client's error callbacks: why it failed)
            raise TemporaryError(
                f"cannot reach the Kafka brokers {self.bootstrap}: {exc.args[0]}"
                + kafka_settings.last_error(self.client_error)
            ) from exc
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None:
            code = topic.error.code() if topic is not None and topic.error is not None else None
            if code == KafkaError.UNKNOWN_TOPIC_OR_PART or topic is None:
                raise TemporaryError(f"topic {self.topic} does not exist on {self.bootstrap}")
            raise TemporaryError(f"topic {self.topic}: {topic.error}")
        marks = []
        for partition in sorted(topic.partitions):
            try:
                low, high = self.consumer.get_watermark_offsets(
                    TopicPartition(self.topic, partition), timeout=self.timeout_s
                )
            except KafkaException as exc:
                raise TemporaryError(
                    f"cannot read the offsets of {self.topic}[{partition}]: {exc.args[0]}"
                ) from exc
            marks.append(ev.Watermark(partition, max(0, low), max(0, high)))
        return marks

    def commit(self, offsets: tuple[tuple[int, int], ...]) -> None:
        """Commit `(partition, next offset)` pairs to the consumer group (no rebalance:
        the consumer never subscribes)."""
        try:
            self.consumer.commit(
                offsets=[TopicPartition(self.topic, p, o) for p, o in offsets],
                asynchronous=False,
            )
        except KafkaException as exc:
            raise TemporaryError(
                f"cannot commit offsets of {self.topic} to group {self.group}: {exc.args[0]}"
            ) from exc

    def close(self) -> None:
        self.consumer.close()


#: librdkafka's own log lines (connection retries every second) stay out of rove's
#: output: rove says what matters itself.
_LIBRDKAFKA = logs.silent("rove.kafka.librdkafka")


class KafkaBridge(JobService):
    def __init__(
        self,
        bus: Bus,
        job: str,
        reader: BrokerReader,
        *,
        dataset: str,
        bridge_id: str,
        shard_records: int = 256,
        linger_s: float = 1.0,
        poll_s: float = 0.5,
        connect_deadline_s: float = 60.0,
        flags: tuple[str, str] = ("--bootstrap", "--topic"),
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(bus, job, name=f"kafka bridge {bridge_id}", clock=clock)
        if shard_records < 1:
            raise ConfigError(f"--shard-records must be at least 1, got {shard_records}")
        self.reader = reader
        self.dataset = subjects.check_name("dataset", dataset)
        self.bridge_id = bridge_id
        self.shard_records = shard_records
        self.linger_s = linger_s
        self.poll_s = poll_s
        self.connect_deadline_s = connect_deadline_s
        #: the flags that gave the brokers and the topic, named when they cannot be reached
        self.flags = flags
        self._waiting: dict[int, float] = {}
        self._published: dict[int, int] = {}
        self._mirrored: tuple[tuple[int, int], ...] = ()
        self._expired: list[streams.Gap] = []
        self.log = log.bind(job=job, dataset=dataset, topic=reader.topic, bridge=bridge_id)

    def _next(self) -> dict[int, int]:
        stream = self.state.data.streams.streams.get(self.dataset)
        folded = dict(stream.next) if stream is not None else {}
        for p, end in self._published.items():  # emitted, maybe not folded back yet
            folded[p] = max(folded.get(p, 0), end)
        return folded

    async def serve(self) -> None:
        self.log.info("bridge is following the job", next=self._next() or None)
        failing_since: float | None = None
        said_at: float | None = None
        while not self.stopping and not self.state.phase.terminal:
            try:
                marks = await asyncio.to_thread(self.reader.watermarks)
            except TemporaryError as exc:
                if self.stopping or self.state.phase.terminal:
                    break  # (asked while the brokers were being asked: no retry to say)
                failing_since = failing_since or time.monotonic()
                waited = time.monotonic() - failing_since
                if waited > self.connect_deadline_s:
                    raise ConfigError(
                        f"{exc} (still after {waited:.0f}s): check {' and '.join(self.flags)}"
                    ) from exc
                # on the console when it starts and every half minute; each try in the log
                loud = said_at is None or time.monotonic() - said_at >= SAY_EVERY_S
                said_at = time.monotonic() if loud else said_at
                (self.log.warning if loud else self.log.info)(
                    f"{exc}; retrying for up to {self.connect_deadline_s:g}s",
                    waited_s=round(waited, 1),
                )
                await self.sleep(min(5.0, max(self.poll_s, 1.0)))
                continue
            if failing_since is not None:
                self.log.info("brokers and topic reachable again")
            failing_since = said_at = None
            self._cut(marks)
            await self._follow_checkpoints()
            await self.sleep(self.poll_s)
        await self._follow_checkpoints()  # the job's last commit
        self.log.info("bridge done", phase=self.state.phase.value)

    async def _follow_checkpoints(self) -> None:
        """Mirror the committed step's offsets to the group; report expired records."""
        stream = self.state.data.streams.streams.get(self.dataset)
        if stream is None:
            return
        vector = streams.committed(stream, self.state.ckpt.committed)
        restore_point = vector or (stream.saved[-1] if stream.saved else None)
        expired = streams.expired(stream, restore_point)
        if expired and expired != self._expired:
            self.log.error(
                "retention deleted records the restore point has not trained: a restore "
                "would fail on them; keep the topic longer than the checkpoint interval "
                "(retention.ms) or checkpoint more often",
                step=restore_point.step if restore_point else None,
                deleted=[f"{g.partition}:{g.start}-{g.end}" for g in expired],
            )
        self._expired = expired
        if not self.reader.group or vector is None or vector.offsets == self._mirrored:
            return
        try:
            await asyncio.to_thread(self.reader.commit, vector.offsets)
        except TemporaryError as exc:
            self.log.warning(f"{exc}; trying again at the next commit")
            return
        say = self.log.debug if self._mirrored else self.log.info  # the first one, then quiet
        self._mirrored = vector.offsets
        say(
            "mirrored the committed offsets to the consumer group",
            group=self.reader.group,
            step=vector.step,
            offsets=dict(vector.offsets),
        )

    def _cut(self, marks: list[ev.Watermark]) -> None:
        shards, self._waiting = cut(
            self._next(),
            marks,
            shard_records=self.shard_records,
            linger_s=self.linger_s,
            waiting_since=self._waiting,
            now=self.clock(),
        )
        if not shards:
            return
        first = shards[0]
        self.emit(
            ev.StreamShardsAdded(
                **ev.envelope(
                    self.job,
                    f"bridge:{self.bridge_id}",
                    self.clock(),
                    "stream",
                    self.dataset,
                    first.partition,
                    first.start,
                    len(shards),
                ),
                dataset=self.dataset,
                topic=self.reader.topic,
                bridge=self.bridge_id,
                shards=tuple(shards),
                watermarks=tuple(marks),
            )
        )
        for s in shards:
            self._published[s.partition] = max(self._published.get(s.partition, 0), s.end)
        self.log.info(
            f"published {counted(len(shards), 'shard')}, "
            f"{counted(sum(s.records for s in shards), 'record')}",
            partitions=sorted({s.partition for s in shards}),
        )
