"""PD tasks from the scheduler to its ranks, on the routes FastDeploy already has.

In a deployment the scheduler and every rank's worker are separate processes; the
only things that reach a worker are the step's batch (`BatchRequest`, with one
merged device-to-host `CacheSwapMetadata`) and the storage tasks the engine loop
drains every iteration (`drain_pending_prefetches` -> `prefetch_from_storage`). PD
tasks ride those, as entries of their own in `hash_values` (src and dst -1), the
way storage work does (`fd_transfers`):

    "X<rank>:<payload>"   payload: urlsafe base64 of the pickled task

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

A payload is unpickled by the worker: it is as trusted as the batch FastDeploy
itself pickles over the same engine-worker queue, and no more. Each rank runs only
the entries of its own rank.
"""

from __future__ import annotations

import base64
import binascii
import pickle
from collections.abc import Iterable
from typing import Any

PD_TASK = "X"
"""The letter that starts a PD task's `hash_values` entry."""

KINDS = ("send", "chunk", "abort", "expect", "forget")
PD_DIRECTION = "pd"
"""The `StorageMetadata.direction` of a drained task that carries PD tasks only."""


def encode(tasks: dict[int, list[tuple[str, Any]]]) -> list[str]:
    """The `hash_values` entries of each rank's tasks, in order."""
    out = []
    for rank, queue in sorted(tasks.items()):
        for task in queue:
            blob = base64.urlsafe_b64encode(pickle.dumps(task, protocol=5)).decode("ascii")
            out.append(f"{PD_TASK}{rank}:{blob}")
    return out


def is_pd_entry(entry: object) -> bool:
    return isinstance(entry, str) and entry[:1] == PD_TASK


def decode(entry: str, where: str) -> tuple[int, tuple[str, Any]]:
    """(rank, task) of one entry.

    Raises:
        ValueError: not a PD entry, or a payload that is not a fastkv task (`where`
            names the entry)."""
    head, sep, blob = entry[1:].partition(":") if is_pd_entry(entry) else ("", "", "")
    if not sep or not (head.isascii() and head.isdigit()) or len(head) > 6:
        raise ValueError(f"{where}: {entry!r:.60} is not a fastkv PD task")
    try:
        task = pickle.loads(base64.urlsafe_b64decode(blob.encode("ascii")))
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise ValueError(f"{where}: the PD task does not decode ({e})") from e
    if not (isinstance(task, tuple) and len(task) == 2 and task[0] in KINDS):
        raise ValueError(f"{where}: {task!r:.80} is not one of the PD tasks {KINDS}")
    return int(head), task


def split(meta: Any, rank: int) -> tuple[Any, list[tuple[str, Any]]]:
    """Take the PD entries out of a merged metadata (the batch's device-to-host one,
    or a drained task's).

    Returns:
        (the metadata without them, None when nothing else was in it, or `meta`
        itself when it had none or is a drained task's `StorageMetadata` with other
        entries too; this rank's tasks in order). `meta` is not changed.

    Raises:
        ValueError: a PD entry that does not decode, or whose block ids are not -1
            (nothing is returned then).
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
    mine: list[tuple[str, Any]] = []
    keep = []
    for i, (s, d, h) in enumerate(zip(src, dst, hashes, strict=True)):
        if not is_pd_entry(h):
            keep.append(i)
            continue
        if s != -1 or d != -1:
            raise ValueError(f"hash_values[{i}]: a PD task with block ids ({s}, {d}), not -1")
        r, task = decode(h, f"hash_values[{i}]")
        if r == rank:
            mine.append(task)
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


__all__ = ["KINDS", "PD_DIRECTION", "PD_TASK", "as_swap_metadata", "decode", "encode", "split"]
