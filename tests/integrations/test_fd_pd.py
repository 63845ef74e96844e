"""fd_pd without FastDeploy: what rides FastDeploy's messages, and attach_pd's checks
(the flows run against FastDeploy's real code in tests/fastdeploy_real/test_real_fd_pd.py)."""

from __future__ import annotations

import pickle

import pytest
from fd_standins import FDCacheConfig, FDConfig, ModelConfig, ParallelConfig

from fastkv.integrations.fastdeploy import FastDeployCacheManager
from fastkv.integrations.fd_pd import DestBlockIds, FinishedQueue, PDSettings, acceptance_from

BS = 4


def test_dest_block_ids_pickle_as_a_list_with_the_acceptance() -> None:
    fields = {
        "transfer_id": 3,
        "epoch": 1,
        "num_tokens": 9,
        "num_prefix_blocks": 1,
        "block_ids": [7, 8],
        "secret": b"",
        "timeout_s": 5.0,
        "num_d_ranks": 2,
    }
    dest = DestBlockIds([-1, 7, 8], fields)
    back = pickle.loads(pickle.dumps(dest, protocol=5))
    assert back == [-1, 7, 8] and isinstance(back, list)
    acc = acceptance_from("r", back.fastkv)
    assert (acc.transfer_id, acc.epoch, acc.block_ids, acc.num_prefix_blocks) == (
        3,
        1,
        (7, 8),
        1,
    )
    with pytest.raises(ValueError, match="not an acceptance"):
        acceptance_from("r", {"transfer_id": 3})


def test_attach_pd_refuses_bad_settings_and_changes_nothing(channel: str) -> None:
    fd_config = FDConfig(
        FDCacheConfig(block_size=BS, total_block_num=8), ModelConfig(), ParallelConfig()
    )
    cm = FastDeployCacheManager(fd_config, channel_name=channel)
    try:
        digest = b"L" * 32
        with pytest.raises(ValueError, match="role"):
            cm.attach_pd(role="mixed", settings=PDSettings(digest))
        with pytest.raises(ValueError, match="finished_queue"):
            cm.attach_pd(role="prefill", settings=PDSettings(digest))
        with pytest.raises(ValueError, match="handshakes"):
            cm.attach_pd(role="decode", settings=PDSettings(digest, num_ranks=2))
        with pytest.raises(ValueError, match="layout_digest"):
            cm.attach_pd(
                role="prefill", settings=PDSettings(b"x"), finished_queue=FinishedQueue()
            )
        assert cm.pd is None
        cm.attach_pd(
            role="prefill", settings=PDSettings(digest), finished_queue=FinishedQueue()
        )
        assert cm.pd is not None and cm.pd.role == "prefill"
    finally:
        cm.close()


def test_rank_reports_over_the_results_channel_reach_the_pd_half_or_are_counted(
    channel: str,
) -> None:
    import time

    from fastkv.channel import ResultsSender
    from fastkv.pd.messages import RankReport

    fd_config = FDConfig(
        FDCacheConfig(block_size=BS, total_block_num=8), ModelConfig(), ParallelConfig()
    )
    cm = FastDeployCacheManager(fd_config, channel_name=channel)
    sender = ResultsSender(channel, 0)

    def deliver(report: RankReport) -> None:
        sender.send([report])
        deadline = time.monotonic() + 10
        while sender.flush() and time.monotonic() < deadline:
            cm.poll_results()
            time.sleep(0.002)
        cm.poll_results()

    try:
        deliver(RankReport(5, 0, 0, True))  # no PD role attached: dropped, counted
        assert cm.get_stats()["pd_reports_unrouted"] == 1
        cm.attach_pd(
            role="prefill", settings=PDSettings(b"L" * 32), finished_queue=FinishedQueue()
        )
        assert cm.pd is not None and cm.pd.p is not None
        deliver(RankReport(6, 0, 0, True))  # an unknown send: the PD half drops it
        assert cm.pd.p.counters.stale == 1
        assert cm.get_stats()["pd_reports_unrouted"] == 1
        assert cm.get_stats()["results_unknown"] == 0  # never reached the relay
    finally:
        sender.close()
        cm.close()


def test_a_cache_reset_waits_for_ds_fencing_blocks_before_it_forgets_the_cache(
    channel: str,
) -> None:
    """A failed write's bytes may still land in D's receiving blocks until the
    transfer's deadline plus grace. A cache reset (FastDeploy aborted every
    request, so none is active) must not hand those blocks out again before then:
    it is owed until the fence released them, as it is for a copy in flight."""
    import time

    from fastkv.pd.messages import Offer, RankReport

    fd_config = FDConfig(
        FDCacheConfig(block_size=BS, total_block_num=8), ModelConfig(), ParallelConfig()
    )
    cm = FastDeployCacheManager(fd_config, channel_name=channel, reset_timeout_s=0.05)
    digest = b"L" * 32
    try:
        settings = PDSettings(
            digest, handshakes=(("d0", None),), timeout_s=0.3, fence_grace_s=0.3
        )
        cm.attach_pd(role="decode", settings=settings)
        assert cm.pd is not None and cm.pd.d is not None
        d, epoch = cm.pd.d, cm.manager.epoch
        acc = d.accept(Offer("r", 3 * BS, digest, 1), [bytes([i]) * 32 for i in range(3)])
        assert len(acc.block_ids) == 3
        failed = RankReport(acc.transfer_id, acc.epoch, 0, False, "a write failed", False)
        cm.pd_reports([failed])  # not fenced: D holds the blocks to deadline + grace
        d.abort("r")  # FastDeploy pauses: every request aborted
        assert cm.manager.num_receiving_blocks == 3
        assert cm.reset_cache() is False  # owed, not done: P's bytes may still land
        assert cm.manager.epoch == epoch and cm.manager.num_receiving_blocks == 3
        with pytest.raises(ValueError, match="3 receiving"):  # would drop the fence too
            cm.attach_pd(role="decode", settings=settings)
        assert cm.pd.d is d
        end = time.monotonic() + 5
        while cm.manager.epoch == epoch and time.monotonic() < end:
            cm.poll_results()  # the fence passes, the blocks go, the reset is done
            time.sleep(0.01)
        assert cm.manager.epoch == epoch + 1
        assert d.counters.released_blocks == 3
    finally:
        cm.close()
