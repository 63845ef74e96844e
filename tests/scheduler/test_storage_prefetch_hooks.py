"""The CacheManager calls an engine that looks storage up ahead of admission uses
(FastDeploy's adapter): a match that plans no lookup, the state of a prefetch
(`storage_pending`, `storage_loaded`), a finished request's unsent lookup never
sent, and `write_to_storage` under each storage write policy. `check_invariants()`
runs after every call (see `Checked`)."""

from __future__ import annotations

import pytest

from tests.scheduler.test_cache_manager import BS, keys
from tests.scheduler.test_storage_tier import answer, assert_no_leak, make, prompt


def test_a_match_without_lookup_plans_none() -> None:
    mgr = make()
    hit = mgr.match("r", keys("k", 3), prompt(3), lookup_storage=False)
    assert not hit.storage_lookup
    assert mgr.take_swap_metadata().lookups == ()
    mgr.finish("r")
    assert_no_leak(mgr)


def test_a_prefetch_is_pending_until_its_loads_land_then_names_them() -> None:
    mgr = make()
    assert mgr.match("p", keys("k", 3), prompt(3)).storage_lookup
    assert mgr.storage_pending("p") and mgr.storage_loaded("p") == []
    answer(mgr, 2)  # the lookup: storage holds the first two
    assert mgr.storage_pending("p")  # their loads are on their way
    answer(mgr, None)  # the loads land
    assert not mgr.storage_pending("p")
    assert mgr.storage_loaded("p") == keys("k", 3)[:2]
    mgr.finish("p")
    hit = mgr.match("r", keys("k", 3), prompt(3), lookup_storage=False)
    assert (hit.num_device_hits, hit.num_host_hits) == (0, 2)  # left in host
    mgr.finish("r")
    assert_no_leak(mgr)
    for call in (mgr.storage_pending, mgr.storage_loaded, mgr.write_to_storage):
        with pytest.raises(ValueError, match="not an active request"):
            call("gone")


def test_a_finished_requests_unsent_lookup_is_never_sent() -> None:
    mgr = make()
    mgr.match("p", keys("k", 3), prompt(3))
    mgr.finish("p")
    assert mgr.take_swap_metadata().lookups == ()
    assert_no_leak(mgr)


@pytest.mark.parametrize(
    ("policy", "planned"), [("write_through", 3), ("on_host_eviction", 0), ("after_hits", 0)]
)
def test_write_to_storage_follows_the_storage_write_policy(policy: str, planned: int) -> None:
    mgr = make(write_policy=policy)
    mgr.match("r", keys("k", 3), prompt(3), lookup_storage=False)
    mgr.allocate("r", num_tokens=4 * BS)
    mgr.commit("r", num_computed_tokens=3 * BS + 1)
    assert mgr.write_to_storage("r") == planned
    if planned:
        backups = answer(mgr, None)  # device-only: copied to host first
        assert backups.evict is not None and backups.evict.num_blocks == 3
        writes = answer(mgr, None)  # the copies landed: written
        assert writes.storage_store is not None and writes.storage_store.num_blocks == 3
        assert mgr.write_to_storage("r") == 0  # stored already
    mgr.finish("r")
    assert_no_leak(mgr)
