"""What the FastDeploy cache manager shows ResourceManagerV1, and what it reads off
FastDeploy's requests.

- `FastDeployMatchResult`: the object `match_prefix` leaves on
  `request._match_result`, with the attributes ResourceManagerV1 reads.
- `FreeBlockList`: `gpu_free_block_list`, a sequence whose length costs O(1).
- `AdapterCounters`: what the adapter counts, in `get_stats`.
- `fd_digests` and `prompt_digests`: a request's `prompt_hashes` (SHA-256 hex
  digests) as the 32-byte digests fastkv's manager takes.

Nothing here changes the cache: these are values and read-only views over the
manager's public queries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastkv.scheduler import CacheManager


def fd_digests(hashes: list[Any]) -> list[bytes]:
    """FastDeploy's block hashes (SHA-256 hex digests, `Request.prompt_hashes`) as
    the 32-byte digests fastkv's manager takes; their hex is the text fastkv tags
    transfers and names storage keys with, so both spell a block the same way.

    Raises:
        ValueError: an entry is not a 64-digit hex digest (or a 32-byte digest).
    """
    out = []
    for i, h in enumerate(hashes):
        if type(h) is bytes and len(h) == 32:
            out.append(h)
            continue
        try:
            digest = bytes.fromhex(h)
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ValueError(
                f"prompt_hashes[{i}]: {h!r:.80} is not a SHA-256 hex digest (64 hex digits)"
            )
        out.append(digest)
    return out


def prompt_digests(request: Any, block_size: int) -> tuple[int, list[bytes]]:
    """A request's token count (prompt and outputs) and the digests of its full
    blocks, as `match` takes them.

    Raises:
        ValueError: a hash that is not a SHA-256 digest (see `fd_digests`).
    """
    tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
    return tokens, fd_digests(list(request.prompt_hashes)[: tokens // block_size])


class FastDeployMatchResult:
    """What `match_prefix` leaves on `request._match_result`, with the attributes
    FastDeploy's ResourceManagerV1 reads. Fixed at the match: ResourceManagerV1
    makes `device_block_ids` the request's `block_tables` and extends that list as
    the request allocates, so each read of it returns a new list.

    Attributes:
        device_block_ids: the device hits, in order (the request's first blocks).
        matched_device_nums: how many (its length at the match).
        matched_host_nums: host hits; the first ids `allocate_gpu_blocks` returns
            are their swap-in destinations.
        matched_storage_nums: storage hits (loaded to host, then swapped in like
            host hits).
        uncached_block_ids: kept for FastDeploy's shape; always empty.
    """

    __slots__ = ("_device", "matched_host_nums", "matched_storage_nums")

    def __init__(
        self,
        device_block_ids: Sequence[int] = (),
        matched_host_nums: int = 0,
        matched_storage_nums: int = 0,
    ) -> None:
        self._device = tuple(device_block_ids)
        self.matched_host_nums = matched_host_nums
        self.matched_storage_nums = matched_storage_nums

    @property
    def device_block_ids(self) -> list[int]:
        return list(self._device)

    @property
    def uncached_block_ids(self) -> list[int]:
        return []

    @property
    def matched_device_nums(self) -> int:
        return len(self._device)

    @property
    def total_matched_blocks(self) -> int:
        return self.matched_device_nums + self.matched_host_nums + self.matched_storage_nums

    def __repr__(self) -> str:
        return (
            f"FastDeployMatchResult(device={list(self._device)}, "
            f"host={self.matched_host_nums}, storage={self.matched_storage_nums})"
        )


@dataclass(slots=True)
class AdapterCounters:
    """What the cache manager adapter counted since it was built (kept across
    `update_cache_config` and `reset_cache`); `get_stats` reports every field.

    Attributes:
        results_applied: worker results applied to the manager.
        results_unknown: worker results the manager refused (dropped, logged).
        results_stale: worker results of an earlier cache epoch (reports from
            before a reset), dropped by the manager.
        rollback_blocks: blocks of failed swap-ins rolled back.
        rewound_tokens: tokens requests recompute after a failed swap-in.
        undispatched_transfers: transfers and lookups failed here because no
            worker ever got them.
        allocation_failures: allocations refused or not possible now.
        match_failures: matches refused (bad input, a request holding blocks).
        commit_errors: commits refused (bad hashes or counts).
        table_mismatches: allocations refused because the request's
            `block_tables` was not the table fastkv gave it.
        uncovered_computes: requests scheduled past the blocks they hold.
        prefetches: storage prefetches started.
        storage_hit_blocks: blocks a prefetch brought from storage, hit since.
        pd_reports_unrouted: PD RankReports that came over the results channel
            while no PD role is attached (dropped; the PD halves count the
            unknown, stale and repeated ones they drop themselves).
    """

    results_applied: int = 0
    results_unknown: int = 0
    results_stale: int = 0
    rollback_blocks: int = 0
    rewound_tokens: int = 0
    undispatched_transfers: int = 0
    allocation_failures: int = 0
    match_failures: int = 0
    commit_errors: int = 0
    table_mismatches: int = 0
    uncovered_computes: int = 0
    prefetches: int = 0
    storage_hit_blocks: int = 0
    pd_reports_unrouted: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by name, in declaration order."""
        return dataclasses.asdict(self)


class FreeBlockList(Sequence[int]):
    """`gpu_free_block_list`: its length is O(1) (all ResourceManagerV1 reads); the
    ids are read only when indexed or iterated."""

    def __init__(self, manager: CacheManager) -> None:
        self._manager = manager

    def __len__(self) -> int:
        return self._manager.num_free_device_blocks

    def __getitem__(self, index: Any) -> Any:
        return self._snapshot()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._snapshot())

    def _snapshot(self) -> list[int]:
        return self._manager.free_device_block_ids()


__all__ = [
    "AdapterCounters",
    "FastDeployMatchResult",
    "FreeBlockList",
    "fd_digests",
    "prompt_digests",
]
