"""The results channel: every worker rank's TransferResults and storage
LookupResults back to the scheduler, on one host, engine-agnostic. An engine whose
scheduler and workers are separate processes (FastDeploy) has no other return path
for copy results (FastDeploy v1 drops them, so a failed load could never be
recomputed).

Contract: each rank opens a `ResultsSender(name, rank)` and calls `send(results)`
(never blocks; what cannot go yet stays queued, bounded, and goes with the next
send or `flush`); the scheduler opens one `ResultsReceiver(name, tp_size)` and
calls `poll()` (never blocks, never raises for anything a peer sends), which
returns each transfer once every rank reported it, successful only if all did.

Trust: only the engine's user can reach the channel (a private directory,
`private_dir.py`; peers' uids checked by the kernel), and only holders of the
deployment's secret can speak on it (every message sealed with an HMAC under a
per-receiver, per-connection key, never replayable: `frames.py`). What a peer
sends is parsed from a flat, bounded layout (`protocol.py`). The ends:
`receiver.py` and `sender.py`.
"""

from fastkv.channel.private_dir import RUNTIME_DIR_ENV, SECRET_ENV, check_name, runtime_dir
from fastkv.channel.protocol import MAX_ERROR_CHARS, RESULTS_PER_DATAGRAM, Result
from fastkv.channel.receiver import ReceiverStats, ResultsReceiver
from fastkv.channel.sender import ResultsSender, SenderStats

__all__ = [
    "MAX_ERROR_CHARS",
    "RESULTS_PER_DATAGRAM",
    "RUNTIME_DIR_ENV",
    "SECRET_ENV",
    "ReceiverStats",
    "Result",
    "ResultsReceiver",
    "ResultsSender",
    "SenderStats",
    "check_name",
    "runtime_dir",
]
