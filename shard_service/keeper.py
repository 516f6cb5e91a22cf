"""Keeping shards leased ahead of use, for one data client (no torch: any framework).

Every data source of rove (the torch `ShardSampler` and `ShardedIterable`, the
`tf.data` source, the Kafka stream source) asks the master for shards the same
way, through a `LeaseKeeper`:

* **ahead**: it holds at least `prefetch` untaken shards, and enough to train
  `cover_s` seconds at the rate it has been consuming (capped at `MAX_AHEAD`),
  so a master failover (lease TTL, then catch-up) does not stall training;
* **renewal**: leases it still holds are renewed by every request, and by an
  empty request every `lease_s / 3` when it asks for nothing;
* **restore**: its first request carries the data position of the restored
  checkpoint, and the master rolls the dataset back to it;
* **answers**: a lease adds shards; a refusal raises `DataError` with the
  master's reason; no answer for `answer_timeout_s` logs a warning and goes on
  waiting (a master may be failing over). A stream's request is parked by the
  master until shards are cut, so its caller waits in slices (`poll(timeout=)`)
  and does other things (idle ticks) between them.

The caller says what it holds and consumes (`top_up`, `measure`) and takes the
new leases (`poll`); the keeper decides when to ask. The clock is injected.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable

from rove.control.catalogue import events as ev
from rove.control.errors import PermanentError
from rove.control.process import logs
from rove.shard_service.client import DataClient, first_request
from rove.shard_service.options import DEFAULT_PACE, Pace

log = logs.get("rove.data")

#: The most shards a client holds ahead of use, however fast it trains.
MAX_AHEAD = 64
#: Seconds of consumption the first rate estimate takes (then one a second).
FIRST_RATE_S = 0.25
#: A stream's request answered with nothing: seconds before asking again. The master
#: parks a stream's request until shards are cut (or `PARK_S`), so this only keeps an
#: empty answer from turning into a request loop.
STREAM_IDLE_S = 0.1


class DataError(PermanentError):
    """The master refused this client's registration or request (the reason says why)."""


class LeaseKeeper:
    def __init__(
        self,
        client: DataClient,
        spec: ev.DatasetSpec,
        pace: Pace = DEFAULT_PACE,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.spec = spec
        self.prefetch = pace.prefetch
        self.cover_s = pace.cover_s
        self.answer_timeout_s = pace.answer_timeout_s
        self.clock = clock
        self.restore: ev.DataPosition | None = None
        self.requested = False
        self.outstanding: set[int] = set()
        self.exhausted = False
        self.rate = 0.0  # samples/s consumed, smoothed
        self._rate_mark: tuple[float, int] | None = None
        self._consumed = 0
        self._last_request = 0.0
        #: stream datasets: the offset range of each shard leased (`ShardLeased.ranges`)
        self.ranges: dict[int, ev.StreamShard] = {}
        self._range_records = 0  # their records, summed as they come (`shard_size`)
        self._idle_until = 0.0
        #: since when an answer is awaited without a warning (a slice of `poll` each)
        self._awaited_since: float | None = None

    @property
    def name(self) -> str:
        return self.client.dataset

    # ------------------------------------------------------------------ asking

    def shard_size(self) -> int:
        """Samples per shard: the spec's, or for a stream the mean of the ranges seen."""
        if not self.spec.stream:
            return self.spec.shard_size
        if not self.ranges:
            return 1
        return max(1, self._range_records // len(self.ranges))

    def ahead(self) -> int:
        """How many untaken shards to hold: `prefetch`, or `cover_s` seconds' worth."""
        covering = -(-int(self.rate * self.cover_s) // self.shard_size())
        return max(self.prefetch, min(covering, MAX_AHEAD))

    def top_up(self, untaken_shards: int, held: Iterable[int], short_samples: int = 0) -> None:
        """Ask for the shards missing to be `ahead()` (and `short_samples` more samples),
        or renew the `held` leases when it is time; at most one request in flight."""
        missing = self.ahead() - untaken_shards
        if short_samples > 0:
            missing = max(missing, -(-short_samples // self.shard_size()))
        idle = self.clock() < self._idle_until
        if missing > 0 and not self.outstanding and not self.exhausted and not idle:
            self._request(missing, held)
        elif self.clock() - self._last_request > self.spec.lease_s / 3:
            self._request(0, held)

    def _request(self, count: int, held: Iterable[int]) -> None:
        first = {} if self.requested else first_request(self.name, self.restore)
        self.requested = True
        request = self.client.request(count, tuple(held), **first)
        if count:
            self.outstanding.add(request)
        self._last_request = self.clock()

    # ------------------------------------------------------------------ answers

    def poll(self, wait: bool, timeout: float | None = None) -> list[ev.ShardRef]:
        """New leases: every answer that has come, after waiting for one if `wait` (at
        most `timeout` seconds, else `answer_timeout_s`).

        Raises:
            DataError: the master refused a request (its reason is the message).
        """
        answers = self.client.answers
        got: list[ev.ShardRef] = []
        try:
            if not wait:
                first = answers.get_nowait()
            else:
                if self._awaited_since is None:
                    self._awaited_since = self.clock()
                slice_s = self.answer_timeout_s if timeout is None else timeout
                first = answers.get(timeout=max(0.0, slice_s))
        except queue.Empty:
            if wait:
                self._no_answer(whole=timeout is None)
            return got
        self._awaited_since = None
        got.extend(self._take(first))
        while True:
            try:
                got.extend(self._take(answers.get_nowait()))
            except queue.Empty:
                return got

    def _no_answer(self, whole: bool) -> None:
        """A wait ended without an answer: warn if it was a `whole` one, or once waits
        in slices have added up to `answer_timeout_s`."""
        now = self.clock()
        waited = 0.0 if self._awaited_since is None else now - self._awaited_since
        if whole or waited >= self.answer_timeout_s:
            log.warning(
                "no answer from the master yet; still waiting (is a rove master running?)",
                dataset=self.name,
                job=self.client.job,
                waited_s=round(self.answer_timeout_s if whole else waited, 1),
            )
            self._awaited_since = now

    def _take(self, answer: ev.ShardLeased | ev.DataRejected) -> tuple[ev.ShardRef, ...]:
        if isinstance(answer, ev.DataRejected):
            raise DataError(f"dataset {self.name}: {answer.reason}")
        self.outstanding.discard(answer.request)
        self.exhausted = answer.exhausted and not answer.shards
        if self.spec.stream:
            for ref, shard in zip(answer.shards, answer.ranges, strict=True):
                known = self.ranges.get(ref.key)
                self._range_records += shard.records - (known.records if known else 0)
                self.ranges[ref.key] = shard
            if not answer.shards:
                self._idle_until = self.clock() + STREAM_IDLE_S  # nothing cut yet
        return answer.shards

    @property
    def waiting(self) -> bool:
        """Worth waiting for an answer: a request is out, or the data is not exhausted."""
        return bool(self.outstanding) or not self.exhausted

    # ------------------------------------------------------------------ consumption

    def measure(self, samples: int) -> None:
        """`samples` more were consumed: one rate estimate a second, smoothed (the first
        after `FIRST_RATE_S`, so that a fast consumer holds enough ahead early)."""
        now = self.clock()
        self._consumed += samples
        if self._rate_mark is None:
            self._rate_mark = (now, self._consumed)
            return
        since, count = self._rate_mark
        if now - since >= (1.0 if self.rate else FIRST_RATE_S):
            rate = (self._consumed - count) / (now - since)
            self.rate = rate if not self.rate else 0.5 * self.rate + 0.5 * rate
            self._rate_mark = (now, self._consumed)
