"""The scheduler's policies as small objects, built from the configuration's enums.

`fastkv.config` names the policies (`WritePolicy`, `StorageWritePolicy`,
`PrefetchPolicy`, StrEnums so that configurations stay plain strings); the
factories at the bottom turn each name into one of the objects below, and the
cache manager and its storage tier call those objects where they used to branch
on the enum. The defaults reproduce the configured behaviour exactly.

Where things go:

- A new device write policy (when a device block gets a host copy): a subclass of
  `DeviceWritePolicyBase`, a member of `WritePolicy`, and an entry in
  `DEVICE_WRITE_POLICIES`.
- A new storage write policy (when a host copy is written to storage): a subclass
  of `StorageWritePolicyBase`, a member of `StorageWritePolicy`, an entry in
  `STORAGE_WRITE_POLICIES`.
- A new prefetch policy (whether `allocate` waits for storage, and whether a
  block found there is worth loading): a subclass of `PrefetchPolicyBase`, a
  member of `PrefetchPolicy`, an entry in `PREFETCH_POLICIES`.
- Eviction is not here: it is leaf-first LRU over the radix tree's per-tier
  eviction lists (`fastkv/scheduler/radix_tree.py`, with the C nodes and lists in
  `fastkv/scheduler/_tree_node.c`); the manager takes victims with
  `pop_device_victim` / `pop_host_victim`. Another eviction order is another list
  discipline there, behind the same calls.
- A remote tier: its bytes are a storage backend in `fastkv/storage/` (the
  worker's side: put, get, lookup); the scheduler's side (lookups, loads,
  writes) is `fastkv/scheduler/storage_tier.py`, driven by the storage policies
  here.

Cost: a hook is called once per manager call, or once per node only where the
manager decided per node before. A per-block decision inside a hot loop (device
eviction) is an attribute read once per call, `evicted_copy_threshold`, so no
policy adds a Python call per evicted block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from fastkv.config import (
    CacheConfig,
    PrefetchPolicy,
    StorageConfig,
    StorageWritePolicy,
    WritePolicy,
)
from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.radix_tree import DEVICE, TreeNode

NEVER = 1 << 62
"""An `evicted_copy_threshold` no hit count reaches."""

# -- device writes (device -> host) ------------------------------------------------


class DeviceWritePolicyBase:
    """When a device block gets a host copy.

    Attributes:
        counts_hits: `match` counts `TreeNode.hits` for this policy.
        backs_up_ahead: the policy copies blocks to host before they are evicted;
            a copy it owed that is made at eviction instead (no host room then, or
            a failed backup) counts as a backup retry.
        evicted_copy_threshold: a device block evicted without a host copy is
            copied to host (owed a copy) when its `hits` reach this; 0: always.
            A block with children on host is copied whatever this says.
    """

    kind: ClassVar[WritePolicy]
    counts_hits: ClassVar[bool] = False
    backs_up_ahead: ClassVar[bool] = False

    def __init__(self, config: CacheConfig) -> None:
        self.evicted_copy_threshold = 0

    def new_blocks_to_back_up(self, nodes: list[TreeNode]) -> list[TreeNode]:
        """`commit` just cached `nodes` (root side first): which to copy to host now."""
        return []

    def matched_to_back_up(self, nodes: list[TreeNode]) -> list[TreeNode]:
        """`match` just locked `nodes` (their `hits` counted when `counts_hits`):
        which to copy to host now."""
        return []


class WriteThrough(DeviceWritePolicyBase):
    """Back up every new full block to host when it is committed."""

    kind = WritePolicy.WRITE_THROUGH
    backs_up_ahead = True

    def new_blocks_to_back_up(self, nodes: list[TreeNode]) -> list[TreeNode]:
        return nodes


class WriteThroughSelective(DeviceWritePolicyBase):
    """Back up a block once it has been matched `selective_threshold` times; an
    evicted block is copied only if it reached that count."""

    kind = WritePolicy.WRITE_THROUGH_SELECTIVE
    counts_hits = True
    backs_up_ahead = True

    def __init__(self, config: CacheConfig) -> None:
        self.evicted_copy_threshold = config.selective_threshold

    def matched_to_back_up(self, nodes: list[TreeNode]) -> list[TreeNode]:
        threshold = self.evicted_copy_threshold
        return [
            n for n in nodes if n.hits >= threshold and n.state == DEVICE and n.host_block < 0
        ]


class WriteBack(DeviceWritePolicyBase):
    """Copy a block to host only when it is evicted from the device."""

    kind = WritePolicy.WRITE_BACK


DEVICE_WRITE_POLICIES: dict[WritePolicy, type[DeviceWritePolicyBase]] = {
    WritePolicy.WRITE_THROUGH: WriteThrough,
    WritePolicy.WRITE_THROUGH_SELECTIVE: WriteThroughSelective,
    WritePolicy.WRITE_BACK: WriteBack,
}

# -- storage writes (host -> storage) ----------------------------------------------


class StorageWritePolicyBase:
    """When a block's host copy is written to storage. The storage tier asks only
    about blocks storage does not hold yet (`TreeNode.storage == NOT_STORED`).

    Attributes:
        counts_hits: `match` counts `TreeNode.hits` and calls the tier's `on_hit`
            for every node it locked.
        writes_on_host_copy: the manager calls the tier's `on_host_copy` for a
            node whose host copy just became valid.
        writes_on_host_eviction: a host copy being evicted is written first (its
            host block freed when the write ends).
        writes_requests: `CacheManager.write_to_storage` plans the writes of a
            request's blocks.
    """

    kind: ClassVar[StorageWritePolicy]
    counts_hits: ClassVar[bool] = False
    writes_on_host_copy: ClassVar[bool] = False
    writes_on_host_eviction: ClassVar[bool] = False
    writes_requests: ClassVar[bool] = False

    def __init__(self, config: StorageConfig) -> None:
        self.config = config

    def write_on_host_copy(self, node: TreeNode) -> bool:
        """The node's host copy just became valid: write it now?"""
        return False

    def write_on_hit(self, node: TreeNode) -> bool:
        """The node was matched once more (`hits` counted): write it now?"""
        return False

    def flush_window(self, host_pool: BlockPool) -> int:
        """At take time: how many of the oldest host copies to start writing now
        (0: none), so that evicting them later frees their blocks at once."""
        return 0


class NoStorageWrites(StorageWritePolicyBase):
    """Never write (storage is read-only to this deployment)."""

    kind = StorageWritePolicy.NONE


class StorageWriteThrough(StorageWritePolicyBase):
    """Write every host copy as soon as it is valid, and a request's blocks on
    `write_to_storage`."""

    kind = StorageWritePolicy.WRITE_THROUGH
    writes_on_host_copy = True
    writes_requests = True

    def write_on_host_copy(self, node: TreeNode) -> bool:
        return True


class WriteOnHostEviction(StorageWritePolicyBase):
    """Write a host copy when it is evicted from host; when the host tier is nearly
    full, write the oldest copies ahead of their eviction."""

    kind = StorageWritePolicy.ON_HOST_EVICTION
    writes_on_host_eviction = True

    def flush_window(self, host_pool: BlockPool) -> int:
        window = max(16, host_pool.capacity // 32)
        return window if host_pool.num_free < window else 0


class WriteAfterHits(StorageWritePolicyBase):
    """Write a block once it has been matched `write_after_hits` times (and has a
    host copy)."""

    kind = StorageWritePolicy.AFTER_HITS
    counts_hits = True
    writes_on_host_copy = True

    def write_on_host_copy(self, node: TreeNode) -> bool:
        return node.hits >= self.config.write_after_hits

    def write_on_hit(self, node: TreeNode) -> bool:
        return node.hits >= self.config.write_after_hits


STORAGE_WRITE_POLICIES: dict[StorageWritePolicy, type[StorageWritePolicyBase]] = {
    StorageWritePolicy.NONE: NoStorageWrites,
    StorageWritePolicy.WRITE_THROUGH: StorageWriteThrough,
    StorageWritePolicy.ON_HOST_EVICTION: WriteOnHostEviction,
    StorageWritePolicy.AFTER_HITS: WriteAfterHits,
}

# -- prefetch (storage -> host) --------------------------------------------------


class PrefetchPolicyBase:
    """Whether `allocate` waits for a request's storage lookup and loads, and
    whether the blocks a lookup found are worth loading."""

    kind: ClassVar[PrefetchPolicy]

    def __init__(self, config: StorageConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size

    def waits(self, deadline: float, clock: Callable[[], float]) -> bool:
        """Does a request whose storage work is in flight wait (until `deadline`,
        in `clock` seconds)?"""
        return clock() < deadline

    def worth_loading(self, num_blocks: int) -> bool:
        """Load `num_blocks` found in storage rather than recompute them?"""
        return True

    def note_load(self, nbytes: int, seconds: float) -> None:
        """A load of `nbytes` succeeded in `seconds` (from emit to result)."""


class BestEffortPrefetch(PrefetchPolicyBase):
    """Never wait: what has landed by `allocate` is used, the rest is computed."""

    kind = PrefetchPolicy.BEST_EFFORT

    def waits(self, deadline: float, clock: Callable[[], float]) -> bool:
        return False


class WaitPrefetch(PrefetchPolicyBase):
    """Wait for the lookup and loads, at most `wait_s` after the match."""

    kind = PrefetchPolicy.WAIT


class PredictedPrefetch(WaitPrefetch):
    """Wait like WAIT, and load only when loading is predicted faster than
    recomputing (latency plus bytes over an EWMA of the read bandwidth, against
    tokens over `recompute_tokens_per_s`)."""

    kind = PrefetchPolicy.PREDICTED

    def __init__(self, config: StorageConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        self.read_bytes_per_s = config.read_bytes_per_s

    def worth_loading(self, num_blocks: int) -> bool:
        c = self.config
        load_s = c.load_latency_s + num_blocks * c.block_bytes / self.read_bytes_per_s
        compute_s = num_blocks * self.block_size / c.recompute_tokens_per_s
        return load_s < compute_s

    def note_load(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.read_bytes_per_s = 0.8 * self.read_bytes_per_s + 0.2 * (nbytes / seconds)


PREFETCH_POLICIES: dict[PrefetchPolicy, type[PrefetchPolicyBase]] = {
    PrefetchPolicy.BEST_EFFORT: BestEffortPrefetch,
    PrefetchPolicy.WAIT: WaitPrefetch,
    PrefetchPolicy.PREDICTED: PredictedPrefetch,
}

# -- factories ------------------------------------------------------------------


def device_write_policy(config: CacheConfig) -> DeviceWritePolicyBase:
    """The device write policy `config.write_policy` names."""
    return DEVICE_WRITE_POLICIES[WritePolicy(config.write_policy)](config)


def storage_write_policy(config: StorageConfig) -> StorageWritePolicyBase:
    """The storage write policy `config.write_policy` names."""
    return STORAGE_WRITE_POLICIES[StorageWritePolicy(config.write_policy)](config)


def prefetch_policy(config: StorageConfig, block_size: int) -> PrefetchPolicyBase:
    """The prefetch policy `config.prefetch_policy` names."""
    return PREFETCH_POLICIES[PrefetchPolicy(config.prefetch_policy)](config, block_size)


__all__ = [
    "DEVICE_WRITE_POLICIES",
    "PREFETCH_POLICIES",
    "STORAGE_WRITE_POLICIES",
    "BestEffortPrefetch",
    "DeviceWritePolicyBase",
    "NoStorageWrites",
    "PredictedPrefetch",
    "PrefetchPolicyBase",
    "StorageWritePolicyBase",
    "StorageWriteThrough",
    "WaitPrefetch",
    "WriteAfterHits",
    "WriteBack",
    "WriteOnHostEviction",
    "WriteThrough",
    "WriteThroughSelective",
    "device_write_policy",
    "prefetch_policy",
    "storage_write_policy",
]
