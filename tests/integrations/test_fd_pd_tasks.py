"""fd_pd_tasks: PD tasks as entries of FastDeploy's merged metadata (the step's batch
on P, the drained tasks on D), and the worker's refusals (the flows run against
FastDeploy's real code in tests/fastdeploy_real/test_real_fd_pd.py)."""

from __future__ import annotations

import pickle

import pytest
from fd_standins import FDCacheConfig, FDConfig, ModelConfig, ParallelConfig

from fastkv.integrations import fd_pd_tasks
from fastkv.integrations.fastdeploy import FastDeployCacheController
from fastkv.integrations.fd_prefetch import FDStorageMetadata
from fastkv.integrations.fd_transfers import FDCacheLevel, FDCacheSwapMetadata

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


def test_each_rank_takes_its_own_tasks_in_order_and_the_copies_stay() -> None:
    entries = fd_pd_tasks.encode({0: [SEND, ("chunk", (0, 7, 5, True))], 1: [FORGET]})
    meta = pickle.loads(pickle.dumps(batch_meta(entries)))  # as the queue carries it
    rest, mine = fd_pd_tasks.split(meta, 0)
    assert mine == [SEND, ("chunk", (0, 7, 5, True))]
    assert rest.hash_values == ["0:ab", "1:ab"] and rest.src_block_ids == [0, 1]
    assert rest.dst_block_ids == [10, 11]
    assert fd_pd_tasks.split(meta, 1)[1] == [FORGET]
    assert fd_pd_tasks.split(meta, 2)[1] == []
    assert meta.hash_values[2:] == entries  # not changed
    only = batch_meta(entries, copies=0)
    assert fd_pd_tasks.split(only, 1) == (None, [FORGET])
    plain = batch_meta([])
    assert fd_pd_tasks.split(plain, 0) == (plain, [])


def test_a_drained_task_carries_pd_entries_only() -> None:
    entries = fd_pd_tasks.encode({0: [FORGET]})
    meta = FDStorageMetadata(hash_values=entries, block_ids=[-1], direction="pd")
    assert fd_pd_tasks.split(meta, 0) == (None, [FORGET])
    mixed = FDStorageMetadata(hash_values=[*entries, "Q1:ab"], block_ids=[-1, -1])
    assert fd_pd_tasks.split(mixed, 0) == (mixed, [FORGET])  # the worker refuses it


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("X0", "not a fastkv PD task"),
        ("Xa:AAAA", "not a fastkv PD task"),
        ("X0:!!!", "does not decode"),
        ("X0:" + fd_pd_tasks.encode({0: [("format_disk", 1)]})[0][3:], "not one of"),
        ("X0:" + fd_pd_tasks.encode({0: [SEND]})[0][3:-4], "does not decode"),
    ],
)
def test_a_malformed_entry_is_refused_naming_it(entry: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fd_pd_tasks.split(batch_meta([entry]), 0)


def test_a_pd_entry_with_block_ids_is_refused() -> None:
    meta = batch_meta(fd_pd_tasks.encode({0: [SEND]}))
    meta.src_block_ids[-1] = 3
    with pytest.raises(ValueError, match=r"block ids \(3, -1\)"):
        fd_pd_tasks.split(meta, 0)


def test_a_rank_without_pd_refuses_a_batch_with_pd_tasks_and_launches_nothing(
    channel: str,
) -> None:
    fd_config = FDConfig(
        FDCacheConfig(block_size=4, total_block_num=8), ModelConfig(), ParallelConfig()
    )
    worker = FastDeployCacheController(fd_config, 0, 0, channel_name=channel)
    try:
        with pytest.raises(ValueError, match="without PD"):
            worker.submit_swap_tasks(batch_meta(fd_pd_tasks.encode({0: [SEND]})), None)
        drained = FDStorageMetadata(
            hash_values=fd_pd_tasks.encode({0: [FORGET]}), block_ids=[-1], direction="pd"
        )
        with pytest.raises(ValueError, match="without PD"):
            worker.prefetch_from_storage(drained)
        assert worker.get_stats()["transfers_without_result"] == 0
    finally:
        worker.stop()
