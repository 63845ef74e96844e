"""A yes from `can_allocate_gpu_blocks(n)` means `allocate_gpu_blocks(request, n)`
succeeds in the same step (ResourceManagerV1 does not check the allocation), under
every write policy, with the host tier full and copies in flight; and the adapter
never commits a block a request did not hold when its KV was computed."""

from __future__ import annotations

import copy
import hashlib
import random
from collections.abc import Callable

import pytest
from fd_standins import FDCacheConfig, FDConfig, ModelConfig, Request, get_request_block_hasher

from fastkv.config import CacheConfig
from fastkv.integrations import fastdeploy as fd
from fastkv.metadata import TransferResult
from fastkv.scheduler import CacheManager

BS = 4
POLICIES = ["write_back", "write_through", "write_through_selective"]


def request(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, 4)
    r.set_block_hasher(get_request_block_hasher(BS))
    return r


def admit(cm: fd.CacheManager, r: Request, num_blocks: int) -> list[int]:
    """FastDeploy's admission: match, then extend the table by what allocate gives."""
    cm.match_prefix(r, skip_storage=True)
    r.block_tables = list(r.match_result.device_block_ids)
    new = cm.allocate_gpu_blocks(r, num_blocks)
    r.block_tables += new
    return new


def test_a_yes_holds_when_evictions_fill_the_host_tier_in_the_same_step(channel: str) -> None:
    # write_back, 12 device and 2 host blocks. A cached chain of 8 blocks, a running
    # request holding 2, 2 free. The next allocation evicts the chain's last 2
    # blocks: both host blocks now receive copies still in flight. In the same
    # step, can_allocate(3) must answer what allocate then does.
    cfg = FDConfig(
        FDCacheConfig(BS, total_block_num=12, num_cpu_blocks=2, write_policy="write_back"),
        ModelConfig(num_hidden_layers=2),
    )
    cm = fd.CacheManager(cfg, channel_name=channel)
    try:
        chain = request("chain", list(range(8 * BS + 1)))
        admit(cm, chain, 9)
        chain.output_token_ids = [1]
        cm.request_finish(chain)  # 8 blocks cached, unheld
        running = request("running", list(range(1000, 1000 + 2 * BS)))
        assert len(admit(cm, running, 2)) == 2
        assert cm.num_free_device_blocks == 2
        evicting = request("evicting", list(range(2000, 2000 + 4 * BS)))
        assert len(admit(cm, evicting, 4)) == 4  # 2 free + 2 evicted to host
        assert evicting.cache_evict_metadata and cm.num_free_host_blocks == 0
        nxt = request("next", list(range(3000, 3000 + 3 * BS)))
        assert cm.can_allocate_gpu_blocks(3)
        assert len(admit(cm, nxt, 3)) == 3
        assert cm.get_stats()["allocation_failures"] == 0
        cm.manager.check_invariants()
    finally:
        cm.close()


def _fake_worker_step(mgr: CacheManager, inflight: list[int], rng: random.Random) -> None:
    """Finish some of the copies in flight (a few fail)."""
    tasks = mgr.take_swap_metadata()
    for meta in (tasks.evict, tasks.swap_in):
        if meta is not None:
            inflight.append(meta.transfer_id)
    rng.shuffle(inflight)
    done = inflight[: rng.randint(0, len(inflight))]
    del inflight[: len(done)]
    mgr.apply_results([TransferResult(t, rng.random() > 0.1) for t in done])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(6))
def test_the_obtainable_count_is_exact_in_random_runs(
    policy: str,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
    use_python_radix_tree: Callable[[pytest.MonkeyPatch], None],
) -> None:
    # Each answer is checked against a real allocation on a deep copy of the
    # manager: the Python tree (identical behaviour, test_tree_node.py) can be copied.
    use_python_radix_tree(monkeypatch)
    # Against the allocation itself, on a copy of the manager: every count is met
    # by an allocation of that many blocks, and one more block is refused.
    rng = random.Random(seed)
    config = CacheConfig(
        block_size=BS,
        num_device_blocks=16,
        num_host_blocks=rng.choice([0, 2, 3, 6]),
        write_policy=policy,
        selective_threshold=1,
        reuse_evicted_blocks=True,
    )
    mgr = CacheManager(config)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 5) * BS)] for _ in range(4)]
    active: dict[int, int] = {}  # request -> blocks it holds
    allocated_at: dict[int, int] = {}  # request -> worker steps run before its allocation
    worker_steps = 0
    inflight: list[int] = []
    checked = 0
    for step in range(300):
        op = rng.random()
        if op < 0.45 or not active:
            rid = step
            tokens = rng.choice(prefixes) + [
                rng.randrange(50) for _ in range(rng.randint(0, 9))
            ]
            hashes = [
                hashlib.sha256(repr(tokens[: (i + 1) * BS]).encode()).digest()
                for i in range(len(tokens) // BS)
            ]
            hit = mgr.match(rid, hashes, len(tokens))
            want = -(-len(tokens) // BS) - hit.num_device_hits  # host hits included
            count = mgr.num_obtainable_device_blocks(16)
            for n in sorted({want, count, count + 1}):
                if n < hit.num_host_hits or hit.num_device_hits + n > 16:
                    continue
                positions = hit.num_device_hits + n  # FastDeploy's n counts host hits
                got = copy.deepcopy(mgr).allocate(rid, num_tokens=positions * BS)
                assert bool(got) == (n <= count), (step, n, count, got.status)
                checked += 1
            if hit.num_device_hits + want <= 16 and mgr.allocate(
                rid, num_tokens=(hit.num_device_hits + want) * BS
            ):
                active[rid] = len(hashes)
                allocated_at[rid] = worker_steps
            else:
                mgr.abort(rid)
        elif op < 0.8:
            rid = rng.choice(list(active))
            full = min(active.pop(rid), mgr.num_blocks(rid))
            # KV exists only once a worker step ran since the allocation (its
            # metadata sent): only then may the request commit it.
            computed = worker_steps > allocated_at.pop(rid)
            if (
                computed
                and not mgr.has_pending_swap_in(rid)
                and full > mgr.num_committed_blocks(rid)
            ):
                mgr.commit(rid, num_computed_tokens=full * BS)
            mgr.finish(rid)
        else:
            _fake_worker_step(mgr, inflight, rng)
            worker_steps += 1
        mgr.check_invariants()
    assert checked > 100


def test_blocks_a_request_did_not_hold_when_it_computed_are_never_committed(
    channel: str,
) -> None:
    # The caller ran a prefill whose allocation came back empty (as
    # ResourceManagerV1 would); later allocations succeed and a token is sampled.
    # Its KV was written nowhere: nothing of it may become a cache hit.
    cfg = FDConfig(FDCacheConfig(BS, total_block_num=4, num_cpu_blocks=0))
    cm = fd.CacheManager(cfg, channel_name=channel)
    try:
        hog = request("hog", list(range(100, 100 + 4 * BS)))
        admit(cm, hog, 4)
        r = request("r", list(range(2 * BS + 1)))
        assert admit(cm, r, 3) == []  # nothing free, nothing evictable
        r.num_computed_tokens = 2 * BS + 1  # the engine ran the prefill anyway
        cm.check_and_add_pending_backup()  # end of that schedule
        cm.request_finish(hog)
        r.block_tables += cm.allocate_gpu_blocks(r, 3)  # a later step
        assert len(r.block_tables) == 3
        r.output_token_ids = [7, 8]
        cm.check_and_add_pending_backup()
        cm.request_finish(r)
        assert cm.get_stats()["uncovered_computes"] == 1
        again = request("again", list(range(2 * BS + 1)))
        cm.match_prefix(again, skip_storage=True)
        assert again.match_result.total_matched_blocks == 0
        cm.request_finish(again)
    finally:
        cm.close()
