"""FastDeploy's extend block tables (its text-to-image path), held by fastkv.

ResourceManagerV1 gives a request with `use_extend_tables` a second table once:
`request.extend_block_tables = request.block_tables[:reuse]` (a copy of the
prompt's blocks) extended with fresh blocks from `allocate_gpu_blocks(request,
n)`, and frees those fresh blocks with `recycle_gpu_blocks` after
`request_finish`. They are not positions of the request's own table: putting them
there would make fastkv's table longer than `request.block_tables`, and the next
decode allocation would be refused (and KV at those positions could be committed
as the request's).

`ExtendTables` recognises that allocation by what FastDeploy did just before it:
the request's `extend_block_tables` was replaced, since its previous allocation,
by a list that is a prefix of its `block_tables`. The blocks are then held by a
request of fastkv's own (`ExtendOf(request_id)`, no hashes, never committed or
matched); they go back to the pool when the request is released (FastDeploy's
own v1 leaks them at that point).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from fastkv.scheduler import CacheManager


@dataclass(frozen=True, slots=True)
class ExtendOf:
    """The fastkv request id holding `request_id`'s extend blocks."""

    request_id: Hashable


class ExtendTables:
    """Which requests hold extend blocks, and the allocation that gives them.

    Args:
        manager: fastkv's CacheManager.
        block_size: tokens per block.
    """

    __slots__ = ("_block_size", "_manager", "_seen")

    def __init__(self, manager: CacheManager, *, block_size: int) -> None:
        self._manager = manager
        self._block_size = block_size
        # request id -> its `extend_block_tables` list as seen at its last allocation
        self._seen: dict[Hashable, Any] = {}

    def note(self, request: Any) -> None:
        """Remember the request's extend table as it is now (every allocation of
        a request with `use_extend_tables`)."""
        if getattr(request, "use_extend_tables", False):
            self._seen[request.request_id] = getattr(request, "extend_block_tables", None)

    def is_extend(self, request: Any) -> bool:
        """Whether this allocation of `request` is FastDeploy's extend-table one."""
        if not getattr(request, "use_extend_tables", False):
            return False
        rid = request.request_id
        ext = getattr(request, "extend_block_tables", None)
        if not isinstance(ext, list) or rid not in self._seen or ext is self._seen[rid]:
            return False
        if self._manager.is_active(ExtendOf(rid)):
            return False  # FastDeploy extends once per admission
        table = list(request.block_tables or ())
        return len(ext) <= len(table) and ext == table[: len(ext)]

    def allocate(self, request: Any, num_blocks: int) -> list[int] | None:
        """`num_blocks` device blocks for the request's extend table (evictions
        they need are queued in the manager, as for any allocation), or None when
        they cannot be had now."""
        ext_id = ExtendOf(request.request_id)
        mgr = self._manager
        mgr.match(ext_id, [], 0)
        allocation = mgr.allocate(ext_id, num_tokens=num_blocks * self._block_size)
        if not allocation:
            mgr.finish(ext_id)
            return None
        self.note(request)
        return list(mgr.block_table(ext_id).block_ids)

    def release(self, request_id: Hashable) -> None:
        """Give the request's extend blocks back (it was released)."""
        self._seen.pop(request_id, None)
        ext_id = ExtendOf(request_id)
        if self._manager.is_active(ext_id):
            self._manager.finish(ext_id)

    def holds(self, request_id: Hashable) -> bool:
        """Whether the request holds extend blocks now."""
        return self._manager.is_active(ExtendOf(request_id))


__all__ = ["ExtendOf", "ExtendTables"]
