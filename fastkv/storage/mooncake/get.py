"""One batch of `MooncakeBackend` gets: the keys not held back asked in one
Mooncake call, each object verified before anything is served, and each code
read into a result.

Zero-copy (the default), each object's header lands in the call's header slot
and its segments straight in the caller's block (`batch_get_into_multi_buffers`):
Mooncake writes that memory until its call returns, so a get left behind at its
deadline keeps it in the backend's busy host ranges (`writes_host`). Staged, each
object lands in the call's staging slot and is verified as it is scattered into
the caller's block, under the call's lock and only while the caller still waits.

What a code means is tabled in fastkv.storage.mooncake.codes. Two need more than
the code: a short object also fails a multi-buffer read with -800 (a single-buffer
read answers its size), so a -800 asks the object's size (`get_size`), one key at
a time, while the deadline allows and until a fatal code shows the store failing;
and a -800 that is not a short object means the storage node holding the key is
failing, not the store: that key alone is held back (`KeyQuarantine`) for
`breaker_cooldown_s` while keys on healthy nodes are served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from fastkv.storage import _disk_io
from fastkv.storage.base import OK, BlockLayout, BlockSegments, KeyResult, KeyStatus, StorageKey
from fastkv.storage.block_header import HEADER_BYTES, expected_header
from fastkv.storage.circuit_breaker import KeyQuarantine
from fastkv.storage.deadline_pool import LEFT_BEHIND, Call
from fastkv.storage.mooncake.codes import (
    BUFFER_TOO_SMALL,
    FATAL_CODES,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    describe_status,
)
from fastkv.storage.mooncake.memory import MooncakeMemory

_MAX_QUARANTINED = 65536


class MooncakeGets:
    """How a `MooncakeBackend` reads a batch of blocks out of Mooncake.

    Args:
        store: the Mooncake store.
        layout: the blocks' segment lengths.
        ring: the key ring's bytes (`auth.ring_of`) objects are verified under.
        memory: the backend's registered memory (header slots, staging area).
        hold_s: how long a key whose read hit a failing storage node is not asked.
        count_corrupt: told how many objects a batch refused as corrupt.

    Attributes:
        writes_host: Mooncake itself writes the caller's blocks (zero-copy).
    """

    def __init__(
        self,
        store: object,
        layout: BlockLayout,
        ring: bytes,
        memory: MooncakeMemory,
        hold_s: float,
        count_corrupt: Callable[[int], None],
    ) -> None:
        self._store = store
        self._layout = layout
        self._ring = ring
        self._memory = memory
        self._staged = memory.staged
        self.writes_host = not memory.staged
        self._object_bytes = memory.object_bytes
        # Zero-copy buffer sizes per object: the header, then the block's segments
        # in either form (`BlockSegments`), told apart by their count.
        self._lengths = {
            1 + layout.num_segments: [HEADER_BYTES, *layout.segment_lengths],
            2: [HEADER_BYTES, layout.payload_bytes],
        }
        self._count_corrupt = count_corrupt
        # keys whose last read hit a failing storage node (-800): not asked for a while
        self._quarantine = KeyQuarantine(
            hold_s, "its storage node failed a read (-800) moments ago", _MAX_QUARANTINED
        )

    def prepare(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        segs: memoryview,
        arena: int,
    ) -> memoryview:
        """A get prepares nothing on the caller's thread (a put stages its objects):
        `part` is handed `segs`, the pairs each block is verified over (the
        backend's `_seal_pairs`)."""
        return segs

    def part(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        arena: int,
        deadline: float,
        call: Call,
        segs: memoryview,
    ) -> tuple[list[KeyResult], str | None]:
        """One batch of gets: the keys not held back by the quarantine in one
        Mooncake call, then each object verified (staged: scattered into the
        caller's block as it is) over its pairs in `segs` (int64s, block after
        block) and judged by _result. Returns the results and the fatal outcome
        (None if Mooncake's master answered every call)."""
        names = [k.text() for k in keys]
        held = self._quarantine.reasons(names)
        live = [j for j in range(len(keys)) if held[j] is None]
        codes = [0] * len(keys)
        got = self._objects(names, blocks, live, arena) if live else []
        for j, code in zip(live, got, strict=True):
            codes[j] = code
        results: list[KeyResult] = []
        fatal: str | None = None
        corrupt = 0
        failing: list[str] = []
        # A short object also fails a multi-buffer read with -800 (a single-buffer
        # read answers its size): ask its size, one key at a time, but only while
        # the deadline allows and until a fatal code shows the store is failing.
        ask_size = not self._staged
        row = len(segs) // len(keys)
        for j, code in enumerate(codes):
            reason = held[j]
            if reason is not None:
                results.append(KeyResult(KeyStatus.FAILED, reason))
                continue
            size = None
            if code == TRANSFER_FAIL and ask_size and time.monotonic() < deadline:
                size = self._store.get_size(names[j])
            with call.lock:  # staged: scatters into the caller's block
                if call.abandoned:
                    return [LEFT_BEHIND] * len(keys), fatal
                pairs = segs[row * j : row * (j + 1)]
                result, outcome = self._result(keys[j], pairs, arena, j, code, size)
            if outcome == "fatal":
                fatal = f"get answered {code}"
                ask_size = False
            elif outcome == "node":
                failing.append(names[j])
            corrupt += outcome == "corrupt"
            results.append(result)
        if corrupt:
            self._count_corrupt(corrupt)
        self._quarantine.hold(failing)
        return results, fatal

    def _objects(
        self,
        names: list[str],
        blocks: Sequence[BlockSegments],
        live: list[int],
        arena: int,
    ) -> list[int]:
        """One Mooncake get call for the keys in `live` (staged: each object into
        the staging area; zero-copy: its header into the arena, its segments into
        the caller's block); their codes."""
        if self._staged:
            return self._store.batch_get_into(
                [names[j] for j in live],
                [self._memory.object_addr(arena, j) for j in live],
                [self._object_bytes] * len(live),
            )
        lengths = self._lengths[1 + len(blocks[live[0]])]
        return self._store.batch_get_into_multi_buffers(
            [names[j] for j in live],
            [[self._memory.header_addr(arena, j), *(p for p, _ in blocks[j])] for j in live],
            [lengths] * len(live),
        )

    def _result(
        self,
        key: StorageKey,
        segs: memoryview,
        arena: int,
        j: int,
        code: int,
        size: int | None,
    ) -> tuple[KeyResult, str]:
        """The result of one get and its kind: "", "corrupt" (counted), "node" (the
        storage node holding it failed: quarantined) or "fatal" (the master failed:
        opens the breaker). `segs`: the pairs the block is verified over, as
        int64s (the backend's `_seal_pairs`). `size`: what get_size answered for a
        -800, if asked."""
        if code == self._object_bytes:
            want = expected_header(key, self._layout, 0)
            if self._staged:
                status = _disk_io.unstage_block(
                    self._memory.object_addr(arena, j), want, segs, self._ring
                )
            else:
                status = _disk_io.verify_block(
                    self._memory.header_view(arena, j), want, segs, self._ring
                )
            if status == _disk_io.ST_OK:
                return OK, ""
            return KeyResult(KeyStatus.MISS, f"rejected: {describe_status(status)}"), "corrupt"
        if 0 <= code < self._object_bytes:
            return KeyResult(
                KeyStatus.MISS, f"rejected: short object ({code} bytes)"
            ), "corrupt"
        if code > self._object_bytes or code == BUFFER_TOO_SMALL:
            return KeyResult(
                KeyStatus.MISS, "rejected: object larger than the block"
            ), "corrupt"
        if code == OBJECT_NOT_FOUND:
            return KeyResult(KeyStatus.MISS, "not stored"), ""
        if code == TRANSFER_FAIL and size is not None and 0 <= size != self._object_bytes:
            return (
                KeyResult(KeyStatus.MISS, f"rejected: short object ({size} bytes)"),
                "corrupt",
            )
        kind = "fatal" if code in FATAL_CODES else "node" if code == TRANSFER_FAIL else ""
        return KeyResult(KeyStatus.FAILED, f"Mooncake get answered {code}"), kind


__all__ = ["MooncakeGets"]
