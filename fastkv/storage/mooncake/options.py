"""What a `MooncakeBackend` is built from: `MooncakeOptions`, with the store's
connection settings in a `MooncakeConnection` of their own.

The connection is a group apart because it is all-or-nothing: its six fields are
the arguments of Mooncake's `setup` and nothing else reads them, and a backend
handed a store already set up (a second backend on the same store, a test's
stand-in) needs none of them. The other fields stay flat: each is one number or
switch with its own bound, read on its own (nesting them would only lengthen
every call site).

Both validate on construction, with errors that name the field, the value and the
bound. What needs the block layout or the environment (whether the staging area
holds an object per concurrent call; the key ring from `FASTKV_STORAGE_KEY_FILE`
when `auth` is None) is checked by the backend.

Example::

    options = MooncakeOptions(
        connection=MooncakeConnection("10.0.0.7:50051", local_hostname="10.0.0.9"),
        auth=StorageAuth.from_file("/etc/fastkv/storage.key"),
    )
    backend = MooncakeBackend(layout, options)
"""

from __future__ import annotations

from dataclasses import dataclass

from fastkv.storage.auth import StorageAuth

MAX_SECONDS = 600
"""The upper bound of every duration option: catches milliseconds passed as seconds."""

STAGING_CALL_BYTES = 32 << 20
"""With `staging_bytes=None` (the default), the staging area of each concurrent call:
up to `max_batch` objects of the layout, at least one (64 objects of 256 KiB: 16 MiB;
15 of 2 MiB: 32 MiB)."""


@dataclass(frozen=True, slots=True)
class MooncakeConnection:
    """Where the Mooncake client connects, and what it gives the pool.

    Attributes:
        master_address: "host:port" of mooncake_master.
        local_hostname: this client's address as the other nodes reach it.
        protocol: Mooncake's transfer protocol ("tcp", "rdma").
        device_name: the RDMA device(s) to use; "" for TCP.
        metadata_server: Mooncake's metadata service ("P2PHANDSHAKE": none, the
            nodes exchange it directly).
        segment_bytes: memory this process contributes to the pool (0: a pure
            client; the blocks then live on storage-node processes).

    Raises:
        ValueError: a field of the wrong type or out of range; the message names it.
    """

    master_address: str
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    segment_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or ":" not in self.master_address:
            raise ValueError(
                f"master_address: expected 'host:port', got {self.master_address!r}"
            )
        for name in ("local_hostname", "protocol", "device_name", "metadata_server"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"{name}: must be a str, got {value!r}")
        _check_int("segment_bytes", self.segment_bytes, 0, 1 << 50)


@dataclass(frozen=True, slots=True)
class MooncakeOptions:
    """Everything a `MooncakeBackend` is built from besides its block layout.

    Attributes:
        connection: how to set up the Mooncake store; None when the backend is
            handed a store already set up (then it is not read).
        put_retries: how often a put answered -200 (pool full) is retried.
        retry_backoff_s: pause before each retry.
        breaker_cooldown_s: how long the breaker stays open before a probe, and how
            long a key whose read hit a failing storage node is not asked again.
        breaker_max_cooldown_s: the longest the cooldown grows while probes fail.
        deadline_margin_s: how long past its deadline a call may take (see
            fastkv.storage.mooncake's docstring for the memory a call left behind
            still touches).
        max_batch: keys per Mooncake call (the deadline is checked between calls).
        max_concurrency: calls running at once (each holds max_batch header slots);
            further calls wait for a slot until their deadline.
        staging_bytes: how blocks move. None (default): staged, with a registered
            staging area of `STAGING_CALL_BYTES` per concurrent call (at most
            `max_batch` objects; at least one). Each block is gathered (header,
            then segments) into one contiguous object there and moved as one
            Mooncake buffer. Above 0: a staging area of this size, split among
            `max_concurrency` calls (at least one object each). 0: zero-copy,
            Mooncake moves the header and each segment of a block straight from
            and into the host cache (`register_host_memory` needed): the worker's
            host block is one segment, so two buffers an object. Staged stays the
            default: over TCP loopback it measured 0.80x / 0.88x of Mooncake's own
            client at 256 KiB (put / get; zero-copy 0.66x / 0.65x) and about the
            same as zero-copy at 2 MiB (0.83x / 0.82x against 0.84x / 0.85x),
            tools/bench_storage.py --only mooncake, issue 27. Each call moves at
            most as many blocks as its share of the staging area holds.
        auth: the key ring that tags every object put and verifies every object
            read. None: `FASTKV_STORAGE_KEY_FILE` when set.
        allow_unauthenticated: without a ring the backend refuses to start unless
            this is True; then objects carry a CRC only, and any client of the
            Mooncake cluster can make this backend serve KV it forged.
        verify_puts: read every object a put stored back and count it stored only
            if it verifies (see fastkv.storage.mooncake.put's docstring for the
            window it closes and its cost). False (default): an object planted in that
            window counts as stored; its reads are refused.

    Raises:
        ValueError: a field of the wrong type or out of range; the message names it.
    """

    connection: MooncakeConnection | None = None
    # failures and deadlines
    put_retries: int = 5
    retry_backoff_s: float = 0.01
    breaker_cooldown_s: float = 2.0
    breaker_max_cooldown_s: float = 4.0
    deadline_margin_s: float = 0.05
    # how blocks move
    max_batch: int = 64
    max_concurrency: int = 4
    staging_bytes: int | None = None
    # trust
    auth: StorageAuth | None = None
    allow_unauthenticated: bool = False
    verify_puts: bool = False

    def __post_init__(self) -> None:
        if self.connection is not None and not isinstance(self.connection, MooncakeConnection):
            raise ValueError(
                "connection: must be a MooncakeConnection or None, "
                f"got {type(self.connection).__name__}"
            )
        for name, low, high in (
            ("put_retries", 0, 1000),
            ("max_batch", 1, 4096),
            ("max_concurrency", 1, 256),
        ):
            _check_int(name, getattr(self, name), low, high)
        if self.staging_bytes is not None:
            _check_int("staging_bytes", self.staging_bytes, 0, 1 << 40)
        for name in (
            "retry_backoff_s",
            "breaker_cooldown_s",
            "breaker_max_cooldown_s",
            "deadline_margin_s",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value <= MAX_SECONDS
            ):
                raise ValueError(
                    f"{name}: must be in [0, {MAX_SECONDS}] seconds, got {value!r}"
                )
        if self.auth is not None and not isinstance(self.auth, StorageAuth):
            raise ValueError(
                f"auth: must be a StorageAuth or None, got {type(self.auth).__name__}"
            )
        for name in ("allow_unauthenticated", "verify_puts"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be a bool, got {value!r}")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be an int in [{low}, {high}], got {value!r}")


__all__ = ["STAGING_CALL_BYTES", "MooncakeConnection", "MooncakeOptions"]
