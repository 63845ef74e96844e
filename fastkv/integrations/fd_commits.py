"""The requests the FastDeploy cache manager knows, and the KV they have proven.

FastDeploy v1 puts blocks in its tree when it allocates them; fastkv commits a
request's blocks only once a token sampled after its admission proves their KV
computed (see `fd_scheduler`'s "Commits only KV that exists"). `CommitBook` keeps,
per request, what that proof needs: the FastDeploy request itself, its output count
at admission, and a limit once it was scheduled past the blocks it holds.

Not thread-safe: the cache manager adapter calls it under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from fastkv.integrations.fd_views import AdapterCounters, fd_digests
from fastkv.scheduler import CacheManager

log = logging.getLogger(__name__)


class _Tracked:
    """A request the adapter knows: the FastDeploy object, its output count at
    admission (only tokens sampled after it prove this admission's KV), and how many
    of its blocks may ever be committed (fewer once it computed past its table)."""

    __slots__ = ("commit_limit", "outputs_at_admission", "request")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.outputs_at_admission = len(request.output_token_ids)
        self.commit_limit: int | None = None


class CommitBook:
    """The FastDeploy requests admitted into fastkv's manager, and their commits.

    Args:
        manager: fastkv's cache manager the requests are admitted into.
        block_size: tokens per block.
        prefix_caching: whether anything is committed at all (FastDeploy's
            `enable_prefix_caching`).
        counters: where commit errors and uncovered computes are counted.
    """

    __slots__ = ("_block_size", "_counters", "_manager", "_prefix_caching", "_tracked")

    def __init__(
        self,
        manager: CacheManager,
        *,
        block_size: int,
        prefix_caching: bool,
        counters: AdapterCounters,
    ) -> None:
        self._manager = manager
        self._block_size = block_size
        self._prefix_caching = prefix_caching
        self._counters = counters
        self._tracked: dict[Hashable, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._tracked)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tracked

    def track(self, request: Any) -> None:
        """Know `request` from this admission on (its outputs so far prove
        nothing of it); replaces an earlier admission's record."""
        self._tracked[request.request_id] = _Tracked(request)

    def request_of(self, request_id: Hashable) -> Any | None:
        """The FastDeploy request of `request_id`, or None if not known."""
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.request

    def commit(self, request_id: Hashable) -> None:
        """Commit what the request's sampled tokens prove (nothing if not known)."""
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            self._commit(tracked)

    def commit_proven(self) -> None:
        """End of a schedule: check every known request's coverage, then commit
        what its sampled tokens prove."""
        for tracked in list(self._tracked.values()):
            self._check_coverage(tracked)
            self._commit(tracked)

    def release(self, request_id: Hashable, *, finished: bool) -> None:
        """Forget the request and finish it in the manager (if active there); a
        finished one first commits what it proved."""
        tracked = self._tracked.pop(request_id, None)
        if not self._manager.is_active(request_id):
            return
        if finished and tracked is not None:
            self._commit(tracked)
        self._manager.finish(request_id)

    def forget(self, request_id: Hashable) -> None:
        """Forget the request without finishing it in the manager (someone else
        finishes it: prefill/decode, `fd_pd`); a finished one first commits what it
        proved."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and self._manager.is_active(request_id):
            self._commit(tracked)

    def _check_coverage(self, tracked: _Tracked) -> None:
        """Once a schedule is done, every position a request has been scheduled to
        compute (`num_computed_tokens`) must lie in a block of its table. One that
        does not was computed into no block (an allocation the engine did not
        check): from the first such block on, nothing of this admission is ever
        committed, whatever blocks it holds later."""
        request = tracked.request
        rid = request.request_id
        if not self._manager.is_active(rid):
            return
        held = self._manager.num_blocks(rid)
        computed = getattr(request, "num_computed_tokens", 0) or 0
        if computed <= held * self._block_size:
            return
        if tracked.commit_limit is None or held < tracked.commit_limit:
            if tracked.commit_limit is None:
                self._counters.uncovered_computes += 1
            log.error(
                "fastkv: request %r is scheduled up to token %d but holds %d blocks; "
                "its blocks from %d on are never cached",
                rid,
                computed,
                held,
                held,
            )
            tracked.commit_limit = held

    def _commit(self, tracked: _Tracked) -> None:
        """Commit the KV a token sampled since admission proves computed."""
        request = tracked.request
        rid = request.request_id
        mgr = self._manager
        outputs = len(request.output_token_ids)
        if outputs <= tracked.outputs_at_admission or not self._prefix_caching:
            return
        if not mgr.is_active(rid) or mgr.has_pending_swap_in(rid):
            return  # committed once its swap-in's result is in
        bs = self._block_size
        try:
            hashes = request.prompt_hashes
            known = mgr.num_hashes(rid)
            if len(hashes) > known:
                mgr.append_hashes(rid, fd_digests(hashes[known:]))
            computed = len(request.prompt_token_ids) + outputs - 1
            num_blocks = min(computed // bs, len(hashes), mgr.num_blocks(rid))
            if tracked.commit_limit is not None:
                num_blocks = min(num_blocks, tracked.commit_limit)
            if num_blocks > mgr.num_committed_blocks(rid):
                mgr.commit(rid, num_computed_tokens=num_blocks * bs)
        except (ValueError, TypeError) as e:
            self._counters.commit_errors += 1
            log.error("fastkv commit(%r) failed: %s", rid, e)


__all__ = ["CommitBook"]
