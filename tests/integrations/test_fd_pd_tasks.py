"""fd_pd_tasks: PD tasks as entries of FastDeploy's merged metadata (the step's batch
on P, the drained tasks on D), and the worker's refusals (the flows run against
FastDeploy's real code in tests/fastdeploy_real/test_real_fd_pd.py)."""

from __future__ import annotations

import pickle
import threading

import pytest
from fd_standins import AttentionBackend, FDCacheConfig, FDConfig, ModelConfig, ParallelConfig

from fastkv.integrations import fd_pd_tasks
from fastkv.integrations.fastdeploy import FastDeployCacheController
from fastkv.integrations.fd_prefetch import FDStorageMetadata
from fastkv.integrations.fd_transfers import FDCacheLevel, FDCacheSwapMetadata
from fastkv.pd.inproc import InProcFabric

SEND = ("chunk", (0, 7, 3, False))
FORGET = ("forget", (1, 9))


def batch_meta(entries: list[str], copies: int = 2) -> FDCacheSwapMetadata:
    """A merged device-to-host metadata: `copies` copy entries, then `entries`."""
    return FDCacheSwapMetadata(
        src_block_ids=list(range(copies)) + [-1] * len(entries),
        dst_block_ids=list(range(10, 10 + copies)) + [-1] * len(entries),
        src_type=FDCacheLevel.DEVICE,
        dst_type=FDCacheLevel.HOST,
        hash_values=[f"{i}:ab" for i in range(copies)] + entries,
    )


def encode(tasks: dict[int, list[tuple[str, object]]], start: int = 0) -> list[str]:
    """Entries numbered from `start` on every rank (the scheduler's counts)."""
    return fd_pd_tasks.encode(tasks, dict.fromkeys(tasks, start))


def tasks_of(meta: object, rank: int, num_ranks: int = 2) -> list[tuple[str, object]]:
    return [task for _, task in fd_pd_tasks.split(meta, rank, num_ranks)[1]]


def test_each_rank_takes_its_own_tasks_in_order_and_the_copies_stay() -> None:
    entries = encode({0: [SEND, ("chunk", (0, 7, 5, True))], 1: [FORGET]})
    meta = pickle.loads(pickle.dumps(batch_meta(entries)))  # as the queue carries it
    rest, mine = fd_pd_tasks.split(meta, 0, 2)
    assert mine == [(0, SEND), (1, ("chunk", (0, 7, 5, True)))]  # numbered per rank
    assert rest.hash_values == ["0:ab", "1:ab"] and rest.src_block_ids == [0, 1]
    assert rest.dst_block_ids == [10, 11]
    assert fd_pd_tasks.split(meta, 1, 2)[1] == [(0, FORGET)]
    assert meta.hash_values[2:] == entries  # not changed
    only = batch_meta(entries, copies=0)
    assert fd_pd_tasks.split(only, 1, 2) == (None, [(0, FORGET)])
    plain = batch_meta([])
    assert fd_pd_tasks.split(plain, 0, 2) == (plain, [])


def test_the_scheduler_numbers_each_rank_on_from_its_last_count() -> None:
    counts: dict[int, int] = {}
    first = fd_pd_tasks.encode({0: [SEND], 1: [FORGET]}, counts)
    second = fd_pd_tasks.encode({0: [FORGET, FORGET]}, counts)
    assert counts == {0: 3, 1: 1}
    assert [e.split(":")[0] for e in first + second] == ["X0.0", "X1.0", "X0.1", "X0.2"]


def test_a_drained_task_carries_pd_entries_only() -> None:
    entries = encode({0: [FORGET]})
    meta = FDStorageMetadata(hash_values=entries, block_ids=[-1], direction="pd")
    assert tasks_of(meta, 0) == [FORGET]
    mixed = FDStorageMetadata(hash_values=[*entries, "Q1:ab"], block_ids=[-1, -1])
    assert fd_pd_tasks.split(mixed, 0, 1) == (mixed, [(0, FORGET)])  # the worker refuses it


class Boom:
    """A payload that would run code as it is unpickled."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("forged",))


def forged(task: object) -> str:
    import base64

    return "X0.0:" + base64.urlsafe_b64encode(pickle.dumps(task, protocol=5)).decode()


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("X0", "not a fastkv PD task"),
        ("Xa.0:AAAA", "not a fastkv PD task"),
        ("X0:AAAA", "not a fastkv PD task"),  # no seq
        ("X0.0:!!!", "does not decode"),
        (encode({0: [("format_disk", (1, 2))]})[0], "not one of"),
        (encode({0: [SEND]})[0][:-4], "does not decode"),
        (forged(("forget", Boom())), "builtins.print is not allowed"),
        (forged(("expect", FDStorageMetadata())), "FDStorageMetadata is not allowed"),
    ],
)
def test_a_malformed_or_forged_entry_is_refused_naming_it(
    entry: str, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=match):
        fd_pd_tasks.split(batch_meta([entry]), 0, 1)
    assert "forged" not in capsys.readouterr().out  # nothing it names ran


def test_an_entry_for_a_rank_the_instance_lacks_is_refused_on_every_rank() -> None:
    meta = batch_meta(encode({0: [SEND], 2: [SEND]}))
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"rank 2, not in \[0, 2\)"):
            fd_pd_tasks.split(meta, rank, 2)


def test_a_pd_entry_with_block_ids_is_refused() -> None:
    meta = batch_meta(encode({0: [SEND]}))
    meta.src_block_ids[-1] = 3
    with pytest.raises(ValueError, match=r"block ids \(3, -1\)"):
        fd_pd_tasks.split(meta, 0, 1)


def test_a_payload_must_continue_the_routes_count_exactly() -> None:
    numbered = [(4, SEND), (5, FORGET)]
    assert fd_pd_tasks.in_order(numbered, 4, "batch") == 6
    assert fd_pd_tasks.in_order([], 4, "batch") == 4
    with pytest.raises(ValueError, match="expected task 6; it ran already"):
        fd_pd_tasks.in_order(numbered, 6, "batch")
    with pytest.raises(ValueError, match="expected task 2; it comes after 2 task"):
        fd_pd_tasks.in_order(numbered, 2, "drain")
    with pytest.raises(ValueError, match="expected task 5"):
        fd_pd_tasks.in_order([(4, SEND), (4, SEND)], 4, "batch")


def fd_config(tp: int = 1) -> FDConfig:
    return FDConfig(
        FDCacheConfig(block_size=4, total_block_num=8),
        ModelConfig(),
        ParallelConfig(tensor_parallel_size=tp),
    )


def test_a_rank_without_pd_refuses_a_batch_with_pd_tasks_and_launches_nothing(
    channel: str,
) -> None:
    worker = FastDeployCacheController(fd_config(), 0, 0, channel_name=channel)
    try:
        with pytest.raises(ValueError, match="without PD"):
            worker.submit_swap_tasks(batch_meta(encode({0: [SEND]})), None)
        drained = FDStorageMetadata(
            hash_values=encode({0: [FORGET]}), block_ids=[-1], direction="pd"
        )
        with pytest.raises(ValueError, match="without PD"):
            worker.prefetch_from_storage(drained)
        assert worker.get_stats()["transfers_without_result"] == 0
    finally:
        worker.stop()


@pytest.fixture
def d_rank(channel: str):  # type: ignore[no-untyped-def]
    """Rank 1 of 2 of a decode instance with PD attached, its run_tasks recorded."""
    worker = FastDeployCacheController(fd_config(tp=2), 1, 1, channel_name=channel)
    worker.initialize_kv_cache(attn_backend=AttentionBackend(2, 8, 4), num_gpu_blocks=8)
    pd = worker.attach_pd(InProcFabric().endpoint("d1"), role="decode", report_to=list)
    ran: list[list[tuple[str, object]]] = []
    run_tasks = pd.run_tasks
    pd.run_tasks = lambda tasks: (ran.append(list(tasks)), run_tasks(tasks))[1]
    yield worker, ran
    worker.stop()


def drained(entries: list[str]) -> FDStorageMetadata:
    return FDStorageMetadata(hash_values=entries, block_ids=[-1] * len(entries), direction="pd")


def test_each_drained_payload_runs_once_a_replay_or_a_gap_is_refused_whole(
    d_rank: tuple[FastDeployCacheController, list[list[tuple[str, object]]]],
) -> None:
    worker, ran = d_rank
    first = drained(encode({0: [FORGET], 1: [FORGET, ("forget", (1, 10))]}))
    worker.prefetch_from_storage(pickle.loads(pickle.dumps(first)))
    assert ran == [[FORGET, ("forget", (1, 10))]]  # its own, in order
    with pytest.raises(ValueError, match="drain route: expected task 2; it ran already"):
        worker.prefetch_from_storage(first)  # delivered twice
    lost_one = drained(encode({1: [FORGET]}, start=3))
    with pytest.raises(ValueError, match="expected task 2; it comes after 1 task"):
        worker.prefetch_from_storage(lost_one)
    assert len(ran) == 1  # neither ran any of its tasks
    worker.prefetch_from_storage(drained(encode({1: [FORGET]}, start=2)))
    assert len(ran) == 2
    # The batch route counts on its own: a D rank takes nothing off a batch, and a
    # batch with a D task is refused all the same (a prefill rank's kinds only there).
    with pytest.raises(ValueError, match="not a decode rank's task"):
        worker.submit_swap_tasks(batch_meta(encode({1: [SEND]})), None)


@pytest.mark.parametrize(
    ("task", "match"),
    [
        (("forget", (1,)), r"forget takes \(epoch, transfer id\)"),
        (("forget", (1, -2)), r"forget takes"),
        (("expect", FORGET[1]), "extra_params"),
    ],
)
def test_a_malformed_task_refuses_its_whole_payload(
    d_rank: tuple[FastDeployCacheController, list[list[tuple[str, object]]]],
    task: tuple[str, object],
    match: str,
) -> None:
    worker, ran = d_rank
    with pytest.raises(ValueError, match=match):
        worker.prefetch_from_storage(drained(encode({1: [FORGET, task]})))
    assert ran == []  # the good task before it did not run either
    worker.prefetch_from_storage(drained(encode({1: [FORGET]})))  # the count did not move
    assert ran == [[FORGET]]


def test_a_cache_reset_keeps_the_numbers_and_the_tasks_not_sent_yet(channel: str) -> None:
    from fastkv.integrations.fastdeploy import FastDeployCacheManager
    from fastkv.integrations.fd_pd import FinishedQueue, PDSettings

    cm = FastDeployCacheManager(fd_config(), channel_name=channel)
    try:
        cm.attach_pd(
            role="prefill", settings=PDSettings(b"L" * 32), finished_queue=FinishedQueue()
        )
        abort = ("abort", (0, 1))
        cm.pd._to_ranks(None, abort, step=False)  # as a send given up before its prefill
        (task,) = cm.drain_pending_prefetches()
        assert fd_pd_tasks.split(task.metadata, 0, 1)[1] == [(0, abort)]
        cm.pd._to_ranks(None, abort, step=False)
        old = cm.pd
        assert cm.reset_cache() is True
        assert cm.pd is not old  # rebuilt over the new manager
        cm.pd._to_ranks(None, FORGET, step=False)
        (task,) = cm.drain_pending_prefetches()
        assert fd_pd_tasks.split(task.metadata, 0, 1)[1] == [(1, abort), (2, FORGET)]
    finally:
        cm.close()


def test_a_kv_free_on_another_thread_waits_for_a_pd_task_run_between_check_and_use(
    channel: str,
) -> None:
    """free_gpu_cache detaches PD under the adapter's lock: a drained PD task list
    another thread is running (PD checked, its tasks not run yet) finishes first,
    instead of meeting `pd` gone (AttributeError after the route's count moved)."""
    worker = FastDeployCacheController(fd_config(tp=2), 1, 1, channel_name=channel)
    worker.initialize_kv_cache(attn_backend=AttentionBackend(2, 8, 4), num_gpu_blocks=8)
    pd = worker.attach_pd(InProcFabric().endpoint("d1"), role="decode", report_to=list)
    checked, go = threading.Event(), threading.Event()
    check = pd.check_tasks

    def slow_check(tasks: list) -> None:
        check(tasks)
        checked.set()
        go.wait(5)  # the running thread sits between the check and run_tasks

    pd.check_tasks = slow_check
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.prefetch_from_storage(drained(encode({1: [FORGET]})))
        except BaseException as e:
            errors.append(e)

    runner = threading.Thread(target=run)
    runner.start()
    try:
        assert checked.wait(5)
        freer = threading.Thread(target=worker.free_gpu_cache)
        freer.start()
        freer.join(0.3)
        assert freer.is_alive() and worker.pd is pd  # waiting for the adapter's lock
        go.set()
        runner.join(5)
        freer.join(10)
        assert not errors, repr(errors)
        assert worker.pd is None and not freer.is_alive()
    finally:
        go.set()
        worker.stop()


def test_a_kv_free_whose_transport_still_holds_a_write_frees_nothing_and_can_retry(
    channel: str,
) -> None:
    """A transport that still has a write inside it at its bound (close answers
    False) may still read or write the KV: free_gpu_cache raises and frees no
    tensor, PD stays attached; once the transport lets go, a retry frees all."""
    worker = FastDeployCacheController(fd_config(tp=2), 1, 1, channel_name=channel)
    worker.initialize_kv_cache(attn_backend=AttentionBackend(2, 8, 4), num_gpu_blocks=8)
    endpoint = InProcFabric().endpoint("d1")
    pd = worker.attach_pd(endpoint, role="decode", report_to=list)
    answers = [False, True]
    close = endpoint.close
    endpoint.close = lambda timeout_s=None: (close(timeout_s), answers.pop(0))[1]
    try:
        tensors = dict(worker.cache_kvs_map)
        assert tensors
        reporting = worker._reporter is not None
        with pytest.raises(RuntimeError, match="no KV tensor was freed"):
            worker.free_gpu_cache()
        assert worker.pd is pd and worker.controller is not None
        assert worker.cache_kvs_map == tensors
        # still reporting as before: the sends close settled reach the scheduler
        assert (worker._reporter is not None and worker._reporter.is_alive()) == reporting
        worker.free_gpu_cache()
        assert worker.pd is None and worker.controller is None
        assert not worker.cache_kvs_map and not answers
    finally:
        worker.stop()


def test_a_kv_free_over_a_transport_whose_bound_is_past_an_hour_waits_an_hour_at_most(
    channel: str,
) -> None:
    """PDWorker.close waits the transport's `release_bound_s` by default; with the
    engine's timeout set past an hour that bound is past the longest wait close
    takes: the wait is capped (close answers whether the transport let go by
    then), not refused, which would leave the KV unfreeable for good."""
    worker = FastDeployCacheController(fd_config(tp=2), 1, 1, channel_name=channel)
    worker.initialize_kv_cache(attn_backend=AttentionBackend(2, 8, 4), num_gpu_blocks=8)
    endpoint = InProcFabric().endpoint("d1")
    endpoint.release_bound_s = 7201.0  # MC_TRANSFER_TIMEOUT=7200, as Mooncake's says
    pd = worker.attach_pd(endpoint, role="decode", report_to=list)
    waits: list[float | None] = []
    close = endpoint.close
    endpoint.close = lambda timeout_s=None: (waits.append(timeout_s), close(timeout_s))[1]
    try:
        assert pd.close() is True
        assert len(waits) == 1 and 3599 < waits[0] <= 3600
        worker.free_gpu_cache()
        assert worker.pd is None and not worker.cache_kvs_map
    finally:
        worker.stop()
