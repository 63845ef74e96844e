"""fastkv transfer ids survive FastDeploy's BatchRequest merge: tagged hash values
come through the concatenation in order, and the worker regroups a merged metadata
into the scheduler's transfers; anything fastkv did not make is refused."""

from __future__ import annotations

import pytest
from fd_standins import BatchRequest, CacheLevel, CacheSwapMetadata, Request

from fastkv.integrations.fd_transfers import (
    FDCacheLevel,
    FDCacheSwapMetadata,
    fastdeploy_metadata_types,
    level_name,
    parse_merged,
    tag,
    tagged_ids,
    to_fastdeploy,
    transfer_id_of,
    transfer_ids,
)
from fastkv.metadata import CacheLevel as FastkvLevel
from fastkv.metadata import CacheSwapMetadata as FastkvSwap


def swap_in(tid: int, host: list[int], device: list[int]) -> FastkvSwap:
    hashes = [f"h{tid}{i}" for i in range(len(host))]  # FastDeploy's hashes: hex strings
    return FastkvSwap(tid, FastkvLevel.HOST, FastkvLevel.DEVICE, host, device, hashes)


def evict(tid: int, device: list[int], host: list[int]) -> FastkvSwap:
    hashes = [bytes([tid, i]) for i in range(len(device))]  # fastkv's own: digests
    return FastkvSwap(tid, FastkvLevel.DEVICE, FastkvLevel.HOST, device, host, hashes)


def test_tags_carry_the_transfer_id_and_the_hash() -> None:
    assert tag(12, "abc") == "12:abc"
    assert tag(3, b"\x01\xff") == "3:01ff"
    assert transfer_id_of("12:abc") == 12
    assert transfer_id_of("7:with:colons") == 7
    for bad in ("abc", ":abc", "-1:x", 5, None):
        with pytest.raises(ValueError, match="no fastkv transfer tag"):
            transfer_id_of(bad)


def test_a_batch_merge_keeps_every_transfer_recoverable() -> None:
    batch = BatchRequest()
    requests = []
    plans = [
        ([swap_in(4, [9, 8], [1, 2])], [evict(5, [3], [7])]),
        ([], [evict(6, [4, 5], [0, 6])]),
        ([swap_in(7, [2], [0])], []),
    ]
    for i, (swaps, evicts) in enumerate(plans):
        r = Request(f"r{i}", [1, 2, 3], 1)
        r.cache_swap_metadata = [to_fastdeploy(m, CacheSwapMetadata, CacheLevel) for m in swaps]
        r.cache_evict_metadata = [
            to_fastdeploy(m, CacheSwapMetadata, CacheLevel) for m in evicts
        ]
        batch.add_request(r)
        requests.append(r)
    assert all(r.cache_swap_metadata == [] == r.cache_evict_metadata for r in requests)
    merged_in = parse_merged(batch.cache_swap_metadata, "host", "device")
    merged_out = parse_merged(batch.cache_evict_metadata, "device", "host")
    assert merged_in.transfer_ids == (4, 7) and merged_out.transfer_ids == (5, 6)
    assert (merged_in.src_block_ids, merged_in.dst_block_ids) == ([9, 8, 2], [1, 2, 0])
    assert (merged_out.src_block_ids, merged_out.dst_block_ids) == ([3, 4, 5], [7, 0, 6])
    assert batch.cache_swap_metadata.hash_values == ["4:h40", "4:h41", "7:h70"]


def test_parse_refuses_metadata_fastkv_did_not_make() -> None:
    good = to_fastdeploy(swap_in(1, [0], [1]), CacheSwapMetadata, CacheLevel)
    assert parse_merged(None, "host", "device") is None
    with pytest.raises(ValueError, match="expected device->host"):
        parse_merged(good, "device", "host")
    untagged = CacheSwapMetadata([0], [1], CacheLevel.HOST, CacheLevel.DEVICE, ["deadbeef"])
    with pytest.raises(ValueError, match="no fastkv transfer tag"):
        parse_merged(untagged, "host", "device")
    short = CacheSwapMetadata([0, 1], [1], CacheLevel.HOST, CacheLevel.DEVICE, ["1:a", "1:b"])
    with pytest.raises(ValueError, match="block lists"):
        parse_merged(short, "host", "device")
    floats = CacheSwapMetadata([0.5], [1], CacheLevel.HOST, CacheLevel.DEVICE, ["1:a"])
    with pytest.raises(ValueError, match=r"src_block_ids\[0\]"):
        parse_merged(floats, "host", "device")
    empty = CacheSwapMetadata([], [], CacheLevel.HOST, CacheLevel.DEVICE, [])
    assert parse_merged(empty, "host", "device") is None


def test_every_tagged_id_is_found_past_a_foreign_entry() -> None:
    # A refused batch fails what fastkv put in it: copies, storage work, lookups.
    merged = CacheSwapMetadata(
        [0, 1, 2, -1, 3, -1],
        [5, 6, 7, 4, -1, -1],
        CacheLevel.DEVICE,
        CacheLevel.HOST,
        ["3:aa", "beef", "9.4:bb:h", "L11:cc", 7, "Q2.4:dd"],
    )
    assert tagged_ids(merged) == ([(3, 0), (9, 4)], [(11, 0)], [(2, 4)])
    assert tagged_ids(None) == ([], [], [])
    assert tagged_ids(CacheSwapMetadata(hash_values=object())) == ([], [], [])


def test_levels_read_from_any_spelling() -> None:
    assert level_name(CacheLevel.HOST) == "host"
    assert level_name(FDCacheLevel.DEVICE) == "device"
    assert level_name(FastkvLevel.HOST) == "host"
    assert level_name("DEVICE") == "device"
    with pytest.raises(ValueError, match="cache level"):
        level_name(3)


def test_fastdeploy_classes_are_used_when_importable(monkeypatch) -> None:
    from fd_standins import install_fake_fastdeploy

    assert fastdeploy_metadata_types() == (FDCacheSwapMetadata, FDCacheLevel)
    install_fake_fastdeploy(monkeypatch)
    assert fastdeploy_metadata_types() == (CacheSwapMetadata, CacheLevel)
    meta = to_fastdeploy(evict(2, [1], [3]), *fastdeploy_metadata_types())
    assert isinstance(meta, CacheSwapMetadata) and meta.src_type is CacheLevel.DEVICE
    assert (meta.success, meta.error_message) == (False, None)
    assert transfer_ids(meta) == [2]


def test_tags_carry_the_cache_epoch_and_parse_strictly() -> None:
    """Transfer ids restart with each cache epoch: a tag names its epoch (none
    for epoch 0, as before), and anything else than `<id>[.<epoch>]:` is
    foreign."""
    from fastkv.integrations.fd_transfers import epoch_of, split_storage, storage_tag_of
    from fastkv.metadata import MAX_EPOCH

    assert tag(12, "abc", 0) == "12:abc" and tag(12, "abc", 3) == "12.3:abc"
    assert transfer_id_of("12.3:abc") == 12
    too_big = (f"1.{MAX_EPOCH + 1}:x", f"{1 << 63}:x", "9" * 5000 + ":x", "1." + "9" * 5000)
    for bad in ("1.:x", ".3:x", "1.-3:x", "1.3.4:x", "1.²:x", "²:x", "1 :x", *too_big):
        with pytest.raises(ValueError, match="no fastkv transfer tag"):
            transfer_id_of(bad)
        assert storage_tag_of("L" + bad) is None
    assert storage_tag_of("W7.2:ab") == ("W", 7, "ab")
    assert transfer_id_of(f"{(1 << 63) - 1}.{MAX_EPOCH}:x") == (1 << 63) - 1
    assert tagged_ids(CacheSwapMetadata(hash_values=[*too_big, "²:x", "4.1:y"])) == (
        [(4, 1)],
        [],
        [],
    )
    meta = FastkvSwap(5, FastkvLevel.HOST, FastkvLevel.DEVICE, [1], [2], ["h"], epoch=3)
    merged = parse_merged(to_fastdeploy(meta, CacheSwapMetadata, CacheLevel), "host", "device")
    assert (merged.transfer_ids, merged.epoch) == ((5,), 3)
    mixed = CacheSwapMetadata(
        [0, 1], [1, 2], CacheLevel.HOST, CacheLevel.DEVICE, ["1.3:a", "2:b"]
    )
    with pytest.raises(ValueError, match="epoch 0, the entries before it of epoch 3"):
        parse_merged(mixed, "host", "device")
    stored = CacheSwapMetadata(
        [-1, 4], [6, -1], CacheLevel.DEVICE, CacheLevel.HOST, ["L1.2:a", "W2.2:b"]
    )
    assert split_storage(stored)[1].epoch == 2 and epoch_of(stored) == 2
    stored.hash_values[1] = "W2.1:b"
    with pytest.raises(ValueError, match="one step has one epoch"):
        split_storage(stored)
