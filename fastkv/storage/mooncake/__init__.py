"""Mooncake Store as a storage backend: `MooncakeBackend`, built from `MooncakeOptions`.

One concern per module: `backend` (the backend: input checks, batching, the
breaker, close; its overview docstring is the place to start), `options` (what it
is built from), `memory` (registered memory and arenas), `put` and `get` (one
batch each way), `codes` (what each Mooncake return code means).
"""

from fastkv.storage.mooncake.backend import MooncakeBackend
from fastkv.storage.mooncake.options import MooncakeConnection, MooncakeOptions

__all__ = ["MooncakeBackend", "MooncakeConnection", "MooncakeOptions"]
