"""What Mooncake Store's return codes mean to `MooncakeBackend`, and the words its
results give for a block that fails verification.

Return codes, as measured on mooncake-transfer-engine-non-cuda 0.3.13.post1:

    put   0, -705 (exists)      stored (an existing key keeps its old value); -705
                                answers ALREADY_STORED once the stored object
                                verifies (fastkv.storage.mooncake.put)
  upsert  0                     stored, replacing any object under the key (any
                                size, read lease or not): staged puts
          -200 (pool full)      retried with a short backoff, at most `put_retries`
                                times and never past the deadline; then FAILED
    get   == object size        verified (header + checksum) -> OK, else MISS (corrupt)
          0 < n < size          short object -> MISS (corrupt)
          -600                  object larger than the block -> MISS (corrupt)
          -704                  not stored -> MISS
          -800 (transfer fail)  also what a short object gives with multi-buffer reads:
                                `get_size` tells them apart -> MISS or FAILED
                                (zero-copy reads only, while the deadline allows,
                                until a fatal code in the same call)
  remove  -706 (lease held)     refused during the read lease that every is_exist,
                                get_size and get of the key renews; a put removes
                                an object that is not its block with force=True,
                                which the lease does not hold up
                                (fastkv.storage.mooncake.put)
    any   -800 (transfer fail)  FAILED; for a get, the key is not asked again for
                                `breaker_cooldown_s` (its storage node is failing;
                                the others are not: measured, a dead node fails only
                                the keys it holds, in the same call as healthy ones)
          -900, -901            FAILED, and the circuit breaker opens (the master's
                                RPC failed: every key depends on it)
          anything else         FAILED with the code
"""

from __future__ import annotations

from fastkv.storage import _disk_io

PUT_OK = 0
OBJECT_EXISTS = -705
POOL_FULL = -200
BUFFER_TOO_SMALL = -600
OBJECT_NOT_FOUND = -704
LEASE_HELD = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
FATAL_CODES = frozenset({RPC_FAIL, RPC_TIMEOUT})
"""Codes that mean the master failed: they open the breaker (every key needs it)."""


def describe_status(status: int) -> str:
    """Why a block read back from Mooncake was refused: the words for one of
    `_disk_io`'s verification statuses."""
    return {
        _disk_io.ST_BAD_HEADER: "header mismatch",
        _disk_io.ST_BAD_CHECKSUM: "checksum mismatch",
        _disk_io.ST_BAD_MAC: "authentication tag does not verify (forged or altered)",
        _disk_io.ST_UNKNOWN_KEY: "signed by a key this backend does not hold",
        _disk_io.ST_UNAUTHENTICATED: "not authenticated, and this backend requires it",
    }.get(status, f"status {status}")


__all__ = [
    "BUFFER_TOO_SMALL",
    "FATAL_CODES",
    "LEASE_HELD",
    "OBJECT_EXISTS",
    "OBJECT_NOT_FOUND",
    "POOL_FULL",
    "PUT_OK",
    "RPC_FAIL",
    "RPC_TIMEOUT",
    "TRANSFER_FAIL",
    "describe_status",
]
