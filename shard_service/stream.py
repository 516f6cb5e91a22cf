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
`seek`, no consumer group) and yields `decode(record)`. As with
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

A record `decode` cannot read is counted (`undecodable`) and logged with its
partition and offset (the dead letter), and training goes on. Each worker reads
one record ahead, so the last record a shard delivers carries the news that the
shard is complete, whatever records of its range were skipped.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgspec
import structlog
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, get_worker_info
from torch.utils.data._utils.collate import default_collate

from rove.checkpoint.api import on_save
from rove.control import events as ev
from rove.control.errors import ConfigError
from rove.shard_service.client import DataClient, dataset_spec, placement
from rove.shard_service.iterable import LeasedIterable
from rove.shard_service.kafka import RangeReader, Record
from rove.shard_service.keeper import MAX_AHEAD
from rove.shard_service.sampler import _distributed, deliveries

log = structlog.get_logger("rove.data")

# sample, shard key, position in the shard, (partition, offset), last of its shard, worker,
# produce time (seconds since the epoch; 0 when the broker gave none)
Tagged = tuple[Any, int, int, tuple[int, int], bool, str, float]
#: `_samples` says it is about to wait for the stream: a partly filled batch goes out.
_FLUSH = None


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
        prefetch: int = 2,
        cover_s: float = 10.0,
        lease_s: float = 600.0,
        answer_timeout_s: float = 60.0,
        nats: str | None = None,
        job: str | None = None,
        node: str | None = None,
        rank: int | None = None,
        round: int | None = None,
    ) -> None:
        super().__init__(
            name,
            dataset_spec(name, size=0, shard_size=0, stream=True, lease_s=lease_s),
            placement("stream", nats=nats, job=job, node=node, rank=rank, round=round),
            prefetch=prefetch,
            cover_s=cover_s,
            answer_timeout_s=answer_timeout_s,
        )
        self.bootstrap = _setting(bootstrap, "ROVE_KAFKA_BOOTSTRAP", "bootstrap")
        self.topic = _setting(topic, "ROVE_KAFKA_TOPIC", "topic")
        self.decode = decode
        self.idle_s = idle_s
        self.batch_size = 1
        # worker side
        self.undecodable = 0
        # main process: the produce time of the newest record that reached the loop
        self.newest_ts = 0.0
        self._unsaved: tuple[ev.DataPosition, float] | None = None

    # ------------------------------------------------------------------ worker side

    def __iter__(self) -> Iterator[list[Tagged]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        client = DataClient.at(self.where, self.name, f"{self.base_client}-w{worker}")
        reader = RangeReader(self.bootstrap, self.topic)
        try:
            batch: list[Tagged] = []
            ticked = time.monotonic()
            for item in self._samples(client, reader):
                if item is not _FLUSH:
                    batch.append(item)
                if batch and (item is _FLUSH or len(batch) >= self.batch_size):
                    yield batch
                    batch, ticked = [], time.monotonic()
                elif item is _FLUSH and time.monotonic() - ticked >= self.idle_s:
                    yield []  # an idle tick: nothing to read now
                    ticked = time.monotonic()
        finally:
            reader.close()
            client.close()

    def _samples(self, c: DataClient, reader: RangeReader) -> Iterator[Tagged | None]:
        keeper = self._keeper(c)
        held: list[ev.ShardRef] = []
        recent: deque[int] = deque(maxlen=4 * MAX_AHEAD)
        while True:
            keeper.top_up(len(held), [*(r.key for r in held), *recent])
            if not held:
                yield _FLUSH  # about to wait: what is batched goes out now
            held.extend(keeper.poll(wait=not held and bool(keeper.outstanding)))
            if not held:
                if not keeper.outstanding:
                    time.sleep(0.05)  # nothing cut yet: the keeper asks again shortly
                continue
            ref = held.pop(0)
            recent.append(ref.key)
            shard = keeper.ranges[ref.key]
            yield from self._shard(c, ref, shard, reader)
            keeper.measure(shard.records - ref.offset)

    def _shard(
        self, c: DataClient, ref: ev.ShardRef, shard: ev.StreamShard, reader: RangeReader
    ) -> Iterator[Tagged]:
        pending: Tagged | None = None
        for record in reader.read(shard, ref.offset):
            try:
                sample = self.decode(record)
            except Exception as exc:  # noqa: BLE001 - the user's decoder: anything may go wrong
                self.undecodable += 1
                log.warning(
                    "undecodable record skipped (dead letter)",
                    dataset=self.name,
                    topic=self.topic,
                    partition=shard.partition,
                    offset=record.offset,
                    error=repr(exc)[:300],
                    undecodable=self.undecodable,
                )
                continue
            if pending is not None:
                yield pending
            where = (shard.partition, record.offset)
            pending = (sample, ref.key, record.position, where, False, c.client, record.ts)
        if pending is not None:
            yield (*pending[:4], True, *pending[5:])
        else:
            # nothing of this range reached the loop (all skipped): it is trained as
            # far as it can be
            c.done(ref)

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
        return state

    def _saved(self, step: int) -> None:
        """A checkpoint of `step` was saved: report the position it holds, if any."""
        if self._unsaved is None:
            return
        position, newest = self._unsaved
        self._unsaved = (position, -1.0)  # reported; a later save of it reports again
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

    def _delivered(
        self, keys: list[int], positions: list[int], lasts: list[bool], owners: list[str]
    ) -> None:
        for key, pos, last, owner in zip(keys, positions, lasts, owners, strict=True):
            if key in self.done:
                continue
            self._advance(key, pos)
            if last:
                self._finish(key, owner)


class _Batch(NamedTuple):
    """A batch as it crosses from a loader worker: the samples and their tags."""

    samples: Any  # None for an idle tick
    keys: list[int]
    positions: list[int]
    where: list[tuple[int, int]]
    lasts: list[bool]
    owners: list[str]
    newest_ts: float


def _collate(items: list[Tagged]) -> _Batch:
    if not items:
        return _Batch(None, [], [], [], [], [], 0.0)
    return _Batch(
        default_collate([t[0] for t in items]),  # type: ignore[no-untyped-call]
        [t[1] for t in items],
        [t[2] for t in items],
        [t[3] for t in items],
        [t[4] for t in items],
        [t[5] for t in items],
        max(t[6] for t in items),
    )


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
    `last_delivered` holds the (partition, offset) of the last batch's records.

    With `lockstep`, an idle tick comes out as `None` (a zero-size step)."""

    def __init__(self, data: StreamIterable, *, lockstep: bool | None, **kwargs: Any) -> None:
        self.data = data
        # Batches as workers fill them, not worker by worker: a worker waiting for the
        # stream must not hold back the batches the others have ready.
        kwargs.setdefault("in_order", False)
        # the workers batch (`StreamIterable.__iter__`): no automatic batching here
        self.loader = DataLoader(data, batch_size=None, collate_fn=_collate, **kwargs)
        self.lockstep = _distributed() if lockstep is None else lockstep
        self.last_delivered: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[Any]:
        self.data.iterated = True

        def delivered(item: _Batch) -> Any:
            self.data._delivered(item.keys, item.positions, item.lasts, item.owners)
            self.data.newest_ts = max(self.data.newest_ts, item.newest_ts)
            self.last_delivered = list(item.where)
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
