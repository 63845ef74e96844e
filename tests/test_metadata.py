"""The scheduler/worker contract: CacheSwapMetadata validates itself on construction,
and both messages survive a pickle round trip (they cross a process boundary)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from fastkv import CacheLevel, CacheSwapMetadata, TransferResult

D, H, S = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.STORAGE


@pytest.mark.parametrize("level", list(CacheLevel))
def test_equal_levels_raise(level: CacheLevel) -> None:
    with pytest.raises(ValueError, match=rf"^dst_level: equals src_level \({level.name}\)"):
        CacheSwapMetadata(0, level, level, [1], [2])


@pytest.mark.parametrize(("src", "dst"), [([1, 2], [3]), ([], [0]), ([1], [])])
def test_id_length_mismatch_raises(src: list[int], dst: list[int]) -> None:
    with pytest.raises(
        ValueError, match=rf"^dst_block_ids: length {len(dst)} != .* {len(src)}"
    ):
        CacheSwapMetadata(0, D, H, src, dst)


@pytest.mark.parametrize("hashes", [[b"a"], [b"a", b"b", b"c"]])
def test_block_hashes_length_mismatch_raises(hashes: list[bytes]) -> None:
    with pytest.raises(
        ValueError, match=rf"^block_hashes: length {len(hashes)} != block count 2"
    ):
        CacheSwapMetadata(0, H, D, [1, 2], [3, 4], hashes)


@pytest.mark.parametrize(("src", "dst"), [(D, H), (H, D)])
def test_valid_metadata(src: CacheLevel, dst: CacheLevel) -> None:
    meta = CacheSwapMetadata(7, src, dst, [1, 2, 3], [4, 5, 6], [b"x", b"y", b"z"])
    assert meta.num_blocks == 3
    assert (meta.transfer_id, meta.src_level, meta.dst_level) == (7, src, dst)


@pytest.mark.parametrize(("src", "dst"), [(H, S), (S, H), (D, S)])
def test_storage_transfers_are_keyed_by_hash_not_by_ids(src, dst) -> None:
    ids = [4, 5, 6]
    src_ids, dst_ids = ([], ids) if src == S else (ids, [])
    meta = CacheSwapMetadata(7, src, dst, src_ids, dst_ids, [b"x", b"y", b"z"], timeout_s=2)
    assert meta.num_blocks == 3 and meta.timeout_s == 2
    with pytest.raises(ValueError, match="takes no block ids"):
        CacheSwapMetadata(7, src, dst, ids, ids, [b"x", b"y", b"z"])
    with pytest.raises(ValueError, match="needs a key per block"):
        CacheSwapMetadata(7, src, dst, src_ids, dst_ids)
    with pytest.raises(ValueError, match="timeout_s"):
        CacheSwapMetadata(7, src, dst, src_ids, dst_ids, [b"x", b"y", b"z"], timeout_s=-1)
    with pytest.raises(ValueError, match=r"timeout_s: .* got True"):
        CacheSwapMetadata(7, src, dst, src_ids, dst_ids, [b"x", b"y", b"z"], timeout_s=True)


def test_block_hashes_may_be_empty() -> None:
    assert CacheSwapMetadata(0, D, H, [1, 2], [3, 4]).block_hashes == ()
    assert CacheSwapMetadata(0, D, H, [1, 2], [3, 4], []).num_blocks == 2
    assert CacheSwapMetadata(0, D, H, [], []).num_blocks == 0


def test_numpy_block_ids_are_accepted() -> None:
    meta = CacheSwapMetadata(
        1, D, H, np.arange(3, dtype=np.int64), np.arange(3, 6, dtype=np.int32), [b"a"] * 3
    )
    assert meta.num_blocks == 3
    with pytest.raises(ValueError, match="dst_block_ids"):
        CacheSwapMetadata(1, D, H, np.arange(3), np.arange(2))


def test_numpy_block_hashes_are_accepted() -> None:
    hashes = np.array([b"\x01" * 32, b"\x02" * 32], dtype="S32")
    assert CacheSwapMetadata(1, D, H, [0, 1], [2, 3], hashes).num_blocks == 2


def test_messages_are_frozen() -> None:
    meta = CacheSwapMetadata(0, D, H, [1], [2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.transfer_id = 1  # type: ignore[misc]
    result = TransferResult(0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.success = False  # type: ignore[misc]


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_swap_metadata_pickles(protocol: int) -> None:
    meta = CacheSwapMetadata(42, H, D, [5, 6, 7], [0, 1, 2], [b"\x00" * 32, b"h1", "h2"])
    back = pickle.loads(pickle.dumps(meta, protocol=protocol))
    assert back == meta
    assert type(back.src_level) is CacheLevel and back.src_level is H
    assert back.num_blocks == 3


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_swap_metadata_with_numpy_ids_pickles(protocol: int) -> None:
    meta = CacheSwapMetadata(3, D, H, np.array([4, 5], dtype=np.int64), np.array([0, 1]))
    back = pickle.loads(pickle.dumps(meta, protocol=protocol))
    assert back.transfer_id == 3
    np.testing.assert_array_equal(back.src_block_ids, [4, 5])
    np.testing.assert_array_equal(back.dst_block_ids, [0, 1])
    assert back.src_block_ids.dtype == np.int64


@pytest.mark.parametrize(
    "result", [TransferResult(1, True), TransferResult(2, False, "cudaErrorLaunchFailure")]
)
def test_transfer_result_pickles(result: TransferResult) -> None:
    back = pickle.loads(pickle.dumps(result))
    assert back == result
    assert back.error == result.error


def test_transfer_result_defaults_to_no_error() -> None:
    assert TransferResult(5, True).error == ""
