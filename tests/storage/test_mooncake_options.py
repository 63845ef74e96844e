"""What a MooncakeBackend is built from: the options' own checks, and the ones the
backend adds (those that need the block layout, the environment or the store)."""

from __future__ import annotations

import dataclasses

import pytest
from fake_mooncake import FakeMooncakeStore
from storage_helpers import LAYOUTS, TEST_AUTH

from fastkv.storage import BlockLayout
from fastkv.storage.auth import ENV_KEY_FILE
from fastkv.storage.block_header import HEADER_BYTES
from fastkv.storage.mooncake import MooncakeBackend
from fastkv.storage.mooncake.options import (
    STAGING_CALL_BYTES,
    MooncakeConnection,
    MooncakeOptions,
)

LAYOUT = LAYOUTS["fp8"]
OBJECT_BYTES = HEADER_BYTES + LAYOUT.payload_bytes


def test_defaults_are_the_documented_ones() -> None:
    options = MooncakeOptions()
    assert options.connection is None and options.auth is None
    assert (options.put_retries, options.retry_backoff_s) == (5, 0.01)
    assert (options.breaker_cooldown_s, options.breaker_max_cooldown_s) == (2.0, 4.0)
    assert options.deadline_margin_s == 0.05
    assert (options.max_batch, options.max_concurrency, options.staging_bytes) == (64, 4, None)
    assert options.allow_unauthenticated is False and options.verify_puts is False
    connection = MooncakeConnection("10.0.0.7:50051")
    assert (connection.local_hostname, connection.protocol) == ("127.0.0.1", "tcp")
    assert (connection.device_name, connection.metadata_server) == ("", "P2PHANDSHAKE")
    assert connection.segment_bytes == 0


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        MooncakeOptions().max_batch = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        MooncakeConnection("h:1").master_address = "g:2"  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("put_retries", -1, r"put_retries: must be an int in \[0, 1000\], got -1"),
        ("put_retries", 1001, r"put_retries: must be an int in \[0, 1000\], got 1001"),
        ("put_retries", True, r"put_retries: must be an int in \[0, 1000\], got True"),
        ("max_batch", 0, r"max_batch: must be an int in \[1, 4096\], got 0"),
        ("max_batch", 2.0, r"max_batch: must be an int in \[1, 4096\], got 2.0"),
        ("max_concurrency", 257, r"max_concurrency: must be an int in \[1, 256\], got 257"),
        ("staging_bytes", -1, r"staging_bytes: must be an int in \[0, 1099511627776\]"),
        ("retry_backoff_s", -0.1, r"retry_backoff_s: must be in \[0, 600\] seconds, got -0.1"),
        ("breaker_cooldown_s", 601, r"breaker_cooldown_s: must be in \[0, 600\] seconds"),
        ("breaker_max_cooldown_s", float("nan"), r"breaker_max_cooldown_s: .* got nan"),
        ("deadline_margin_s", "0.05", r"deadline_margin_s: .* seconds, got '0.05'"),
        ("deadline_margin_s", True, r"deadline_margin_s: .* seconds, got True"),
        ("auth", b"secret", r"auth: must be a StorageAuth or None, got bytes"),
        ("allow_unauthenticated", 1, r"allow_unauthenticated: must be a bool, got 1"),
        ("verify_puts", "yes", r"verify_puts: must be a bool, got 'yes'"),
        ("connection", "h:1", r"connection: must be a MooncakeConnection or None, got str"),
    ],
)
def test_a_bad_option_is_refused_by_name_value_and_bound(
    field: str, value: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        MooncakeOptions(**{field: value})


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("master_address", "", r"master_address: expected 'host:port', got ''"),
        ("master_address", None, r"master_address: expected 'host:port', got None"),
        ("local_hostname", 7, r"local_hostname: must be a str, got 7"),
        ("protocol", None, r"protocol: must be a str, got None"),
        ("segment_bytes", -1, r"segment_bytes: must be an int in \[0, 1125899906842624\]"),
    ],
)
def test_a_bad_connection_is_refused_by_name_value_and_bound(
    field: str, value: object, match: str
) -> None:
    kw: dict[str, object] = {"master_address": "127.0.0.1:50051", field: value}
    with pytest.raises(ValueError, match=match):
        MooncakeConnection(**kw)  # type: ignore[arg-type]


def test_the_backend_checks_what_needs_the_layout_the_environment_or_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = FakeMooncakeStore()
    with pytest.raises(ValueError, match="options: must be a MooncakeOptions, got dict"):
        MooncakeBackend(LAYOUT, {"auth": TEST_AUTH}, store=store)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout: must be a BlockLayout, got tuple"):
        MooncakeBackend((1, 2), MooncakeOptions(auth=TEST_AUTH), store=store)  # type: ignore[arg-type]
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    with pytest.raises(ValueError, match="allow_unauthenticated=True"):
        MooncakeBackend(LAYOUT, MooncakeOptions(), store=store)
    with pytest.raises(ValueError, match="connection: None, and no store was given"):
        MooncakeBackend(LAYOUT, MooncakeOptions(auth=TEST_AUTH))
    small = MooncakeOptions(auth=TEST_AUTH, staging_bytes=4 * OBJECT_BYTES - 1)
    with pytest.raises(
        ValueError,
        match=rf"staging_bytes: {4 * OBJECT_BYTES - 1} holds less than one {OBJECT_BYTES}"
        rf"-byte object per concurrent call \(4\); give at least {4 * OBJECT_BYTES}",
    ):
        MooncakeBackend(LAYOUT, small, store=store)
    # staged: a call moves at most what its share of the staging area holds
    staged = MooncakeOptions(auth=TEST_AUTH, staging_bytes=4 * 2 * OBJECT_BYTES)
    backend = MooncakeBackend(LAYOUT, staged, store=store)
    assert backend.staged and backend.max_batch == 2 and backend.options is staged
    backend.close()
    plain = MooncakeBackend(LAYOUT, MooncakeOptions(allow_unauthenticated=True), store=store)
    assert plain.auth is None and plain.staged and plain.max_batch == 64  # staged by default
    plain.close()
    zero_copy = MooncakeOptions(auth=TEST_AUTH, staging_bytes=0)
    zero_copy_backend = MooncakeBackend(LAYOUT, zero_copy, store=store)
    assert not zero_copy_backend.staged and zero_copy_backend.max_batch == 64
    zero_copy_backend.close()


def test_the_default_staging_area_holds_what_fits_its_share() -> None:
    """Issue 27: the default is staged (one contiguous Mooncake buffer per block),
    each call's share `STAGING_CALL_BYTES`, at most max_batch objects, at least one."""
    store = FakeMooncakeStore()
    big = BlockLayout((STAGING_CALL_BYTES // 3,) * 4)  # larger than a share: one object
    for layout, want in ((LAYOUT, 64), (big, 1)):
        backend = MooncakeBackend(layout, MooncakeOptions(auth=TEST_AUTH), store=store)
        assert backend.staged and backend.max_batch == want
        backend.close()
    backend = MooncakeBackend(LAYOUT, MooncakeOptions(auth=TEST_AUTH, max_batch=8), store=store)
    assert backend.max_batch == 8
    backend.close()
