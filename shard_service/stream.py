"""A Kafka stream as an `IterableDataset`: leased offset ranges, read by loader workers.

    from rove.shard_service.stream import StreamIterable

    data = StreamIterable("clicks", bootstrap="broker:9092", topic="clicks", decode=parse)
    loader = data.loader(batch_size=64, num_workers=2)
    if restored:
        data.load_state_dict(state["data"])      # the offsets the model had trained
    for batch in loader:                         # the stream has no end
        ...
        ckpt.save(step, {"model": ..., "data": data.state_dict()})

The dataset's shards are cut by `rove kafka-bridge` (docs/streaming.md). Each
loader worker is a data client of its own: it leases shards (each with its
offset range), reads exactly those records with `RangeReader` (`assign` +
`seek`, no consumer group; a range of every partition at once, as Kafka
delivers them) and yields `decode(record)`. A request that finds nothing cut
waits in the master until the bridge cuts more; the worker waits for it in
slices of `idle_s`. As with
`ShardedIterable`, the main process sees what reached the training loop and
acknowledges a shard once its last record was delivered; the data position in
the checkpoint is therefore the topic's offset vector of the trained model.

Each worker makes its own batches: a batch is full at `batch_size` records,
or goes out smaller as soon as the worker has no leased shard left to read, so
a pause in the stream never holds trained-ready records back. Batches come as
workers fill them (`in_order=False`): a worker waiting for the stream does not
hold back the others.

Under DDP (`lockstep`), ranks step together, but one rank's shards may be
all read while the others still train, and a stream has no end to agree on.
So a worker with nothing to read yields an *idle tick* every `idle_s`: the
loader gives the training loop `None` for it (a zero-size step, as with
`ShardSampler`), and every rank keeps stepping while it waits for the
stream. Without lockstep, ticks are dropped and the loader simply waits.

`bootstrap` and `topic` default to `ROVE_KAFKA_BOOTSTRAP` and
`ROVE_KAFKA_TOPIC`, which `rove run --kafka` sets for its workers.

A record `decode` cannot read is skipped and training goes on: each shard's
undecodable records (the dead letters) are logged once and published as one
`records_undecodable` event with their partition, first offsets and first
error, which `rove status` shows. Each worker reads
one record ahead, so the last record a shard delivers carries the news that the
shard is complete, whatever records of its range were skipped.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Unpack, cast

import msgspec
import torch
import torch.distributed as dist
from confluent_kafka import Message
from torch.utils.data import DataLoader, get_worker_info
from torch.utils.data._utils.collate import default_collate

from rove.checkpoint.api import on_save
from rove.control.catalogue import events as ev
from rove.control.errors import ConfigError, plain
from rove.control.process import kafka_settings, logs
from rove.shard_service.client import DataClient
from rove.shard_service.iterable import LeasedIterable
from rove.shard_service.kafka import RangeReader, Record
from rove.shard_service.keeper import MAX_AHEAD
from rove.shard_service.options import Leasing, streamed
from rove.shard_service.sampler import _distributed, deliveries

log = logs.get("rove.data")


class _Batch(NamedTuple):
    """A batch as it crosses from a loader worker: the samples, where each came from,
    and per shard in it the position delivered up to and whether that ends the shard."""

    samples: Any  # None for an idle tick
    where: list[tuple[int, list[int]]]  # (partition, offsets) of each run of samples
    progress: list[tuple[int, int, bool]]  # (shard key, next position, shard complete)
    owner: str  # the loader worker's data client, which holds the leases
    newest_ts: float  # produce time of the newest record (0 when unknown)


class _Filling:
    """The batch a loader worker is filling."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.clear()

    def clear(self) -> None:
        self.samples: list[Any] = []
        self.where: list[tuple[int, list[int]]] = []
        self.progress: dict[int, tuple[int, bool]] = {}
        self.newest_ts = 0.0

    def add(
        self, key: int, shard: ev.StreamShard, samples: list[Any], msgs: list[Message], last: bool
    ) -> None:
        """`samples` decoded from the messages `msgs` of shard `key`; `last`: its range
        ends here."""
        self.samples.extend(samples)
        # (offsets, not a tuple per record: the main process expands them if asked)
        offsets = cast("list[int]", list(map(Message.offset, msgs)))  # read ones: never None
        self.where.append((shard.partition, offsets))
        newest = msgs[-1]
        self.progress[key] = (cast(int, newest.offset()) - shard.start + 1, last)
        # the newest record of a partition is its last: its produce time is the batch's
        kind, ms = newest.timestamp()
        if kind:
            self.newest_ts = max(self.newest_ts, ms / 1000)

    def take(self) -> _Batch:
        batch = _Batch(
            default_collate(self.samples),  # type: ignore[no-untyped-call]
            self.where,
            [(key, nxt, last) for key, (nxt, last) in self.progress.items()],
            self.owner,
            self.newest_ts,
        )
        self.clear()
        return batch


_IDLE_TICK = _Batch(None, [], [], "", 0.0)


class _Reading:
    """A leased range a loader worker is reading: its undecodable records so far, and
    its newest decoded record, held back until the next shows whether it is the last."""

    __slots__ = ("dead", "newest", "ref", "shard")

    def __init__(self, ref: ev.ShardRef, shard: ev.StreamShard) -> None:
        self.ref = ref
        self.shard = shard
        self.dead = _DeadLetters()
        self.newest: tuple[Any, Message] | None = None


class _DeadLetters:
    """A shard's undecodable records: how many, the first offsets, the first error."""

    KEPT = 16

    def __init__(self) -> None:
        self.count = 0
        self.offsets: list[int] = []
        self.error = ""

    def add(self, offset: int, exc: Exception) -> None:
        self.count += 1
        if len(self.offsets) < self.KEPT:
            self.offsets.append(offset)
        if not self.error:
            self.error = f"{type(exc).__name__}: {plain(exc)}"  # what the decode raised


def _value(record: Record) -> Any:
    return record.value


class StreamIterable(LeasedIterable):
    def __init__(
        self,
        name: str,
        *,
        bootstrap: str | None = None,
        topic: str | None = None,
        decode: Callable[[Record], Any] = _value,
        idle_s: float = 0.2,
        kafka_config: str | None = None,
        **options: Unpack[Leasing],
    ) -> None:
        """The stream `name`, records of Kafka `topic` at `bootstrap` (default: what
        `rove run` put in the environment) leased in offset ranges, each record given to
        `decode`; `kafka_config`: a file of librdkafka settings for a secured cluster
        (default: the one `rove run --kafka-config` names in ROVE_KAFKA_CONFIG);
        `options`: how it is leased and where this process runs
        (`rove.shard_service.options`)."""
        o = streamed("stream", name, options)
        super().__init__(name, o.spec, o.where, o.pace)
        self.bootstrap = _setting(bootstrap, "ROVE_KAFKA_BOOTSTRAP", "bootstrap")
        self.topic = _setting(topic, "ROVE_KAFKA_TOPIC", "topic")
        # TLS, SASL...: read here, so that a file it cannot use fails the script at once
        self.kafka_settings = kafka_settings.load(kafka_config)
        self.decode = decode
        self.idle_s = idle_s
        self.batch_size = 1
        # worker side
        self.undecodable = 0
        # main process: the produce time of the newest record that reached the loop
        self.newest_ts = 0.0
        self._unsaved: tuple[ev.DataPosition, float] | None = None

    # ------------------------------------------------------------------ worker side

    def __iter__(self) -> Iterator[_Batch]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        client = DataClient.at(self.where, self.name, f"{self.base_client}-w{worker}")
        reader = RangeReader(self.bootstrap, self.topic, settings=self.kafka_settings)
        try:
            yield from self._batches(client, reader)
        finally:
            reader.close()
            client.close()

    def _batches(self, c: DataClient, reader: RangeReader) -> Iterator[_Batch]:
        keeper = self._keeper(c)
        held: list[ev.ShardRef] = []  # leased, not being read yet
        reading: dict[int, _Reading] = {}  # partition -> its range being read
        recent: deque[int] = deque(maxlen=4 * MAX_AHEAD)
        batch = _Filling(c.client)
        ticked = time.monotonic()
        while True:
            keeper.top_up(len(held), [*(r.key for r in held), *recent])
            if not held and not reading:  # about to wait: what is batched goes out now
                if batch.samples:
                    yield batch.take()
                    ticked = time.monotonic()
                elif time.monotonic() - ticked >= self.idle_s:
                    yield _IDLE_TICK  # nothing to read now
                    ticked = time.monotonic()
            # (a request for a stream waits in the master until shards are cut: in
            # slices, so that idle ticks go on)
            waiting = not held and not reading and bool(keeper.outstanding)
            held.extend(keeper.poll(wait=waiting, timeout=self.idle_s))
            # every partition's first held range is read at once, as Kafka delivers them
            for ref in list(held):
                shard = keeper.ranges[ref.key]
                if shard.partition not in reading:
                    reading[shard.partition] = _Reading(ref, shard)
                    held.remove(ref)
                    recent.append(ref.key)
            if not reading:
                if not keeper.outstanding:
                    time.sleep(0.05)  # nothing cut yet: the keeper asks again shortly
                continue
            # the ranges held next are fetched while these are read (each partition's
            # first range is the one being read: its next follows without a seek)
            reader.prepare(
                [
                    *((r.shard, r.ref.offset) for r in reading.values()),
                    *((keeper.ranges[r.key], r.offset) for r in held),
                ]
            )
            got = reader.take({p: (r.shard, r.ref.offset) for p, r in reading.items()})
            for p, msgs, ended in got:
                r = reading[p]
                for _full in self._read(c, r, msgs, ended, batch):
                    yield batch.take()
                    ticked = time.monotonic()
                if ended:
                    del reading[p]
                    keeper.measure(r.shard.records - r.ref.offset)

    def _read(
        self, c: DataClient, r: _Reading, msgs: list[Message], ended: bool, batch: _Filling
    ) -> Iterator[None]:
        """Decode the messages `msgs` of range `r` into `batch`, yielding whenever it is
        full. The newest decoded record waits for the next: whichever turns out to be
        the range's last carries the news that the shard is complete (`ended`).

        Messages are decoded a batch's room at a time, so no more decoded samples are
        alive than a batch holds (kept longer, they would reach the old generation of
        the garbage collector, and bring on its full collections)."""
        key, shard, size = r.ref.key, r.shard, self.batch_size
        i, n = 0, len(msgs)
        while i < n:
            # a batch's room, and one more while none is held back (it will be)
            room = max(1, size - len(batch.samples)) + (r.newest is None)
            piece = msgs[i : i + room]
            i += len(piece)
            samples, kept = self._decode(piece, shard.start, r.dead)
            if not samples:
                continue
            if r.newest is not None:
                samples.insert(0, r.newest[0])
                kept.insert(0, r.newest[1])
            r.newest = (samples.pop(), kept.pop())
            if samples:
                batch.add(key, shard, samples, kept, False)
                if len(batch.samples) >= size:
                    yield
        if not ended:
            return
        if r.dead.count:
            self._dead_letters(c, r.shard.partition, r.dead)
        if r.newest is None:
            # nothing of this range was decoded (all skipped), so none reached the loop:
            # it is trained as far as it can be
            c.done(r.ref)
            return
        sample, msg = r.newest
        r.newest = None
        batch.add(key, shard, [sample], [msg], True)
        if len(batch.samples) >= size:
            yield

    def _decode(
        self, msgs: list[Message], start: int, dead: _DeadLetters
    ) -> tuple[list[Any], list[Message]]:
        """The samples `decode` reads from the messages `msgs` of a range starting at
        offset `start`, and those messages; the others go to `dead`. Each `Record` is
        made as it is decoded and dropped after (see `RangeReader.take`)."""
        decode = self.decode
        try:
            return [decode(Record(m, start)) for m in msgs], msgs  # (the reader's own list)
        except Exception:  # noqa: BLE001 - the user's decoder: anything may go wrong
            pass  # one record or more is bad: find which, one by one
        samples, kept = [], []
        for m in msgs:
            try:
                samples.append(decode(Record(m, start)))
            except Exception as exc:  # noqa: BLE001 - the user's decoder
                dead.add(cast(int, m.offset()), exc)
                continue
            kept.append(m)
        return samples, kept

    def _dead_letters(self, c: DataClient, partition: int, dead: _DeadLetters) -> None:
        """Report a shard's undecodable records: one log line and one event."""
        self.undecodable += dead.count
        log.warning(
            "undecodable records skipped (dead letters); training goes on",
            dataset=self.name,
            topic=self.topic,
            partition=partition,
            offsets=list(dead.offsets),
            count=dead.count,
            error=dead.error,
            undecodable=self.undecodable,
        )
        c.send(
            ev.RecordsUndecodable(
                **c.envelope(),
                dataset=self.name,
                client=c.client,
                partition=partition,
                offsets=tuple(dead.offsets),
                count=dead.count,
                error=dead.error,
            )
        )

    # ------------------------------------------------------------------ main process

    def loader(
        self, *, batch_size: int = 1, lockstep: bool | None = None, **kwargs: Any
    ) -> StreamLoader:
        """A DataLoader over the stream (any `num_workers`) that tracks deliveries;
        batches of at most `batch_size` records (smaller when the stream pauses)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.batch_size = batch_size
        return StreamLoader(self, lockstep=lockstep, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The data position of the lineage (collective under a process group): the
        topic's offset vector. Rank 0 reports it, with the step the next
        `FlashCheckpointer.save` puts it in, so that the Kafka bridge can mirror the
        offsets to the consumer group once that step commits (docs/streaming.md)."""
        state = super().state_dict()
        newest = self.newest_ts
        if _distributed():
            t = torch.tensor([newest], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            newest = float(t.item())
        if self.where.rank == 0:
            position = msgspec.convert(state["position"], ev.DataPosition)
            if self._unsaved is None:
                on_save(self._saved)
            self._unsaved = (position, newest)
        # the produce time travels with the position: a process restored from it that
        # saves before training anything new still knows how fresh its lineage is
        state["newest_ts"] = max(0.0, newest)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.newest_ts = float(state.get("newest_ts", 0.0))  # (absent in older saves)

    def _saved(self, step: int) -> None:
        """A checkpoint of `step` was saved: report the position it holds, if any."""
        if self._unsaved is None:
            return
        # (kept: a later save of the same position reports it again, with the produce
        # time of the newest record it covers; forgetting that time made the job's
        # freshness unknown after a save that trained nothing new)
        position, newest = self._unsaved
        client = self._ack_client()
        client.send(
            ev.StreamCheckpointed(
                **client.envelope(),
                dataset=self.name,
                client=client.client,
                step=step,
                round=self.where.round,
                done=position.done,
                partial=tuple((r.key, r.offset) for r in position.partial),
                newest_ts=max(0.0, newest),
            )
        )

    def _delivered(self, progress: list[tuple[int, int, bool]], owner: str) -> None:
        for key, nxt, last in progress:
            if key in self.done:
                continue
            self._advance(key, nxt - 1)
            if last:
                self._finish(key, owner)


def _as_is(batch: Any) -> Any:
    return batch  # the loader workers collate (`_Filling.take`)


def _setting(given: str | None, env: str, what: str) -> str:
    value = given or os.environ.get(env, "")
    if not value:
        raise ConfigError(
            f"StreamIterable needs the Kafka {what}: pass {what}=..., or run under "
            f"`rove run --kafka-bootstrap ... --kafka-topic ...`, which sets {env}"
        )
    return value


class StreamLoader:
    """Batches of a `StreamIterable`, tags stripped and deliveries recorded;
    `last_delivered` is the (partition, offset) of each of the last batch's records.

    With `lockstep`, an idle tick comes out as `None` (a zero-size step)."""

    def __init__(self, data: StreamIterable, *, lockstep: bool | None, **kwargs: Any) -> None:
        self.data = data
        # Batches as workers fill them, not worker by worker: a worker waiting for the
        # stream must not hold back the batches the others have ready.
        kwargs.setdefault("in_order", False)
        # the workers batch (`StreamIterable.__iter__`): no automatic batching here
        self.loader = DataLoader(data, batch_size=None, collate_fn=_as_is, **kwargs)
        self.lockstep = _distributed() if lockstep is None else lockstep
        self._where: list[tuple[int, list[int]]] = []

    @property
    def last_delivered(self) -> list[tuple[int, int]]:
        return [(p, offset) for p, offsets in self._where for offset in offsets]

    def __iter__(self) -> Iterator[Any]:
        self.data.iterated = True

        def delivered(item: _Batch) -> Any:
            self.data._delivered(item.progress, item.owner)
            self.data.newest_ts = max(self.data.newest_ts, item.newest_ts)
            self._where = item.where
            return item.samples

        raw: Iterator[_Batch] = iter(self.loader)
        items = raw if self.lockstep else (b for b in raw if b.samples is not None)
        # (without lockstep the ticks are dropped: the loop simply waits for data)
        try:
            yield from deliveries(items, delivered, lockstep=self.lockstep)
        finally:
            # A stream has no end: its workers are inside an endless read when the
            # training loop stops, so they are stopped here, not left to a garbage
            # collection that a kept traceback can postpone for ever.
            shutdown = getattr(raw, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
