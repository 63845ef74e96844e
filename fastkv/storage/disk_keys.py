"""Which slots of a disk cache directory a backend may serve, must keep, or may
reuse, given its key ring and the keys the directory's blocks were signed with.

A directory records, in its metadata file, the key ids whose blocks it holds
(`key_ids`: every key that signed a block there; fastkv.storage.auth). A block is
only ever served when its tag verifies under a key of the reader's ring; what the
reader lacks the key for, it cannot check, and nothing says that block is bad: it
is kept, never overwritten, until the key comes back or the operator says to let
it go. Hence:

- A backend whose ring verifies none of the recorded keys (no ring at all: the key
  file unset, empty or missing from the environment) is refused at open, naming the
  directory, the key ids and `FASTKV_STORAGE_KEY_FILE`: one start without the key
  would otherwise reuse every slot.
- A ring that verifies some of them (the key file rolled back one version, a key
  retired) opens; the slots of the keys it lacks are held: not served, not free,
  never evicted.
- `reclaim` (`LocalDiskBackend(reclaim=True)` or `FASTKV_STORAGE_RECLAIM=1`) says
  to let them go: their slots are free, and those keys are dropped from the
  record (a later start without `reclaim` does not hold them again).

Unauthenticated blocks (key id 0) are served only by a backend without a ring;
a backend with one reuses their slots, as before. A directory written before the
record existed (no `key_ids`) holds every tagged slot the ring cannot verify, and
the recovery scan records the keys it found.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fastkv.storage.auth import ENV_KEY_FILE

ENV_RECLAIM = "FASTKV_STORAGE_RECLAIM"

INDEX, HOLD, FREE = "index", "hold", "free"


class StorageKeyMissing(ValueError):
    """The directory holds blocks signed by keys this backend's ring lacks, and
    none it can verify: opening it would give up every one of them."""


def reclaim_from_environment(env: Mapping[str, str] | None = None) -> bool:
    """`FASTKV_STORAGE_RECLAIM`: "1" reclaims, "0" or unset does not.

    Raises:
        ValueError: any other value (the message names the variable and value).
    """
    value = (os.environ if env is None else env).get(ENV_RECLAIM, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_RECLAIM}: must be 1 (reclaim) or 0, got {value!r}")
    return value == "1"


@dataclass(frozen=True, slots=True)
class SlotKeys:
    """What a backend does with a slot by the key id in its header.

    Attributes:
        ring: the key ids of the backend's ring (empty without one).
        recorded: the directory's recorded key ids; None for a directory written
            before they were recorded.
        reclaim: let go of blocks the ring cannot verify.
    """

    ring: frozenset[int]
    recorded: frozenset[int] | None
    reclaim: bool

    def check_open(self, directory: object) -> None:
        """Raises StorageKeyMissing when the ring verifies none of the recorded
        keys (and reclaim was not asked for)."""
        if self.reclaim or not self.recorded or self.recorded & self.ring:
            return
        ids = ", ".join(f"{k:#010x}" for k in sorted(self.recorded))
        have = (
            "no key ring (" + ENV_KEY_FILE + " is unset or empty)"
            if not self.ring
            else "a key ring with none of them (key ids "
            + ", ".join(f"{k:#010x}" for k in sorted(self.ring))
            + ")"
        )
        raise StorageKeyMissing(
            f"directory: {directory} holds blocks signed by key ids {ids}, and this "
            f"backend has {have}: set {ENV_KEY_FILE} to the key file that holds them "
            f"(or pass auth=StorageAuth.from_file(...)); to give those blocks up and "
            f"reuse their slots, set {ENV_RECLAIM}=1 (or pass reclaim=True)"
        )

    def verdict(self, key_id: int) -> str:
        """INDEX (the ring verifies it; 0 without a ring), HOLD (a recorded key the
        ring lacks: kept) or FREE (the slot may be reused)."""
        if (key_id in self.ring) if self.ring else key_id == 0:
            return INDEX
        if key_id == 0 or self.reclaim:
            return FREE
        if self.recorded is None or key_id in self.recorded:
            return HOLD
        return FREE  # no key of this directory's ever made it: forged or reclaimed

    def to_record(self, found: Iterable[int] = ()) -> list[int]:
        """The key ids the directory's metadata should list: the recorded ones
        (less those reclaimed), the ring's signing key, and `found` (key ids the
        scan indexed or held)."""
        keep = set(self.recorded or ())
        if self.reclaim:
            keep &= self.ring
        return sorted(keep | set(found) - {0})


__all__ = [
    "ENV_RECLAIM",
    "FREE",
    "HOLD",
    "INDEX",
    "SlotKeys",
    "StorageKeyMissing",
    "reclaim_from_environment",
]
