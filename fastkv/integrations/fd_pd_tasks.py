"""PD tasks from the scheduler to its ranks, on the routes FastDeploy already has.

In a deployment the scheduler and every rank's worker are separate processes; the
only things that reach a worker are the step's batch (`BatchRequest`, with one
merged device-to-host `CacheSwapMetadata`) and the storage tasks the engine loop
drains every iteration (`drain_pending_prefetches` -> `prefetch_from_storage`). PD
tasks ride those, as entries of their own in `hash_values` (src and dst -1), the
way storage work does (`fd_transfers`):

    "X<rank>.<seq>:<payload>"   payload: urlsafe base64 of the pickled task;
                                seq: the rank's count of tasks on that route

    ("send", PDTransferMetadata)        P: start a send, chunked (send_to_node)
    ("chunk", (epoch, id, blocks, last)) P: this step writes a chunk after which the
                                          send's first `blocks` blocks are full
    ("abort", (epoch, id))               P: start no more writes (the send settles failed)
    ("expect", PDTransferMetadata)      D: expect P's notice (wait_for_transfer_from_node)
    ("forget", (epoch, id))             D: the scheduler is done with the transfer

Routes, and why:
  - P's tasks ride the batch of the step that prefills the request (`pd_batch`,
    from fastkv's `schedule` wrapper): the worker takes a batch's tasks before that
    step's model runs, so a send starts before the layers it sends are written, and
    each chunk of a chunked prefill is announced in the batch that writes it.
  - Tasks that need no step ride the drained tasks: all of D's (D usually runs
    nothing for a request it is receiving; a notice that lands before its
    `expect` waits in the receiver), and P's start-and-abort of a send given up
    before its prefill ran (so D hears of it at once, not at its deadline).

Addressing and delivery: each rank runs only the entries of its own rank (an entry
for a rank the instance does not have is refused: no rank would run it). Each
route (batch, drain) numbers each rank's tasks 0, 1, 2, ...; a rank runs a payload
only if its entries continue its count exactly, so a payload delivered twice, or
one after a lost payload, is refused whole, naming what it expected (exactly once,
or a loud error). A payload is unpickled with only the classes a task holds
(`ALLOWED`): a forged entry naming anything else is refused before any of it is
built. It is still no more trusted than the engine-worker queue it rides, which
FastDeploy itself fills with pickles.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterable
from typing import Any

PD_TASK = "X"
"""The letter that starts a PD task's `hash_values` entry."""

KINDS = ("send", "chunk", "abort", "expect", "forget")
PD_DIRECTION = "pd"
"""The `StorageMetadata.direction` of a drained task that carries PD tasks only."""


ALLOWED = frozenset(
    {
        ("fastdeploy.cache_manager.v1.metadata", "PDTransferMetadata"),
        ("fastkv.integrations.fd_pd", "_Metadata"),  # its stand-in without FastDeploy
        ("fastkv.pd.layout", "KVLayout"),  # the D ranks' handshakes in a send
        ("fastkv.pd.layout", "TensorRegion"),
    }
)
"""The only globals a task payload may name (module, name)."""


class _TaskUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a PD task")
        return super().find_class(module, name)


def encode(tasks: dict[int, list[tuple[str, Any]]], counters: dict[int, int]) -> list[str]:
    """The `hash_values` entries of each rank's tasks, in order, numbered on from
    `counters[rank]` (the route's count, advanced here)."""
    out = []
    for rank, queue in sorted(tasks.items()):
        for task in queue:
            blob = base64.urlsafe_b64encode(pickle.dumps(task, protocol=5)).decode("ascii")
            seq = counters.get(rank, 0)
            counters[rank] = seq + 1
            out.append(f"{PD_TASK}{rank}.{seq}:{blob}")
    return out


def is_pd_entry(entry: object) -> bool:
    return isinstance(entry, str) and entry[:1] == PD_TASK


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else None


def decode(entry: str, where: str) -> tuple[int, int, tuple[str, Any]]:
    """(rank, seq, task) of one entry.

    Raises:
        ValueError: not a PD entry, or a payload that is not a fastkv task (`where`
            names the entry)."""
    head, sep, blob = entry[1:].partition(":") if is_pd_entry(entry) else ("", "", "")
    rank_text, dot, seq_text = head.partition(".")
    rank, seq = _number(rank_text), _number(seq_text)
    if not sep or not dot or rank is None or seq is None:
        raise ValueError(f"{where}: {entry!r:.60} is not a fastkv PD task")
    try:
        raw = base64.urlsafe_b64decode(blob.encode("ascii"))
        task = _TaskUnpickler(io.BytesIO(raw)).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise ValueError(f"{where}: the PD task does not decode ({e})") from e
    if not (isinstance(task, tuple) and len(task) == 2 and task[0] in KINDS):
        raise ValueError(f"{where}: {task!r:.80} is not one of the PD tasks {KINDS}")
    return rank, seq, task


def _entry(i: int, src: int, dst: int, entry: str, num_ranks: int) -> tuple[int, int, Any]:
    """decode() of hash_values[i], with -1 block ids and a rank the instance has."""
    if src != -1 or dst != -1:
        raise ValueError(f"hash_values[{i}]: a PD task with block ids ({src}, {dst}), not -1")
    r, seq, task = decode(entry, f"hash_values[{i}]")
    if r >= num_ranks:
        raise ValueError(
            f"hash_values[{i}]: a PD task for rank {r}, not in [0, {num_ranks}): "
            "no rank of this instance would run it"
        )
    return r, seq, task


def split(
    meta: Any, rank: int, num_ranks: int
) -> tuple[Any, list[tuple[int, tuple[str, Any]]]]:
    """Take the PD entries out of a merged metadata (the batch's device-to-host one,
    or a drained task's).

    Returns:
        (the metadata without them, None when nothing else was in it, or `meta`
        itself when it had none or is a drained task's `StorageMetadata` with other
        entries too; this rank's (seq, task)s in order). `meta` is not changed.

    Raises:
        ValueError: a PD entry that does not decode, whose block ids are not -1, or
            whose rank is not in [0, num_ranks) (nothing is returned then).
    """
    if meta is None:
        return None, []
    hashes = list(getattr(meta, "hash_values", None) or ())
    if not any(is_pd_entry(h) for h in hashes):
        return meta, []
    swap_shaped = hasattr(meta, "src_block_ids")  # else a drained StorageMetadata
    src = list((meta.src_block_ids if swap_shaped else meta.block_ids) or ())
    dst = list(meta.dst_block_ids or ()) if swap_shaped else src
    if not (len(src) == len(dst) == len(hashes)):
        raise ValueError(
            f"block lists: {len(src)} src ids, {len(dst)} dst ids and {len(hashes)} "
            "hash_values; fastkv metadata has one of each per entry"
        )
    mine: list[tuple[int, tuple[str, Any]]] = []
    keep = []
    for i, (s, d, h) in enumerate(zip(src, dst, hashes, strict=True)):
        if not is_pd_entry(h):
            keep.append(i)
            continue
        r, seq, task = _entry(i, s, d, h, num_ranks)
        if r == rank:
            mine.append((seq, task))
    if not keep:
        return None, mine
    if not swap_shaped:
        return meta, mine  # other entries in a PD task list: the caller refuses it
    rest = type(meta)(
        src_block_ids=[src[i] for i in keep],
        dst_block_ids=[dst[i] for i in keep],
        src_type=meta.src_type,
        dst_type=meta.dst_type,
        hash_values=[hashes[i] for i in keep],
    )
    return rest, mine


def in_order(numbered: list[tuple[int, tuple[str, Any]]], expected: int, route: str) -> int:
    """The route's count after `numbered` (this rank's (seq, task)s of one payload),
    which must continue `expected` exactly.

    Raises:
        ValueError: a task delivered before (a payload twice) or after a gap (a
            payload lost), naming the route, the seq and what was expected."""
    for seq, (kind, _) in numbered:
        if seq != expected:
            what = (
                "ran already (a payload delivered twice?)"
                if seq < expected
                else (
                    f"comes after {seq - expected} task(s) that never arrived (a payload lost?)"
                )
            )
            raise ValueError(
                f"PD task {seq} ({kind}) on the {route} route: expected task {expected}; "
                f"it {what}"
            )
        expected += 1
    return expected


def as_swap_metadata(entries: Iterable[str], swap_cls: type, levels: Any) -> Any:
    """The entries as one device-to-host metadata for a batch (src and dst -1)."""
    entries = list(entries)
    return swap_cls(
        src_block_ids=[-1] * len(entries),
        dst_block_ids=[-1] * len(entries),
        src_type=levels.DEVICE,
        dst_type=levels.HOST,
        hash_values=entries,
    )


__all__ = [
    "ALLOWED",
    "KINDS",
    "PD_DIRECTION",
    "PD_TASK",
    "as_swap_metadata",
    "decode",
    "encode",
    "in_order",
    "split",
]
