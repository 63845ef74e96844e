"""The worker-side storage I/O engine: storage transfers off the model's path.

The worker submits requests and polls for their completions, as it does with the
TransferManager; nothing here blocks the caller:

- `submit_load`   STORAGE -> HOST: read blocks into host-cache blocks;
- `submit_store`  HOST -> STORAGE: write host-cache blocks to storage;
- `submit_lookup` which keys storage holds (answered in a later poll);
- `submit_all`    a step's requests together, all or nothing;
- `poll`          completions so far, each with one result per key.

Requests are cut into chunks that I/O threads run in priority order: lookups, then
loads, then stores (a load serves a waiting request; a store only saves work for a
later one). Stores are bounded by `max_store_bytes` queued or running: a store that
does not fit completes at once as failed, so a full storage tier never makes the
host tier wait.

Every request has a deadline. A request whose deadline passes is completed at the
next `poll` with TIMEOUT for every key not done: chunks not started never run, and
a chunk stuck in the backend (a hung disk, a dead master) keeps its host blocks in
`busy_host_blocks()` until it returns and the backend no longer writes them (a
Mooncake get it left behind at the deadline: `wait_host_quiet`), so no host block
is reused while a storage read or write still touches it. A new request touching
such a block fails those keys; one touching a block of a request still outstanding
is refused (ValueError), as the scheduler never issues one.

The engine thus owns its requests' deadlines, and each I/O thread tells the
backend so (`StorageBackend.run_calls_on_this_thread`): a backend that would
otherwise hand each call to a thread of its own to return by the deadline
(Mooncake) runs it on the I/O thread instead, to its end. A stuck call then
holds its I/O thread as well as its host blocks: with every I/O thread stuck,
queued chunks wait (their requests still complete TIMEOUT at their deadline)
until one returns.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from fastkv.storage.base import (
    BlockSegments,
    KeyResult,
    KeyStatus,
    StorageBackend,
    StorageKey,
    check_deadline,
    check_keys,
    check_segments,
    deadline_after,
)

log = logging.getLogger(__name__)


class RequestKind(Enum):
    LOOKUP = 0
    LOAD = 1
    STORE = 2


@dataclass(frozen=True, slots=True)
class StorageCompletion:
    """The outcome of one request.

    Attributes:
        request_id: as submitted.
        kind: LOOKUP, LOAD or STORE.
        results: one per key (loads and stores); OK means read and verified, or stored.
        hits: one per key (lookups): whether storage holds it (a hint; a load verifies).
    """

    request_id: int
    kind: RequestKind
    results: tuple[KeyResult, ...] = ()
    hits: tuple[bool, ...] = ()

    @property
    def success(self) -> bool:
        """Every key OK (a lookup always succeeds; its answer is `hits`)."""
        return all(r.ok for r in self.results)

    def ok_prefix(self) -> int:
        """How many leading keys are OK (a load's usable prefix)."""
        for i, r in enumerate(self.results):
            if not r.ok:
                return i
        return len(self.results)


@dataclass(frozen=True, slots=True)
class Submission:
    """One request for `StorageIOEngine.submit_all` (loads and stores name the host
    blocks they read or write; lookups name none)."""

    kind: RequestKind
    request_id: int
    keys: Sequence[StorageKey]
    deadline: float
    blocks: Sequence[BlockSegments] = ()
    host_ids: Sequence[int] = ()


class _Request:
    __slots__ = (
        "blocks",
        "chunks_left",
        "deadline",
        "hits",
        "host_ids",
        "keys",
        "kind",
        "nbytes",
        "reported",
        "request_id",
        "results",
    )

    def __init__(
        self,
        request_id: int,
        kind: RequestKind,
        keys: list[StorageKey],
        blocks: list[BlockSegments],
        host_ids: list[int],
        deadline: float,
        nbytes: int,
    ) -> None:
        self.request_id = request_id
        self.kind = kind
        self.keys = keys
        self.blocks = blocks
        self.host_ids = host_ids
        self.deadline = deadline
        self.nbytes = nbytes
        self.results: list[KeyResult | None] = [None] * len(keys)
        self.hits: list[bool] = [False] * len(keys)
        self.chunks_left = 0
        self.reported = False


_TIMED_OUT = KeyResult(KeyStatus.TIMEOUT, "request deadline passed")


class StorageIOEngine:
    """Runs storage loads, stores and lookups on I/O threads.

    Args:
        backend: the storage backend (thread-safe).
        num_threads: I/O threads (two kept O_DIRECT writes 1.36 -> 1.82 GB/s here).
        max_store_bytes: bytes of stores queued or running; more are refused.
        chunk_bytes: target bytes per backend call (at least one block).

    Raises:
        ValueError: a bad argument.
    """

    def __init__(
        self,
        backend: StorageBackend,
        num_threads: int = 2,
        max_store_bytes: int = 1 << 30,
        chunk_bytes: int = 32 << 20,
    ) -> None:
        if not isinstance(backend, StorageBackend):
            raise ValueError(f"backend: must be a StorageBackend, got {type(backend).__name__}")
        for name, value, low, high in (
            ("num_threads", num_threads, 1, 64),
            ("max_store_bytes", max_store_bytes, 0, 1 << 50),
            ("chunk_bytes", chunk_bytes, 1, 1 << 40),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not low <= value <= high
            ):
                raise ValueError(f"{name}: must be an int in [{low}, {high}], got {value!r}")
        self.backend = backend
        self.max_store_bytes = max_store_bytes
        self._block_bytes = backend.layout.payload_bytes
        self._chunk_blocks = max(1, chunk_bytes // self._block_bytes)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._queues: dict[RequestKind, deque[tuple[_Request, int, int]]] = {
            kind: deque() for kind in RequestKind
        }
        self._outstanding: dict[int, _Request] = {}
        self._completed: list[StorageCompletion] = []
        self._store_bytes = 0
        # host block -> running chunks touching it (as reader or writer)
        self._host_readers: dict[int, int] = {}
        self._host_writers: dict[int, int] = {}
        self._closing = False
        self.rejected_stores = 0
        self.timed_out_requests = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"fastkv-storage-io-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    # -- submission -------------------------------------------------------------

    def submit_load(
        self,
        request_id: int,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        host_ids: Sequence[int],
        deadline: float,
    ) -> None:
        """Read `keys[i]` into `blocks[i]` (host block `host_ids[i]`), for every i.

        Raises:
            ValueError: bad input, a request id in use, a host block listed twice or
                touched by an outstanding request; nothing is queued.
        """
        self.submit_all(
            [Submission(RequestKind.LOAD, request_id, keys, deadline, blocks, host_ids)]
        )

    def submit_store(
        self,
        request_id: int,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        host_ids: Sequence[int],
        deadline: float,
    ) -> None:
        """Write host block `host_ids[i]` (`blocks[i]`) to storage as `keys[i]`.

        When the store queue is full the request completes at once with every key
        FAILED ("store queue full"); poll reports it.

        Raises:
            ValueError: as for `submit_load`.
        """
        self.submit_all(
            [Submission(RequestKind.STORE, request_id, keys, deadline, blocks, host_ids)]
        )

    def submit_lookup(
        self, request_id: int, keys: Sequence[StorageKey], deadline: float
    ) -> None:
        """Ask which keys storage holds; a later poll answers with `hits`.

        Raises:
            ValueError: bad input or a request id in use.
        """
        self.submit_all([Submission(RequestKind.LOOKUP, request_id, keys, deadline)])

    def submit_all(self, submissions: Sequence[Submission]) -> None:
        """Submit several requests at once, all or nothing: each is checked as its
        own `submit_*` call would check it, and against the others (distinct request
        ids; a load's host blocks touched by no other request of the batch).

        Raises:
            ValueError: a submission's kind is not a RequestKind, or as for
                `submit_load`; nothing is queued.
            RuntimeError: the engine is closed.
        """
        reqs = [self._prepare(sub) for sub in submissions]
        with self._lock:
            if self._closing:
                raise RuntimeError("the storage I/O engine is closed")
            fenced = []
            for i, req in enumerate(reqs):
                earlier = reqs[:i]
                if req.request_id in self._outstanding or any(
                    r.request_id == req.request_id for r in earlier
                ):
                    raise ValueError(f"request_id: {req.request_id} is still outstanding")
                fenced.append(self._check_hazards(req, [*self._outstanding.values(), *earlier]))
            for req, fenced_keys in zip(reqs, fenced, strict=True):
                self._admit(req, fenced_keys)

    # -- results ------------------------------------------------------------------

    def poll(self) -> list[StorageCompletion]:
        """Completions since the last call, including requests whose deadline has
        passed (TIMEOUT for the keys not done). Never blocks on I/O."""
        with self._lock:
            self._expire(time.monotonic())
            out, self._completed = self._completed, []
            return out

    def wait_all(self, timeout: float) -> list[StorageCompletion]:
        """Wait until every request has completed (by finishing or by its deadline),
        at most `timeout` seconds; returns the completions not yet polled.

        Raises:
            ValueError: timeout is negative or not finite.
        """
        end = deadline_after(timeout)
        with self._lock:
            while True:
                now = time.monotonic()
                self._expire(now)
                if not self._outstanding or now >= end:
                    break
                next_deadline = min(r.deadline for r in self._outstanding.values())
                self._done.wait(max(0.0, min(end, next_deadline) - now) + 1e-3)
            out, self._completed = self._completed, []
            return out

    def busy_host_blocks(self) -> frozenset[int]:
        """Host blocks a storage read or write is touching right now, including
        those of requests already reported (timed out): not to be reused yet."""
        with self._lock:
            return frozenset(self._host_readers) | frozenset(self._host_writers)

    @property
    def num_outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    def close(self, timeout: float = 10.0) -> list[StorageCompletion]:
        """Stop: queued chunks fail ("engine closed"), running ones finish (threads
        joined for at most `timeout` s). Returns the completions not yet polled."""
        end = deadline_after(timeout)
        with self._lock:
            self._closing = True
            for queue in self._queues.values():
                while queue:
                    req, start, stop = queue.popleft()
                    closed = KeyResult(KeyStatus.FAILED, "storage I/O engine closed")
                    self._finish_chunk(req, start, stop, [closed] * (stop - start), None)
            self._work.notify_all()
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return self.wait_all(max(0.0, end - time.monotonic()))

    # -- internals ----------------------------------------------------------------

    def _prepare(self, sub: Submission) -> _Request:
        """A validated request (no engine state read or changed)."""
        kind, request_id, deadline = sub.kind, sub.request_id, sub.deadline
        if not isinstance(kind, RequestKind):
            raise ValueError(
                f"kind: must be a RequestKind ({', '.join(k.name for k in RequestKind)}), "
                f"got {kind!r}"
            )
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise ValueError(f"request_id: must be an int, got {request_id!r}")
        keys = list(sub.keys)
        check_keys(keys)
        check_deadline(deadline)
        if not math.isfinite(deadline):  # it also schedules the request's expiry
            raise ValueError(f"deadline: must be finite, got {deadline!r}")
        ids: list[int] = []
        segs: list[BlockSegments] = []
        if kind != RequestKind.LOOKUP:
            segs = list(sub.blocks)
            ids = list(sub.host_ids)
            if len(segs) != len(keys) or len(ids) != len(keys):
                raise ValueError(
                    f"blocks, host_ids: {len(segs)} and {len(ids)} entries, {len(keys)} keys"
                )
            check_segments(segs, self.backend.layout)
            for i, h in enumerate(ids):
                if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                    raise ValueError(f"host_ids[{i}]: must be an int >= 0, got {h!r}")
            if len(set(ids)) != len(ids):
                raise ValueError("host_ids: a host block is listed more than once")
        return _Request(
            request_id, kind, keys, segs, ids, float(deadline), len(keys) * self._block_bytes
        )

    def _admit(self, req: _Request, fenced: list[int]) -> None:
        """Queue a checked request (under the lock)."""
        kind, keys = req.kind, req.keys
        if kind == RequestKind.STORE and self._store_bytes + req.nbytes > self.max_store_bytes:
            self.rejected_stores += 1
            full = KeyResult(KeyStatus.FAILED, "store queue full")
            self._completed.append(StorageCompletion(req.request_id, kind, (full,) * len(keys)))
            return
        self._outstanding[req.request_id] = req
        if kind == RequestKind.STORE:
            self._store_bytes += req.nbytes
        for i in fenced:
            req.results[i] = KeyResult(
                KeyStatus.FAILED, "host block still used by a timed-out storage transfer"
            )
        todo = [i for i in range(len(keys)) if req.results[i] is None]
        chunks = _runs(todo, self._chunk_blocks)
        req.chunks_left = len(chunks)
        for start, stop in chunks:
            self._queues[kind].append((req, start, stop))
        if not chunks:
            self._complete(req)
        self._work.notify(len(chunks))

    def _check_hazards(self, req: _Request, others: Sequence[_Request]) -> list[int]:
        """Indexes of keys whose host block a reported (timed-out) request still
        touches. Raises ValueError if one of `others` (requests outstanding or
        admitted with it) touches one in a conflicting way."""
        if req.kind == RequestKind.LOOKUP:
            return []
        writes = req.kind == RequestKind.LOAD
        mine = set(req.host_ids)
        for other in others:
            if other.kind == RequestKind.LOOKUP:
                continue
            if not writes and other.kind == RequestKind.STORE:
                continue  # two readers
            clash = mine.intersection(other.host_ids)
            if clash:
                raise ValueError(
                    f"host_ids: block {min(clash)} is used by outstanding storage request "
                    f"{other.request_id}"
                )
        fenced = []
        for i, h in enumerate(req.host_ids):
            if h in self._host_writers or (writes and h in self._host_readers):
                fenced.append(i)
        return fenced

    def _next_chunk(self) -> tuple[_Request, int, int] | None:
        for kind in (RequestKind.LOOKUP, RequestKind.LOAD, RequestKind.STORE):
            if self._queues[kind]:
                return self._queues[kind].popleft()
        return None

    def _run(self) -> None:
        self.backend.run_calls_on_this_thread()  # this engine owns the deadlines
        while True:
            with self._lock:
                item = self._next_chunk()
                while item is None and not self._closing:
                    self._work.wait()
                    item = self._next_chunk()
                if item is None:
                    return
                req, start, stop = item
                if req.reported or time.monotonic() >= req.deadline:
                    self._finish_chunk(req, start, stop, [_TIMED_OUT] * (stop - start), None)
                    continue
                self._touch(req, start, stop, +1)
            results: list[KeyResult] = []
            hits: list[bool] | None = None
            try:
                results, hits = self._io(req, start, stop)
            except Exception as e:  # a backend bug must not kill the thread or lose keys
                log.exception("storage %s request %d failed", req.kind.name, req.request_id)
                results = [KeyResult(KeyStatus.FAILED, f"{type(e).__name__}: {e}")] * (
                    stop - start
                )
            with self._lock:
                self._touch(req, start, stop, -1)
                self._finish_chunk(req, start, stop, results, hits)

    def _io(
        self, req: _Request, start: int, stop: int
    ) -> tuple[list[KeyResult], list[bool] | None]:
        keys = req.keys[start:stop]
        if req.kind == RequestKind.LOOKUP:
            return [], self.backend.exists(keys, req.deadline)
        blocks = req.blocks[start:stop]
        if req.kind == RequestKind.STORE:
            return self.backend.put_from(keys, blocks, req.deadline), None
        results = self.backend.get_into(keys, blocks, req.deadline)
        # A get the backend left behind at its deadline may still write these host
        # blocks: they stay busy (and this thread with them) until it ends. Nothing
        # to wait for (the usual case) costs one empty-list check.
        if self.backend.busy_host_ranges():
            self.backend.wait_host_quiet(blocks, None)
        return results, None

    def _touch(self, req: _Request, start: int, stop: int, delta: int) -> None:
        if req.kind == RequestKind.LOOKUP:
            return
        table = self._host_writers if req.kind == RequestKind.LOAD else self._host_readers
        for h in req.host_ids[start:stop]:
            n = table.get(h, 0) + delta
            if n:
                table[h] = n
            else:
                del table[h]

    def _finish_chunk(
        self,
        req: _Request,
        start: int,
        stop: int,
        results: list[KeyResult],
        hits: list[bool] | None,
    ) -> None:
        req.chunks_left -= 1
        if req.reported:
            return  # reported at its deadline; its host blocks are released above
        if hits is not None:
            req.hits[start:stop] = hits
            results = [KeyResult(KeyStatus.OK)] * (stop - start)
        req.results[start:stop] = results
        if req.chunks_left == 0:
            self._complete(req)

    def _complete(self, req: _Request) -> None:
        req.reported = True
        del self._outstanding[req.request_id]
        if req.kind == RequestKind.STORE:
            self._store_bytes -= req.nbytes
        results = tuple(r if r is not None else _TIMED_OUT for r in req.results)
        if req.kind == RequestKind.LOOKUP:
            done = StorageCompletion(req.request_id, req.kind, hits=tuple(req.hits))
        else:
            done = StorageCompletion(req.request_id, req.kind, results)
        self._completed.append(done)
        self._done.notify_all()

    def _expire(self, now: float) -> None:
        """Complete every outstanding request past its deadline."""
        for req in [r for r in self._outstanding.values() if r.deadline <= now]:
            self.timed_out_requests += 1
            if req.kind == RequestKind.LOOKUP:
                req.hits = [False] * len(req.keys)
            self._complete(req)


def _runs(indexes: list[int], size: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges over `indexes`, each at most `size` long."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(indexes):
        j = i
        while j + 1 < len(indexes) and indexes[j + 1] == indexes[j] + 1 and j + 1 - i < size:
            j += 1
        runs.append((indexes[i], indexes[j] + 1))
        i = j + 1
    return runs


__all__ = ["RequestKind", "StorageCompletion", "StorageIOEngine", "Submission"]
