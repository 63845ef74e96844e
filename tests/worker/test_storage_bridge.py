"""The worker's storage bridge on its own (no paddle): the scheduler's storage
metadata in, results out, each request tagged by (kind, id)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from fastkv.metadata import (
    CacheLevel,
    CacheSwapMetadata,
    LookupResult,
    StorageLookup,
    TransferResult,
)
from fastkv.storage import (
    BlockLayout,
    KeyResult,
    KeyStatus,
    StorageBackend,
    StorageKey,
    StorageStats,
)
from fastkv.storage.io_engine import StorageIOEngine
from fastkv.worker.storage_bridge import HostTier, StorageBridge, Tag, TagKind

NAMESPACE = bytes(range(32))
SEGMENTS = (8, 4)  # two cache tensors
WAIT = 30.0


class MemoryBackend(StorageBackend):
    """Blocks in a dict; every call waits while `gate` is closed (a slow store)."""

    def __init__(self) -> None:
        self.layout = BlockLayout(SEGMENTS)
        self.blocks: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()

    def exists(self, keys: Sequence[StorageKey], deadline: float) -> list[bool]:
        assert self.gate.wait(WAIT)
        return [k.packed in self.blocks for k in keys]

    def get_into(self, keys, blocks, deadline) -> list[KeyResult]:
        assert self.gate.wait(WAIT)
        out = []
        for key, segments in zip(keys, blocks, strict=True):
            data = self.blocks.get(key.packed)
            if data is None:
                out.append(KeyResult(KeyStatus.MISS, "not stored"))
                continue
            offset = 0
            for address, length in segments:
                ctypes.memmove(address, data[offset : offset + length], length)
                offset += length
            out.append(KeyResult(KeyStatus.OK))
        return out

    def put_from(self, keys, blocks, deadline) -> list[KeyResult]:
        assert self.gate.wait(WAIT)
        for key, segments in zip(keys, blocks, strict=True):
            self.blocks[key.packed] = b"".join(ctypes.string_at(a, n) for a, n in segments)
        return [KeyResult(KeyStatus.OK)] * len(keys)

    def stats(self) -> StorageStats:
        return StorageStats()

    def close(self) -> None:
        pass


class Host:
    """A host tier of `n` blocks, the controller's layout: host block b is one row
    of every cache tensor's block in order; `regions` are each tensor's part."""

    def __init__(self, n: int) -> None:
        self.blocks = np.zeros((n, sum(SEGMENTS)), np.uint8)
        starts = np.cumsum([0, *SEGMENTS[:-1]])
        self.regions = [
            self.blocks[:, a : a + b] for a, b in zip(starts, SEGMENTS, strict=True)
        ]
        self.tier = HostTier(self.blocks.ctypes.data, SEGMENTS, n)

    def fill(self, block: int, seed: int) -> bytes:
        rng = np.random.default_rng(seed)
        for r in self.regions:
            r[block] = rng.integers(0, 256, r.shape[1])
        return self.read(block)

    def read(self, block: int) -> bytes:
        return b"".join(r[block].tobytes() for r in self.regions)


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def store(tid: int, host: list[int], keys: list[bytes]) -> CacheSwapMetadata:
    return CacheSwapMetadata(tid, CacheLevel.HOST, CacheLevel.STORAGE, host, [], keys)


def load(tid: int, host: list[int], keys: list[bytes]) -> CacheSwapMetadata:
    return CacheSwapMetadata(tid, CacheLevel.STORAGE, CacheLevel.HOST, [], host, keys)


@pytest.fixture
def parts():
    backend = MemoryBackend()
    host = Host(8)
    bridge = StorageBridge.open(backend, host.tier, NAMESPACE, tp_rank=1)
    yield backend, host, bridge
    backend.gate.set()
    bridge.close(WAIT)


def test_a_lookup_and_a_transfer_with_one_id_are_two_requests(parts) -> None:
    backend, host, bridge = parts
    written = [host.fill(b, seed=b) for b in (0, 1)]
    bridge.submit(None, store(7, [0, 1], [key(0), key(1)]))
    assert bridge.wait_all(WAIT) == [TransferResult(7, True, "", ())]
    assert bridge.counts.blocks_written == 2
    # Lookup 7 and transfer 7 in one step: each answers under its own kind.
    bridge.submit(load(7, [4, 5], [key(0), key(1)]), None, [StorageLookup(7, (key(0), key(9)))])
    results = bridge.wait_all(WAIT)
    assert sorted(results, key=lambda r: type(r).__name__) == [
        LookupResult(7, 1),
        TransferResult(7, True, "", ()),
    ]
    assert [host.read(4), host.read(5)] == written
    assert bridge.counts.blocks_read == 2
    assert all(k[64:] == (1).to_bytes(2, "little") for k in backend.blocks), "rank in keys"


def test_an_outstanding_tag_is_refused_and_nothing_starts(parts) -> None:
    backend, host, bridge = parts
    host.fill(0, seed=0)
    backend.gate.clear()  # the write stays outstanding
    bridge.submit(None, store(5, [0], [key(0)]))
    before = bridge.counts
    snapshot = (before.blocks_read, before.blocks_written)
    cases = [
        ((load(5, [3], [key(0)]), None, ()), "transfer_id: 5 is still outstanding"),
        ((None, None, [StorageLookup(1, (key(0),))] * 2), "lookup_id: 1 is still outstanding"),
        ((None, store("x", [1], [key(1)]), ()), "transfer_id: must be an int"),  # type: ignore[arg-type]
        ((load(6, [0], [key(0)]), None, [StorageLookup(2, (key(0),))]), "block 0 is used"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            bridge.submit(*args)
        assert (bridge.counts.blocks_read, bridge.counts.blocks_written) == snapshot
    backend.gate.set()
    assert bridge.wait_all(WAIT) == [TransferResult(5, True, "", ())]
    # The same tags are free again once reported; lookup 5 never clashed with transfer 5.
    bridge.submit(load(5, [3], [key(0)]), None, [StorageLookup(5, (key(0),))])
    assert len(bridge.wait_all(WAIT)) == 2


def test_deadlines_are_read_from_the_clock() -> None:
    backend = MemoryBackend()
    host = Host(2)
    host.fill(0, seed=0)
    long_ago = time.monotonic() - 3600.0
    bridge = StorageBridge.open(backend, host.tier, NAMESPACE, 0, clock=lambda: long_ago)
    try:
        bridge.submit(None, store(1, [0], [key(0)]))  # its deadline passed an hour ago
        (result,) = bridge.wait_all(0.0)
        assert isinstance(result, TransferResult) and not result.success
        assert "TIMEOUT" in result.error and result.failed_blocks == (0,)
        assert bridge.counts.failed_transfers == 1
    finally:
        bridge.close(WAIT)


def test_the_host_tier_and_the_backend_must_agree() -> None:
    host = Host(4)
    # One segment per host block: every tensor's block, back to back.
    assert host.tier.segments(3) == [(host.blocks.ctypes.data + 3 * 12, 12)]
    assert host.tier.layout == BlockLayout(SEGMENTS)  # the header's layout: per tensor
    with pytest.raises(ValueError, match="a block needs at least one segment"):
        HostTier(host.tier.base, (), 4)
    with pytest.raises(ValueError, match=r"segment_lengths\[1\]: must be a positive int"):
        HostTier(host.tier.base, (8, 0), 4)
    other = MemoryBackend()
    other.layout = BlockLayout((12,))
    with pytest.raises(ValueError, match=r"storage: the backend's block layout \(12,\)"):
        StorageBridge.open(other, host.tier, NAMESPACE, 0)
    with pytest.raises(ValueError, match="namespace"):
        StorageBridge.open(MemoryBackend(), host.tier, b"short", 0)
    engine = StorageIOEngine(MemoryBackend())
    try:
        with pytest.raises(ValueError, match="rank"):
            StorageBridge(engine, host.tier, NAMESPACE, -1)
    finally:
        engine.close(WAIT)


def test_tags_name_their_kind() -> None:
    assert Tag(TagKind.LOOKUP, 3) != Tag(TagKind.TRANSFER, 3)
    assert Tag(TagKind.TRANSFER, 3) == (TagKind.TRANSFER, 3, 0)  # epoch 0
    assert Tag(TagKind.TRANSFER, 3, 1) != Tag(TagKind.TRANSFER, 3)  # another epoch
