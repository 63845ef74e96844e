"""One step's swap-in on a FastDeploy worker: its launch, its refusal, the counter
the runner waits on, and the retry of a failed swap-in before that wait raises.

- `StepLauncher.launch` starts the step's merged eviction and swap-in as one fastkv
  transfer each, under new local ids (see `fd_routes`). An eviction whose blocks
  were handed to the allocating request (FastDeploy allocates synchronously) is
  launched with those blocks as `reused_block_ids`, so the controller orders the
  model's writes after its reads (device-side on a GPU), whatever the runner does.
- `StepLauncher.refuse` reports a step that cannot launch (no cache yet, or the
  controller refused it) as failed, in the epoch its tags carry; its counter
  raises at every wait.
- `StepLayerCounter` is what FastDeploy's runner waits on, layer by layer; a
  failure it meets is retried first (`SwapInRetry`), and raises
  `SwapInFailedError` only when no retry loaded the blocks.

Not thread-safe: the cache controller adapter calls the launcher and the retry
under its lock (the counter's `StepHooks` take it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from fastkv.integrations.fd_config import as_timeout
from fastkv.integrations.fd_routes import ResultRoutes
from fastkv.integrations.fd_transfers import MergedTransfer
from fastkv.metadata import CacheLevel, CacheSwapMetadata, TransferResult
from fastkv.worker.transfer_manager import (
    DEFAULT_TIMEOUT,
    LayerDoneCounter,
    TransferFailedError,
)

log = logging.getLogger(__name__)


class SwapInFailedError(TransferFailedError):
    """The step's swap-in failed: `device_block_ids` hold garbage, and the requests
    reading them must not emit this step's tokens (the scheduler recomputes them).

    Attributes:
        device_block_ids: the swap-in's destination blocks (all of the step's).
        transfer_ids: the scheduler transfers it carried.
    """

    def __init__(
        self,
        transfer_id: int,
        error: str,
        device_block_ids: Iterable[int],
        transfer_ids: Iterable[int],
    ) -> None:
        super().__init__(transfer_id, error)
        self.device_block_ids = frozenset(device_block_ids)
        self.transfer_ids = tuple(transfer_ids)


class StepHooks(NamedTuple):
    """What a step's counter calls back in the cache controller adapter."""

    recover: Callable[[StepLayerCounter, float], bool]
    """Retry the counter's failed swap-in (within the timeout); whether the blocks
    are loaded now."""
    report: Callable[[], int]
    """Send the results finished so far."""


class StepLayerCounter:
    """One step's swap-in, per layer: FastDeploy's LayerDoneCounter interface over
    fastkv's (which also carries the step's write ordering).

    Args:
        hooks: the controller adapter's retry and report (see `StepHooks`).
        inner: fastkv's counter of the launched swap-in (None: never launched).
        num_layers: the layers the runner waits on.
        device_block_ids: the swap-in's destination blocks.
        transfer_ids: the scheduler transfers it carries.
        launch_error: why the step never launched (every wait raises it).
        local: the fastkv transfer it waits on (None: never launched).
        model_layers: the main model's layers (default: all of them). The wait
            for its last layer also waits for the layers after it (MTP's):
            FastDeploy's MTP proposer runs after the main model and waits for
            none of its own layers.

    Attributes:
        device_block_ids: the swap-in's destination blocks.
        transfer_ids: the scheduler transfers it carries.
    """

    def __init__(
        self,
        hooks: StepHooks,
        inner: LayerDoneCounter | None,
        num_layers: int,
        device_block_ids: Sequence[int],
        transfer_ids: Sequence[int],
        launch_error: str | None = None,
        local: CacheSwapMetadata | None = None,
        model_layers: int | None = None,
    ) -> None:
        self._hooks = hooks
        self._model_layers = num_layers if model_layers is None else model_layers
        self._inner = inner
        self.num_layers = num_layers
        self.device_block_ids = frozenset(device_block_ids)
        self.transfer_ids = tuple(transfer_ids)
        self._launch_error = launch_error
        self.local = local  # the fastkv transfer it waits on (None: never launched)
        self.recovered: bool | None = None  # None until a failure was retried

    @property
    def failed(self) -> bool:
        """The swap-in failed (as far as known now) and no retry recovered it."""
        if self.recovered:
            return False
        return self._launch_error is not None or bool(self._inner and self._inner.failed)

    def wait_for_layer(self, layer: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Wait until layer `layer` is loaded and the step's writes may start (on a
        GPU, a device-side wait of the compute stream).

        Raises:
            SwapInFailedError: the swap-in failed at or before this layer (for
                the main model's last layer: or in a layer after it).
            TransferTimeoutError: a host wait ran past `timeout`.
            IndexError: no such layer.
            ValueError: `timeout` is not None or a finite number of seconds >= 0
                (a bool is refused).
        """
        self._check_layer(layer)
        timeout = as_timeout("timeout", timeout)  # type: ignore[assignment]
        if self._launch_error is not None:
            raise self._error(self._launch_error)
        assert self._inner is not None
        if not self.recovered:
            try:
                self._inner.wait_for_layer(layer, timeout)
                if layer == self._model_layers - 1:  # the MTP layers run next
                    for extra in range(self._model_layers, self.num_layers):
                        self._inner.wait_for_layer(extra, timeout)
            except TransferFailedError as e:
                if not self._hooks.recover(self, timeout):
                    self._hooks.report()
                    raise self._error(e.error) from e
        if layer == self._model_layers - 1:  # the main model's last wait
            self._hooks.report()

    def stream_wait_for_layer(self, layer: int) -> None:
        """Make the compute stream wait for layer `layer` without blocking the host
        (failures surface in `finish_step`)."""
        self._check_layer(layer)
        if self._inner is not None:
            self._inner.stream_wait_for_layer(layer)

    def is_layer_done(self, layer: int) -> bool:
        self._check_layer(layer)
        return self._inner is None or self._inner.is_layer_done(layer)

    def is_all_done(self) -> bool:
        return self.is_layer_done(self.num_layers - 1) if self.num_layers else True

    def wait_all(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Host-wait every layer (a failure is known when this returns).

        Raises:
            SwapInFailedError, TransferTimeoutError, ValueError: as for
                `wait_for_layer`.
        """
        timeout = as_timeout("timeout", timeout)  # type: ignore[assignment]
        if self._launch_error is not None:
            raise self._error(self._launch_error)
        assert self._inner is not None
        if self.recovered:
            return
        try:
            self._inner.wait_all(timeout)
        except TransferFailedError as e:
            if not self._hooks.recover(self, timeout):
                raise self._error(e.error) from e

    def _error(self, error: str) -> SwapInFailedError:
        tid = self._inner.transfer_id if self._inner is not None else -1
        return SwapInFailedError(tid, error, self.device_block_ids, self.transfer_ids)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer: {layer} outside [0, {self.num_layers})")


class StepLauncher:
    """Launches a step's merged eviction and swap-in on fastkv's controller, or
    reports the step failed when it cannot launch.

    Args:
        routes: the rank's result routes (local ids, held-back swap-ins, sender).
        hooks: what the steps' counters call back.
        num_layers: the model's layers (a refused step's counter waits on these).
        rank: this worker's tensor-parallel rank (for the log).
    """

    __slots__ = ("_hooks", "_num_layers", "_rank", "_routes")

    def __init__(
        self, routes: ResultRoutes, hooks: StepHooks, *, num_layers: int, rank: int
    ) -> None:
        self._routes = routes
        self._hooks = hooks
        self._num_layers = num_layers
        self._rank = rank

    def launch(
        self,
        ctrl: Any,
        evict: MergedTransfer | None,
        swap: MergedTransfer | None,
        compute_stream: Any | None,
    ) -> StepLayerCounter | None:
        """Start the step's eviction and swap-in on `ctrl` (fastkv's
        CacheController); a launch the controller refuses is reported failed
        (`refuse`).

        Returns:
            The swap-in's counter, or None when the step loads nothing.
        """
        routes = self._routes
        fk_evict = self._local_evict(evict)
        fk_swap = routes.local(swap, CacheLevel.HOST, CacheLevel.DEVICE)
        evict_new = fk_evict is not None and not ctrl.is_inflight(fk_evict.transfer_id)
        try:
            counter = ctrl.submit_swap_tasks(fk_evict, fk_swap, (), compute_stream)
        except Exception as e:  # fail what did not start, never lose a result
            # A launch error after the eviction started (a CUDA error on the
            # load): the eviction still reads and writes its blocks, so its own
            # result must come, not a failure that frees its host blocks now.
            if evict_new and fk_evict is not None and ctrl.is_inflight(fk_evict.transfer_id):
                self._expect(evict, fk_evict)
                evict = None
            return self.refuse(evict, swap, f"{type(e).__name__}: {e}")
        self._expect(evict, fk_evict)
        if swap is None or fk_swap is None:
            return None
        self._expect(swap, fk_swap)
        routes.hold(fk_swap.transfer_id)  # a failure waits for the retry
        return StepLayerCounter(
            self._hooks,
            counter,
            ctrl.shape.num_layers,
            swap.dst_block_ids,
            swap.transfer_ids,
            local=fk_swap,
            model_layers=self._num_layers,
        )

    def refuse(
        self, evict: MergedTransfer | None, swap: MergedTransfer | None, why: str
    ) -> StepLayerCounter | None:
        """Report a step that cannot launch at all as failed; its swap-in's counter
        raises at every wait.

        Returns:
            That counter, or None when the step loads nothing.
        """
        error = f"not launched: {why}"
        log.error("fastkv rank %d: step %s", self._rank, error)
        self._routes.send(
            TransferResult(t, False, error, epoch=m.epoch)
            for m in (evict, swap)
            if m is not None
            for t in m.transfer_ids
        )
        if swap is None:
            return None
        return StepLayerCounter(
            self._hooks, None, self._num_layers, swap.dst_block_ids, swap.transfer_ids, error
        )

    def _local_evict(self, evict: MergedTransfer | None) -> CacheSwapMetadata | None:
        fk_evict = self._routes.local(evict, CacheLevel.DEVICE, CacheLevel.HOST)
        if fk_evict is not None and evict is not None and evict.handed_over:
            # FastDeploy allocates synchronously (reuse_evicted_blocks): a block
            # being evicted may already be the allocating request's. The
            # scheduler marks those entries (they survive BatchRequest's merge);
            # the controller orders the model's writes after their reads (and
            # after those of earlier evictions still running), whatever the
            # runner does. Backups and other evictions never hold the model up.
            fk_evict = dataclasses.replace(fk_evict, reused_block_ids=list(evict.handed_over))
        return fk_evict

    def _expect(self, merged: MergedTransfer | None, local: CacheSwapMetadata | None) -> None:
        if merged is not None and local is not None:
            self._routes.expect(local.transfer_id, merged.transfer_ids, merged.epoch)


class SwapInRetry:
    """Copies a failed swap-in again before the runner's wait on it raises.

    Args:
        routes: the rank's result routes (new ids; the held-back result).
        rank: this worker's tensor-parallel rank (for the log).

    Attributes:
        attempts: copies made again so far.
        recoveries: swap-ins a retry loaded.
    """

    __slots__ = ("_rank", "_routes", "attempts", "recoveries")

    def __init__(self, routes: ResultRoutes, *, rank: int) -> None:
        self._routes = routes
        self._rank = rank
        self.attempts = 0
        self.recoveries = 0

    def recover(
        self, counter: StepLayerCounter, ctrl: Any | None, timeout: float, *, retries: int
    ) -> bool:
        """A step's swap-in failed: copy it again, every layer, at most `retries`
        times, before the runner's wait returns. On success the scheduler hears
        that the transfer succeeded (its failure was held back); otherwise the
        failure goes on. Once decided, the counter keeps the answer.

        Args:
            counter: the step's counter.
            ctrl: fastkv's CacheController (None: the cache is gone).
            timeout: bound on all the copies' waits together.
            retries: how many copies at most.

        Returns:
            Whether the blocks are loaded now.
        """
        if counter.recovered is not None:
            return counter.recovered
        local = counter.local
        ok = False
        if local is not None and ctrl is not None:
            ok = self._copy_again(ctrl, local, timeout, retries)
        counter.recovered = ok
        if local is not None:
            self._routes.resolve(local.transfer_id, ok)
        if ok:
            self.recoveries += 1
            log.warning(
                "fastkv rank %d: a failed swap-in of %d blocks was loaded again",
                self._rank,
                len(counter.device_block_ids),
            )
        return ok

    def _copy_again(
        self, ctrl: Any, local: CacheSwapMetadata, timeout: float, retries: int
    ) -> bool:
        deadline = time.monotonic() + timeout  # all retries together: one wait's bound
        for attempt in range(retries):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "fastkv rank %d: swap-in retries stopped after %d: %.1f s passed",
                    self._rank,
                    attempt,
                    timeout,
                )
                break
            self.attempts += 1
            again = CacheSwapMetadata(
                self._routes.new_id(),
                CacheLevel.HOST,
                CacheLevel.DEVICE,
                local.src_block_ids,
                local.dst_block_ids,
            )
            try:
                ctrl.submit_swap_tasks(None, again).wait_all(left)
            except (TransferFailedError, ValueError) as e:
                log.warning(
                    "fastkv rank %d: swap-in retry %d of %d failed: %s",
                    self._rank,
                    attempt + 1,
                    retries,
                    e,
                )
                continue
            return True
        return False


__all__ = [
    "StepHooks",
    "StepLauncher",
    "StepLayerCounter",
    "SwapInFailedError",
    "SwapInRetry",
]
