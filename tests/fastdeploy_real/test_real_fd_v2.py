"""fastkv under ResourceManagerV2's threading model, on the snapshot's
ResourceManagerV1 (V2 is newer than the snapshot; its code is not runnable here).

What V2 does (upstream `engine/sched/resource_manager_v2.py`, read for this): it
subclasses V1, replaces V1's lock with a lock that does nothing, and lets other
threads only queue messages (add a request, finish requests, reschedule a
preempted one, recycle an abort, ...); `schedule()`, on the one scheduler thread,
drains the queue, running each message's V1 handler, then runs V1's `schedule()`.
So every cache-manager call runs on the scheduler thread, never under V1's lock.

The stand-in below does exactly that over the real V1 and the real token
processor (on a thread of its own, as in the engine), with clients adding
requests from three threads while the scheduler thread runs and a cache manager
built on yet another thread. fastkv assumes no caller thread and no lock of
FastDeploy's: its own lock guards every public method (docs/fastdeploy.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from real_fd_config import BLOCK_SIZE
from real_fd_engine import Engine
from real_fd_model import prompt

BS = BLOCK_SIZE
QUEUED = (
    "add_request",
    "finish_requests",
    "reschedule_preempt_task",
    "recycle_abort_task",
    "add_abort_req_ids",
    "cache_output_tokens",
    "pre_recycle_resource",
)
"""V1 methods other threads call; V2 turns them into messages."""


class _NoOpLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def acquire(self, *a: Any, **k: Any) -> bool:
        return True

    def release(self) -> None:
        return None


def v2_class() -> type:
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

    class ResourceManagerV2StandIn(ResourceManagerV1):
        def become_v2(self) -> None:
            """V2's construction on top of V1's (a V1 built, then turned V2:
            V1's constructor names its own class)."""
            self.lock = _NoOpLock()
            self._messages: deque[tuple[str, tuple, dict]] = deque()
            self._msg_lock = threading.Lock()
            self.scheduler_thread: int | None = None
            self.queued: dict[str, int] = {}  # messages queued by other threads

        def schedule(self) -> Any:
            self.scheduler_thread = threading.get_ident()
            with self._msg_lock:
                messages, self._messages = list(self._messages), deque()
            for name, args, kwargs in messages:
                getattr(ResourceManagerV1, name)(self, *args, **kwargs)
            return super().schedule()

    def queued(name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> None:
            if threading.get_ident() == self.scheduler_thread:
                return getattr(ResourceManagerV1, name)(self, *args, **kwargs)
            self.queued[name] = self.queued.get(name, 0) + 1
            if name == "add_request":  # V2 preprocesses on the caller's thread
                self.apply_async_preprocess(args[0])
                with self._msg_lock:
                    self._messages.append(("_v2_add", args, kwargs))
                return None
            with self._msg_lock:
                self._messages.append((name, args, kwargs))
            return None

        return method

    for name in QUEUED:
        if hasattr(ResourceManagerV1, name):
            setattr(ResourceManagerV2StandIn, name, queued(name))

    def _v2_add(self: Any, request: Any) -> None:  # V2's handler: no second preprocess
        self.waiting.append(request)
        self.requests[request.request_id] = request

    ResourceManagerV1._v2_add = _v2_add  # looked up on the base by schedule()
    return ResourceManagerV2StandIn


class ThreadSpy:
    """Records the thread of every call into the cache manager."""

    def __init__(self, cache_manager: Any) -> None:
        self.threads: dict[str, set[int]] = {}
        for name in dir(type(cache_manager)):
            attr = getattr(cache_manager, name, None)
            if name.startswith("_") or not callable(attr):
                continue
            setattr(cache_manager, name, self._wrap(name, attr))

    def _wrap(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.threads.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)

        return call


@pytest.fixture
def v2() -> Iterator[type]:
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

    yield v2_class()
    del ResourceManagerV1._v2_add


def test_v2_threading_model(v2: type, make_engine: Any) -> None:
    built: dict[str, Engine] = {}
    builder = threading.Thread(  # the cache manager is built off the scheduler thread
        target=lambda: built.setdefault(
            "e", make_engine(num_gpu_blocks=16, num_cpu_blocks=12, write_policy="write_back")
        )
    )
    builder.start()
    builder.join()
    engine = built["e"]
    rm = engine.rm
    rm.__class__ = v2
    rm.become_v2()
    assert isinstance(rm, v2) and isinstance(rm.lock, _NoOpLock)
    spy = ThreadSpy(engine.cache_manager)
    token_thread = ThreadPoolExecutor(1, thread_name_prefix="token-processor")
    emit = engine._emit
    engine._emit = lambda tokens: token_thread.submit(emit, tokens).result()
    total = 12

    def client(c: int) -> None:
        for i in range(total // 3):
            shared = prompt(70 + i % 2, 2 * BS)  # shared prefixes: hits, evictions
            engine.add_request(f"c{c}-{i}", [*shared, *prompt(100 + 10 * c + i, BS + 1)], 5)
            time.sleep(0.01)

    errors: list[BaseException] = []

    def scheduler() -> None:
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                outs = engine.results.by_id
                if (
                    len(engine.expected) == total
                    and len(outs) == total
                    and all(o.finished for o in outs.values())
                    and not rm.requests
                ):
                    return
                engine.step()
                time.sleep(0.002)
            raise AssertionError("not finished in 120 s")
        except BaseException as e:
            errors.append(e)

    sched = threading.Thread(target=scheduler, name="scheduler")
    clients = [threading.Thread(target=client, args=(c,)) for c in range(3)]
    sched.start()
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    sched.join()
    token_thread.shutdown()
    assert not errors, errors
    assert rm.queued.get("add_request") == total and rm.queued.get("finish_requests"), rm.queued
    # V2's promise, checked on the stand-in: every cache-manager call on the
    # scheduler thread (the token processor's and the clients' calls were queued)
    other = {n: t for n, t in spy.threads.items() if t != {rm.scheduler_thread}}
    assert not other, other
    assert "request_finish" in spy.threads and "allocate_gpu_blocks" in spy.threads
    stats = engine.cache_manager.get_stats()
    assert stats["device_hit_blocks"] + stats["host_hit_blocks"] > 0, stats
    engine.check_clean()
