"""`rove operator`: runs every `RoveJob` of a namespace, and writes back its status.

For each RoveJob (level-triggered: a watch wakes it, a resync every `resync_s`
catches what a broken watch missed):

* a finalizer (`rove.dev/stop-job`) is put on it first; `kubectl delete` then
  asks the job to stop on the bus (`stop_requested`, as `rove stop` does) before
  the finalizer is taken off and Kubernetes deletes the children it owns;
* its children (`rove.control.operator.spec.children`) are created; one that is
  already there (`409`) is left as it is, so a restarted operator creates nothing
  twice. The spec is immutable (the CRD says so): a new job is a new RoveJob;
* it follows the job's events (a `Replica` from the start of the stream, with a
  goodput ledger) and patches `.status` when what it shows changes, and turns the
  notable events into Kubernetes Events named after their stream sequence;
* once the job has ended its masters, scaler and bridge are scaled to 0 (they exit
  when the job has ended, and a Deployment would restart them forever).

The bus is the source of truth: the status is rebuilt from the stream after a
restart, and `.status.eventsThrough` says which events were already told.

The official client is synchronous: each call runs in a worker thread. A server
error or an unreachable API is logged and retried at the next resync; a `403`
says which permission of deploy/base/operator/rbac.yaml is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import structlog
import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from rove.control.bus import records
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.domain import goodput as gp
from rove.control.errors import ConfigError, RoveError
from rove.control.master import snapshots
from rove.control.master.replica import Replica
from rove.control.operator import spec as rj
from rove.control.operator import status as st
from rove.control.process import aio

log = structlog.get_logger("rove.operator")

T = TypeVar("T")

#: (connect, read) seconds of one call to the API server: a stuck call is retried at
#: the next resync, and the operator never waits on one longer than this to exit
REQUEST_TIMEOUT_S = (10, 30)

#: the errors of a call that retrying can fix
_TRANSIENT = (urllib3.exceptions.HTTPError, OSError)


class Follower:
    """One job's events, folded: its state, goodput ledger, newest step, and the
    Kubernetes Events not yet told.

    It starts from the masters' newest snapshot when that carries the goodput ledger
    and covers no event it has not told yet (`told`: the RoveJob's `eventsThrough`),
    else from the start of the stream: an operator restarted on a long job reads its
    tail, not its whole history."""

    def __init__(self, bus: Bus, job: str, told: int) -> None:
        self.job = job
        self.ledger = gp.Ledger()
        self.seen = False
        self.step: int | None = None
        #: whether `step` is known from the events read (not when a snapshot skipped them
        #: and the tail has said nothing of steps yet: the status keeps its own then)
        self.step_known = True
        self.told = told
        self.pending: list[st.KubeEvent] = []
        self.replica = Replica(
            bus,
            job,
            use_snapshot=self._may_start_from,
            heartbeats=False,
            on_applied=self._on,
            on_snapshot=self._started_from,
        )

    def _may_start_from(self, loaded: snapshots.Loaded) -> bool:
        return loaded.goodput is not None and loaded.state.applied_seq <= self.told

    def _started_from(self, loaded: snapshots.Loaded) -> None:
        assert loaded.goodput is not None  # (`_may_start_from`)
        self.ledger = loaded.goodput
        self.seen = True
        self.step, self.step_known = None, False

    def _on(self, rec: records.Recorded) -> None:
        self.seen = True
        self.ledger.add(rec.event)
        if isinstance(rec.event, ev.TrainingProgress):
            self.step = max(self.step or 0, rec.event.step)
            self.step_known = True
        elif isinstance(rec.event, ev.RunStarted):
            self.step, self.step_known = None, True
        if rec.seq > self.told:
            told = st.notable(rec.event, rec.seq)
            if told is not None:
                self.pending.append(told)

    def report(self, now: float) -> gp.Report | None:
        return gp.report(self.ledger, now) if self.ledger.first_ts is not None else None


class Operator:
    def __init__(
        self,
        bus: Bus,
        api: k8s.ApiClient,
        namespace: str,
        site: rj.Site,
        *,
        resync_s: float = 10.0,
        status_every_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.namespace = namespace
        self.site = site
        self.resync_s = resync_s
        self.status_every_s = status_every_s
        self.clock = clock
        self.custom = k8s.CustomObjectsApi(api)
        self.apps = k8s.AppsV1Api(api)
        self.batch = k8s.BatchV1Api(api)
        self.core = k8s.CoreV1Api(api)
        self.followers: dict[str, Follower] = {}
        #: job -> the RoveJob as last listed
        self.objects: dict[str, dict[str, Any]] = {}
        self._last_status: dict[str, dict[str, Any]] = {}
        #: RoveJob uid -> the children known to exist (created, or found there)
        self._made: dict[str, set[str]] = {}
        #: RoveJob uids refused for a name an ended job used
        self._refused: set[str] = set()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._failed: str | None = None
        self._tasks = aio.Supervisor("the operator", log, self._fail)
        self._watch_stop = threading.Event()
        #: the watch's response while it is read (`_stop_watch` shuts its socket down)
        self._watch_resp: urllib3.BaseHTTPResponse | None = None
        self._watch_lock = threading.Lock()
        #: how long one watch request lasts before the next is opened
        self._watch_s = max(1.0, min(300.0, 3 * resync_s))

    def _fail(self, why: str) -> None:
        self._failed = why
        self._stopping.set()

    def stop(self) -> None:
        self._tasks.stop()
        self._stopping.set()
        self._wake.set()

    # ------------------------------------------------------------------ the loops

    async def run(self) -> None:
        """Reconcile until `stop()`; raises `RoveError` if one of its loops died."""
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=self._watch, args=(loop,), name="rove-operator-watch", daemon=True
        ).start()
        loops = [
            self._tasks.keep(asyncio.create_task(self._reconcile_loop(), name="reconcile")),
            self._tasks.keep(asyncio.create_task(self._status_loop(), name="status")),
        ]
        log.info("operator is running", namespace=self.namespace, nats=self.site.nats_url)
        try:
            await self._stopping.wait()
        finally:
            self._tasks.stop()
            self._stop_watch()
            # a reconcile may be waiting (for the bus, for the API server): it ends here,
            # not after the replicas it uses are stopped
            await aio.cancel_and_wait(loops)
            for f in list(self.followers.values()):
                await f.replica.stop()
        if self._failed is not None:
            raise RoveError(self._failed)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """A watch on the namespace's RoveJobs (a thread: the client blocks); every
        change wakes the reconcile loop. A broken watch is opened again after a pause
        (the resync covers what it missed); anything else ends the operator, loudly."""
        try:
            self._watching(loop)
        except BaseException as exc:
            log.error("the watch of RoveJobs died", exc_info=exc)
            why = f"internal error: the operator's watch thread died ({type(exc).__name__}: {exc})"
            loop.call_soon_threadsafe(self._fail, why)

    def _watching(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._watch_stop.is_set():
            try:
                # Any line of it is a change: it only wakes the reconcile, which reads
                # every RoveJob afresh (a 410 Gone is a line too, and ends the watch).
                # Unloaded, the client's answer is urllib3's response, read as it comes.
                answer = self.custom.list_namespaced_custom_object(
                    rj.GROUP,
                    rj.VERSION,
                    self.namespace,
                    rj.PLURAL,
                    watch=True,
                    _preload_content=False,
                    timeout_seconds=int(self._watch_s),
                    # (the client's own bound too: a server that never ends a quiet
                    # watch has it opened again)
                    _request_timeout=(10, self._watch_s + 5),
                )
                resp = cast(urllib3.BaseHTTPResponse, answer)
                with self._watch_lock:
                    self._watch_resp = resp
                try:
                    if not self._watch_stop.is_set():  # (a stop between: no shutdown came)
                        for _ in resp.stream(amt=None, decode_content=False):
                            loop.call_soon_threadsafe(self._wake.set)
                finally:
                    with self._watch_lock:
                        self._watch_resp = None
                    resp.close()  # (read or not to its end: the connection is not reused)
                    resp.release_conn()
            except urllib3.exceptions.ReadTimeoutError:
                continue  # a quiet watch: open the next one
            except (ApiException, ValueError, *_TRANSIENT) as exc:  # resync covers it
                if self._watch_stop.is_set():
                    return  # (the stop's shutdown of its socket)
                log.warning("the watch of RoveJobs broke; opening it again", error=str(exc))
                self._watch_stop.wait(min(self.resync_s, 5.0))

    def _stop_watch(self) -> None:
        """End the watch thread now: a read it blocks in ends with its socket's shutdown
        (else it would hold a connection to the API server until the watch's timeout)."""
        self._watch_stop.set()
        with self._watch_lock:
            resp = self._watch_resp
            if resp is not None:
                with contextlib.suppress(ValueError, RuntimeError, OSError):  # (ended meanwhile)
                    resp.shutdown()

    async def _reconcile_loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                await self.reconcile_all()
            except (ApiException, *_TRANSIENT) as exc:
                log.warning("cannot list RoveJobs; retrying", error=_said(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.resync_s)

    async def _status_loop(self) -> None:
        while not self._stopping.is_set():
            for job in list(self.followers):
                try:
                    await self.write_status(job)
                except (ApiException, *_TRANSIENT) as exc:
                    log.warning("cannot write the status", job=job, error=_said(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.status_every_s)

    # ------------------------------------------------------------------ reconcile

    async def reconcile_all(self) -> None:
        listed = await self._call(
            self.custom.list_namespaced_custom_object,
            rj.GROUP,
            rj.VERSION,
            self.namespace,
            rj.PLURAL,
        )
        items: list[dict[str, Any]] = listed.get("items", [])  # type: ignore[attr-defined]
        present = {o["metadata"]["name"]: o for o in items}
        self.objects = present
        for name, obj in present.items():
            try:
                await self.reconcile(obj)
            except (ApiException, RoveError, *_TRANSIENT) as exc:  # (RoveError: the bus)
                log.warning("cannot reconcile; retrying", job=name, error=_said(exc))
        for name in set(self.followers) - set(present):
            await self._forget(name)

    async def reconcile(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        job = meta["name"]
        finalizers = list(meta.get("finalizers") or [])
        if meta.get("deletionTimestamp"):
            if rj.FINALIZER in finalizers:
                await self._stop_job(job, obj)
                await self._patch(job, {"metadata": {"finalizers": _without(finalizers)}})
            await self._forget(job)
            self._made.pop(meta["uid"], None)
            self._refused.discard(meta["uid"])
            return
        if rj.FINALIZER not in finalizers:
            await self._patch(job, {"metadata": {"finalizers": [*finalizers, rj.FINALIZER]}})
        if meta["uid"] in self._refused:
            return
        try:
            spec = rj.parse(obj)
        except ConfigError as exc:
            await self._invalid(obj, str(exc))
            return
        follower = await self._follow(job, obj)
        reused = st.reused(job, meta.get("creationTimestamp"), follower.ledger.ended_ts)
        if reused is not None:
            self._refused.add(meta["uid"])
            await self._forget(job)
            await self._invalid(obj, reused)
            return
        made = self._made.setdefault(meta["uid"], set())
        for child in rj.children(obj, spec, self.site):
            if child["metadata"]["name"] not in made:
                await self._create(child)
                made.add(child["metadata"]["name"])
        state = follower.replica.state
        if state.phase.terminal:
            await self._wind_down(job, spec)
        elif st.bounds(state) not in (None, spec.bounds):
            await self._resize(job, obj, spec)

    async def _follow(self, job: str, obj: dict[str, Any]) -> Follower:
        follower = self.followers.get(job)
        if follower is None:
            told = int((obj.get("status") or {}).get("eventsThrough", 0) or 0)
            follower = Follower(self.bus, job, told)
            await follower.replica.start()
            self.followers[job] = follower
            log.info("following the job's events", job=job, told_through=told)
        return follower

    async def _forget(self, job: str) -> None:
        follower = self.followers.pop(job, None)
        self._last_status.pop(job, None)
        if follower is not None:
            await follower.replica.stop()

    async def _stop_job(self, job: str, obj: dict[str, Any]) -> None:
        """`kubectl delete rovejob`: the job stops on the bus (as `rove stop` does)."""
        follower = self.followers.get(job)
        if follower is None and await self.bus.job_exists(job):
            follower = await self._follow(job, obj)
        if follower is None or follower.replica.state.phase.terminal:
            return
        who = f"operator:{self.namespace}"
        await self.bus.publish(
            ev.StopRequested(
                **ev.envelope(job, who, self.clock(), "stop", f"rovejob-{obj['metadata']['uid']}"),
                reason=f"RoveJob {self.namespace}/{job} deleted",
            )
        )
        log.info("RoveJob deleted: asked the job to stop", job=job)

    async def _resize(self, job: str, obj: dict[str, Any], spec: rj.JobSpec) -> None:
        """`spec.nnodes` changed: ask the job for the new bounds (once per generation; the
        next resync sees the job's bounds equal the spec's)."""
        lo, hi = spec.bounds
        meta = obj["metadata"]
        await self.bus.publish(
            ev.ScaleRequested(
                **ev.envelope(
                    job,
                    f"operator:{self.namespace}",
                    self.clock(),
                    "scale",
                    meta["uid"],
                    meta.get("generation", 0),
                    lo,
                    hi,
                ),
                min_nodes=lo,
                max_nodes=hi,
                reason=f"RoveJob {self.namespace}/{job}: nnodes {spec.nnodes}",
            )
        )
        log.info("RoveJob resized: asked the job for new bounds", job=job, nnodes=spec.nnodes)

    async def _wind_down(self, job: str, spec: rj.JobSpec) -> None:
        names = rj.names(job)
        for key in ("masters", "scaler", *(("bridge",) if spec.kafka else ())):
            with contextlib.suppress(ApiException):
                await self._call(
                    self.apps.patch_namespaced_deployment,
                    names[key],
                    self.namespace,
                    {"spec": {"replicas": 0}},
                )

    async def _invalid(self, obj: dict[str, Any], why: str) -> None:
        if (obj.get("status") or {}).get("phase") == st.INVALID:
            return  # said already
        job = obj["metadata"]["name"]
        generation = int(obj["metadata"].get("generation", 0) or 0)
        await self._event(
            obj, st.KubeEvent(seq=0, type="Warning", reason="InvalidSpec", message=why)
        )
        await self._patch(job, {"status": st.invalid(generation, why, self.clock())}, status=True)
        log.warning("RoveJob refused", job=job, reason=why)

    # ------------------------------------------------------------------ status

    async def write_status(self, job: str) -> None:
        follower, obj = self.followers.get(job), self.objects.get(job)
        if follower is None or obj is None:
            return
        for told in list(follower.pending):
            await self._event(obj, told)
            follower.told = max(follower.told, told.seq)
            follower.pending.remove(told)
        now = self.clock()
        previous = self._last_status.get(job) or obj.get("status") or {}
        if not follower.seen and await self._submit_failed(job, obj, previous):
            return
        status = st.status(
            follower.replica.state,
            follower.report(now),
            seen=follower.seen,
            generation=int(obj["metadata"].get("generation", 0) or 0),
            events_through=follower.told,
            now=now,
            step=follower.step if follower.step_known else previous.get("step"),
            previous=previous,
        )
        if _same(status, previous):
            return
        await self._patch(job, {"status": st.patch(status, previous)}, status=True)
        self._last_status[job] = status
        if status.get("phase") != previous.get("phase"):
            log.info("job phase", job=job, phase=status["phase"], round=status["round"])

    async def _submit_failed(self, job: str, obj: dict[str, Any], previous: dict[str, Any]) -> bool:
        """A job with no event yet whose submit Job failed (`rove submit` refused it: a
        name a running job has, a bad script argument; or it could not reach NATS, six
        times): its RoveJob fails, saying so and where the reason is, instead of staying
        "Submitting" for ever, and its masters, scaler and bridge go to 0 replicas (they
        waited for a job that never came). True when it did (or had)."""
        if previous.get("phase") == st.FAILED:
            return True
        name = rj.names(job)["submit"]
        try:
            got = await self._call(self.batch.read_namespaced_job, name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False  # (not made yet, or deleted by hand: nothing to say)
            raise
        failed = next(
            (c for c in (got.status and got.status.conditions) or [] if c.type == "Failed"),
            None,
        )
        if failed is None or failed.status != "True":
            return False
        why = st.submit_failure(self.namespace, name, failed.reason, failed.message)
        generation = int(obj["metadata"].get("generation", 0) or 0)
        await self._event(
            obj, st.KubeEvent(seq=0, type="Warning", reason="SubmitFailed", message=why)
        )
        status = st.submit_failed(generation, why, self.clock())
        await self._patch(job, {"status": st.patch(status, previous)}, status=True)
        self._last_status[job] = status
        log.warning("the job's submit failed", job=job, reason=why)
        with contextlib.suppress(ConfigError):  # (its masters wait for no job: to 0)
            await self._wind_down(job, rj.parse(obj))
        return True

    async def _event(self, obj: dict[str, Any], told: st.KubeEvent) -> None:
        meta = obj["metadata"]
        at = st.iso(self.clock())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{told.seq}"
                if told.seq
                else f"{meta['name']}.{meta['uid']}",
                "namespace": self.namespace,
            },
            "involvedObject": {
                "apiVersion": rj.API_VERSION,
                "kind": rj.KIND,
                "name": meta["name"],
                "namespace": self.namespace,
                "uid": meta["uid"],
            },
            "type": told.type,
            "reason": told.reason,
            "message": told.message[:1024],
            "source": {"component": "rove-operator"},
            "reportingComponent": "rove.dev/operator",
            "firstTimestamp": at,
            "lastTimestamp": at,
            "count": 1,
        }
        try:
            await self._call(self.core.create_namespaced_event, self.namespace, body)
        except ApiException as exc:
            if exc.status != 409:  # told already (an operator restarted in between)
                raise

    # ------------------------------------------------------------------ calls

    async def _create(self, child: dict[str, Any]) -> None:
        kind = child["kind"]
        create: Callable[..., Any]
        if kind == "ConfigMap":
            create = self.core.create_namespaced_config_map
        elif kind == "Job":
            create = self.batch.create_namespaced_job
        else:
            create = self.apps.create_namespaced_deployment
        try:
            await self._call(create, self.namespace, child)
        except ApiException as exc:
            if exc.status == 409:
                return  # there already: created by this operator before a restart
            raise
        log.info("created", kind=child["kind"], name=child["metadata"]["name"])

    async def _patch(self, job: str, body: dict[str, Any], *, status: bool = False) -> None:
        """Patch RoveJob `job` (merge patch), or its status subresource."""
        await self._call(
            self.custom.patch_namespaced_custom_object_status
            if status
            else self.custom.patch_namespaced_custom_object,
            rj.GROUP,
            rj.VERSION,
            self.namespace,
            rj.PLURAL,
            job,
            body,
        )

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 403:
                log.error(
                    "the API server refused the operator: a permission of "
                    "deploy/base/operator/rbac.yaml is missing",
                    error=_said(exc),
                )
            raise


def _without(finalizers: list[str]) -> list[str]:
    return [f for f in finalizers if f != rj.FINALIZER]


def _same(new: dict[str, Any], old: dict[str, Any]) -> bool:
    """Whether two statuses show the same thing (transition times aside)."""

    def key(s: dict[str, Any]) -> dict[str, Any]:
        conds = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"}
            for c in s.get("conditions", [])
        ]
        return {**s, "conditions": conds}

    return key(new) == key(old)


def _said(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}: {str(exc.body)[:300]}"
    return f"{type(exc).__name__}: {exc}"
