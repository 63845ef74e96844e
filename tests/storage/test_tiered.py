"""device -> host -> storage -> host -> device with the real scheduler, worker and
local-disk backend: bit-exact for every dtype, fp8 scales and extra layers
included (tests/storage/tiered.py; the Mooncake run is in test_mooncake.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("paddle", reason="the worker's CacheController needs paddle")

from fastkv.storage.local_disk import LocalDiskBackend
from tests.storage.tiered import tiered_round_trip


@pytest.mark.parametrize(("dtype", "extra"), [("bfloat16", 0), ("float32", 1), ("fp8", 1)])
def test_blocks_come_back_from_disk_bit_exact(dtype: str, extra: int, tmp_path: Path) -> None:
    out = tiered_round_trip(
        lambda layout: LocalDiskBackend(tmp_path, layout, capacity_blocks=64), dtype, extra
    )
    assert out["first"] == (0, 3)  # nothing cached the first time
    assert out["storage_writes"] >= 3
    assert out["storage_hits"] == 3  # all three came back from disk, bytes checked
    assert out["again"] == (3, 3)
