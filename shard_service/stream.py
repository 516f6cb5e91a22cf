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

A record `decode` cannot read is counted (`undecodable`) and logged with its
partition and offset (the dead letter), and training goes on. Each worker reads
one record ahead, so the last record a shard delivers carries the news that the
shard is complete, whatever records of its range were skipped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import structlog
from torch.utils.data import DataLoader, get_worker_info
from torch.utils.data._utils.collate import default_collate

from rove.control import events as ev
from rove.shard_service.client import DataClient, dataset_spec, placement
from rove.shard_service.iterable import LeasedIterable
from rove.shard_service.kafka import RangeReader, Record
from rove.shard_service.keeper import MAX_AHEAD
from rove.shard_service.sampler import _distributed, deliveries

log = structlog.get_logger("rove.data")

# sample, shard key, position in the shard, (partition, offset), last of its shard, worker
Tagged = tuple[Any, int, int, tuple[int, int], bool, str]
#: `_samples` says it is about to wait for the stream: a partly filled batch goes out.
_FLUSH = None


def _value(record: Record) -> Any:
    return record.value


class StreamIterable(LeasedIterable):
    def __init__(
        self,
        name: str,
        *,
        bootstrap: str,
        topic: str,
        decode: Callable[[Record], Any] = _value,
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
        self.bootstrap = bootstrap
        self.topic = topic
        self.decode = decode
        self.batch_size = 1
        # worker side
        self.undecodable = 0

    # ------------------------------------------------------------------ worker side

    def __iter__(self) -> Iterator[list[Tagged]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        client = DataClient.at(self.where, self.name, f"{self.base_client}-w{worker}")
        reader = RangeReader(self.bootstrap, self.topic)
        try:
            batch: list[Tagged] = []
            for item in self._samples(client, reader):
                if item is not _FLUSH:
                    batch.append(item)
                if batch and (item is _FLUSH or len(batch) >= self.batch_size):
                    yield batch
                    batch = []
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
            pending = (sample, ref.key, record.position, where, False, c.client)
        if pending is not None:
            yield (*pending[:4], True, pending[5])
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

    def _delivered(
        self, keys: list[int], positions: list[int], lasts: list[bool], owners: list[str]
    ) -> None:
        for key, pos, last, owner in zip(keys, positions, lasts, owners, strict=True):
            if key in self.done:
                continue
            self._advance(key, pos)
            if last:
                self._finish(key, owner)


def _collate(
    items: list[Tagged],
) -> tuple[Any, list[int], list[int], list[tuple[int, int]], list[bool], list[str]]:
    batch = default_collate([t[0] for t in items])  # type: ignore[no-untyped-call]
    return (
        batch,
        [t[1] for t in items],
        [t[2] for t in items],
        [t[3] for t in items],
        [t[4] for t in items],
        [t[5] for t in items],
    )


class StreamLoader:
    """Batches of a `StreamIterable`, tags stripped and deliveries recorded;
    `last_delivered` holds the (partition, offset) of the last batch's records."""

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

        def delivered(
            item: tuple[Any, list[int], list[int], list[Any], list[bool], list[str]],
        ) -> Any:
            batch, keys, positions, where, lasts, owners = item
            self.data._delivered(keys, positions, lasts, owners)
            self.last_delivered = list(where)
            return batch

        items = iter(self.loader)
        try:
            yield from deliveries(items, delivered, lockstep=self.lockstep)
        finally:
            # A stream has no end: its workers are inside an endless read when the
            # training loop stops, so they are stopped here, not left to a garbage
            # collection that a kept traceback can postpone for ever.
            shutdown = getattr(items, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
