"""An in-process stand-in for `MooncakeDistributedStore` (the calls MooncakeBackend
makes), for unit tests that need exact control over return codes. Objects live in a
dict; buffers are copied with ctypes. The real store is exercised by test_mooncake.py.

Codes follow mooncake.py's table: a put of an existing key keeps the old value and
answers `reput_code` (-705; the 0.3.13 store in the venv answers 0), a get of a
missing key -704, a multi-buffer get of a short object -800.
Every is_exist, get_size and get of a key takes its read lease, as the real master
does (`lease_s`, 10 s); a remove during it answers -706 unless forced.
`fail_get` / `fail_put` force a code for a key's text; `get_delay_s`,
`put_delay_s` and `exist_delay_s` block every batch get, put and is_exist (a
transfer or RPC stuck inside Mooncake).
"""

from __future__ import annotations

import ctypes
import time

from fastkv.storage.mooncake.codes import (
    BUFFER_TOO_SMALL,
    LEASE_HELD,
    OBJECT_EXISTS,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
)


class FakeMooncakeStore:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.fail_get: dict[str, int] = {}
        self.fail_put: dict[str, int] = {}
        self.get_size_calls: list[str] = []
        self.get_delay_s = 0.0
        self.put_delay_s = 0.0
        self.exist_delay_s = 0.0
        self.reput_code = OBJECT_EXISTS
        self.removed: list[str] = []
        self.lease_s = 10.0
        self._leases: dict[str, float] = {}  # key -> when its read lease ends

    def register_buffer(self, address: int, nbytes: int) -> int:
        return 0

    def close(self) -> None:
        pass

    def remove(self, name: str, force: bool = False) -> int:
        if name not in self.objects:
            return OBJECT_NOT_FOUND
        if not force and self._leases.get(name, 0.0) > time.monotonic():
            return LEASE_HELD
        self.removed.append(name)
        del self.objects[name]
        return 0

    def batch_remove(self, names: list[str], force: bool = False) -> list[int]:
        return [self.remove(n, force) for n in names]

    def _lease(self, name: str) -> None:
        if name in self.objects:
            self._leases[name] = time.monotonic() + self.lease_s

    def batch_is_exist(self, names: list[str]) -> list[int]:
        time.sleep(self.exist_delay_s)
        for n in names:
            self._lease(n)
        return [int(n in self.objects) for n in names]

    def get_size(self, name: str) -> int:
        self.get_size_calls.append(name)
        self._lease(name)
        obj = self.objects.get(name)
        return OBJECT_NOT_FOUND if obj is None else len(obj)

    def batch_put_from(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        time.sleep(self.put_delay_s)
        return [self._put(n, [p], [s]) for n, p, s in zip(names, ptrs, sizes, strict=True)]

    def batch_upsert_from(
        self, names: list[str], ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        time.sleep(self.put_delay_s)
        for n in names:
            if n not in self.fail_put:
                self.objects.pop(n, None)  # replaced whatever its size, lease or not
        return [self._put(n, [p], [s]) for n, p, s in zip(names, ptrs, sizes, strict=True)]

    def batch_put_from_multi_buffers(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        time.sleep(self.put_delay_s)
        return [self._put(n, p, s) for n, p, s in zip(names, ptrs, sizes, strict=True)]

    def batch_get_into(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        time.sleep(self.get_delay_s)
        return [
            self._get(n, [p], [s], multi=False)
            for n, p, s in zip(names, ptrs, sizes, strict=True)
        ]

    def batch_get_into_multi_buffers(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        time.sleep(self.get_delay_s)
        return [
            self._get(n, p, s, multi=True) for n, p, s in zip(names, ptrs, sizes, strict=True)
        ]

    def _put(self, name: str, ptrs: list[int], sizes: list[int]) -> int:
        if name in self.fail_put:
            return self.fail_put[name]
        if name in self.objects:
            return self.reput_code
        parts = zip(ptrs, sizes, strict=True)
        self.objects[name] = b"".join(ctypes.string_at(p, s) for p, s in parts)
        return 0

    def _get(self, name: str, ptrs: list[int], sizes: list[int], multi: bool) -> int:
        if name in self.fail_get:
            return self.fail_get[name]
        self._lease(name)
        obj = self.objects.get(name)
        if obj is None:
            return OBJECT_NOT_FOUND
        if len(obj) > sum(sizes):
            return BUFFER_TOO_SMALL
        if len(obj) < sum(sizes) and multi:
            return TRANSFER_FAIL
        off = 0
        for p, s in zip(ptrs, sizes, strict=True):
            chunk = obj[off : off + s]
            ctypes.memmove(p, chunk, len(chunk))
            off += len(chunk)
        return len(obj)


__all__ = ["FakeMooncakeStore"]
