"""Transfer results from every worker rank back to the scheduler, over one local
socket that only the engine's user can reach and only holders of the deployment's
secret can speak on.

An engine whose scheduler and workers are separate processes on one host (FastDeploy)
has no return path for copy results: FastDeploy v1 drops them, so a failed load can
never be recomputed. This channel is that path:

- **Where.** Everything lives in one private directory (`runtime_dir()`): mode 0700,
  owned by the engine's uid, opened without following symlinks; a directory owned by
  another user, reachable by others, or a symlink is refused, never repaired. The
  scheduler listens on `<name>.sock` there (AF_UNIX SOCK_SEQPACKET), holds
  `<name>.lock` (flock) while it is bound, and the secret may live in `<name>.key`.
  Another uid cannot reach the socket at all (the kernel refuses the path lookup),
  so it cannot queue, flood or read anything; another mount namespace does not see
  the path (unlike the abstract names of earlier versions, which are shared by
  every process of the network namespace).
- **Who.** At connect the receiver reads the peer's uid from the kernel
  (SO_PEERCRED) and drops other uids; the sender checks the receiver's uid the same
  way, so results never go to a squatter. Every message carries the connection's
  random nonce, a sequence number and an HMAC-SHA256 under a key derived from the
  deployment secret, the receiver's epoch (random per receiver, published in its
  lock file) and that nonce. A message that fails the check closes its connection; a
  recorded message cannot be replayed to another receiver, on another connection
  (a nonce is accepted once per receiver) or again on its own (sequence numbers).
- **Secret.** `$FASTKV_RESULTS_SECRET` (at least 16 bytes) when the engine and its
  workers share it through their environment; otherwise 32 random bytes in
  `<name>.key` (0600, made by the receiver before it binds, deleted when it closes;
  senders only read it, again at every connect).
- **What is parsed.** A fixed binary layout (no nesting, no recursion), at most
  `MAX_FRAME_BYTES` per message, checked before decoding; `poll()` never raises for
  anything a peer sends, and what it logs about peers is rate-limited.
- **What is carried.** TransferResults (with the positions of a storage transfer's
  failed blocks, at most MAX_FAILED_BLOCKS; more go as "every block failed") and
  storage LookupResults (the leading blocks a rank's storage holds).
- **Delivery.** Each worker rank sends `(rank, [TransferResult | LookupResult, ...])`
  (`ResultsSender.send`); what it cannot deliver yet (scheduler not bound, queue
  full, connection lost) stays queued up to a bound and goes with the next send or
  `flush`. `poll()` reads at most MESSAGES_PER_POLL messages per connection, so one
  call stays bounded however fast a worker sends. The receiver combines the ranks'
  reports with `fastkv.tp.RankResults`: a transfer comes out once every rank
  reported it, successful only if all succeeded.
- **Release.** `ResultsReceiver.close()` (idempotent) closes every connection,
  unlinks the socket, key and lock file and releases the lock at once: the next
  receiver on the same name binds immediately. Nothing relies on finalizers; a
  process forked from the scheduler drops its inherited copies so it never keeps
  the name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fastkv.config import check_int
from fastkv.metadata import LookupResult, TransferResult
from fastkv.tp import RankResults

Result = TransferResult | LookupResult

log = logging.getLogger(__name__)

RUNTIME_DIR_ENV = "FASTKV_RUNTIME_DIR"
SECRET_ENV = "FASTKV_RESULTS_SECRET"
MIN_SECRET_BYTES = 16
KEY_FILE_BYTES = 32
MAX_NAME_BYTES = 64
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

WIRE_VERSION = 3
RESULTS_PER_DATAGRAM = 32
MAX_ERROR_CHARS = 300
MAX_ERROR_BYTES = 4 * MAX_ERROR_CHARS  # UTF-8
MAX_FAILED_BLOCKS = 64  # per storage result; more are sent as "every block failed"
MAX_LOOKUP_HITS = (1 << 32) - 1
_PAYLOAD_HEAD = struct.Struct("!BIH")  # version, rank, count
_KIND_TRANSFER = 0
_KIND_LOOKUP = 1
_ROW = struct.Struct("!BqBHH")  # kind, id, success, error bytes, failed positions
_FAILED = struct.Struct("!I")  # one failed block position
_LOOKUP_ROW = struct.Struct("!BqI")  # kind, lookup_id, num_hits
_NONCE_BYTES = 16
_FRAME_HEAD = struct.Struct(f"!4s{_NONCE_BYTES}sQ")  # magic, connection nonce, sequence
_FRAME_MAGIC = b"FKR2"
_EPOCH_BYTES = 16
_MAC_BYTES = 32
MAX_FRAME_BYTES = 1 << 16
MESSAGES_PER_POLL = 256
_MAX_PAYLOAD = _PAYLOAD_HEAD.size + RESULTS_PER_DATAGRAM * (
    _ROW.size + MAX_ERROR_BYTES + MAX_FAILED_BLOCKS * _FAILED.size
)
assert _FRAME_HEAD.size + _MAX_PAYLOAD + _MAC_BYTES <= MAX_FRAME_BYTES
_CREDS = struct.Struct("iII")  # struct ucred: pid, uid, gid
_KEY_LABEL = b"fastkv-results-v2\0"


# --- names, the private directory and the secret -----------------------------------


def check_name(name: str) -> str:
    """`name` if it can name a channel: 1-64 characters of [A-Za-z0-9._-], not
    starting with a dot (it becomes file names in the private directory).

    Raises:
        ValueError: the message names the rule broken.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_BYTES:
        raise ValueError(f"name: {len(name)} characters, at most {MAX_NAME_BYTES}")
    if name.startswith(".") or not set(name) <= _NAME_CHARS:
        raise ValueError(
            f"name: {name!r} must be letters, digits, '.', '_' or '-' and not start with '.'"
        )
    return name


def runtime_dir() -> str:
    """The private directory both ends of a deployment use, the same for both as long
    as they share uid and environment:
    $FASTKV_RUNTIME_DIR, else $XDG_RUNTIME_DIR/fastkv when XDG_RUNTIME_DIR is this
    user's private directory, else /run/fastkv for root (no other user can create
    names in /run), else <tmp>/fastkv-<uid> (where another user could squat the name
    first; the channel then refuses to start and says to set $FASTKV_RUNTIME_DIR).
    """
    explicit = os.environ.get(RUNTIME_DIR_ENV)
    if explicit:
        return explicit
    uid = os.getuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if (
            st is not None
            and st.st_uid == uid
            and stat.S_ISDIR(st.st_mode)
            and not st.st_mode & 0o077
        ):
            return os.path.join(xdg, "fastkv")
    if uid == 0:
        try:
            st = os.stat("/run")
        except OSError:
            st = None
        if (
            st is not None
            and stat.S_ISDIR(st.st_mode)
            and st.st_uid == 0
            and not st.st_mode & 0o022
            and os.access("/run", os.W_OK)
        ):
            return "/run/fastkv"
    return os.path.join(tempfile.gettempdir(), f"fastkv-{uid}")


def _refuse(path: str, why: str) -> PermissionError:
    return PermissionError(
        errno.EACCES,
        f"results channel directory {path!r}: {why}; refusing it (another user could "
        f"read, forge or block results). Set ${RUNTIME_DIR_ENV} to a directory only "
        "this user can reach, the same for the engine and its workers",
    )


def open_private_dir(path: str) -> int:
    """Make (mode 0700) or open the channel directory `path`; return an O_DIRECTORY
    fd of it. Its parent must be owned by root or this uid and, if others can write
    it, sticky (so no one else can rename the directory away).

    Raises:
        PermissionError: `path` is a symlink, owned by another uid, or reachable by
            group or others; or its parent is unsafe. The message says which.
        OSError: it cannot be made (e.g. the parent does not exist).
    """
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(f"runtime_dir: must be an absolute path, got {path!r}")
    uid = os.getuid()
    parent = os.path.dirname(path.rstrip("/")) or "/"
    pst = os.stat(parent)
    if pst.st_uid not in (0, uid):
        raise _refuse(path, f"its parent is owned by uid {pst.st_uid}")
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
        raise _refuse(path, "its parent is writable by others and not sticky")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(path, "it is a symbolic link or not a directory") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise _refuse(path, f"it is owned by uid {st.st_uid}, not {uid}")
        if st.st_mode & 0o077:
            raise _refuse(path, f"mode {stat.S_IMODE(st.st_mode):#o} lets others in")
        if st.st_mode & 0o700 != 0o700:  # made under a strict umask
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _in_dir(dir_fd: int, filename: str) -> str:
    """A socket address for `filename` in the directory `dir_fd` (resolved through
    the fd itself: no path to swap, no sun_path length limit)."""
    return f"/proc/self/fd/{dir_fd}/{filename}"


def _check_private_file(fd: int, what: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            errno.EACCES,
            f"results channel {what}: must be a regular file of uid {os.getuid()} with "
            f"mode 0600, found uid {st.st_uid} mode {stat.S_IMODE(st.st_mode):#o}",
        )
    return st


def env_secret() -> bytes | None:
    """$FASTKV_RESULTS_SECRET as bytes, or None when it is not set.

    Raises:
        ValueError: it is shorter than MIN_SECRET_BYTES.
    """
    env = os.environ.get(SECRET_ENV)
    if not env:
        return None
    raw = env.encode()
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{SECRET_ENV}: {len(raw)} bytes, at least {MIN_SECRET_BYTES} are needed"
        )
    return raw


def load_secret(dir_fd: int, name: str, *, create: bool = False) -> bytes:
    """The deployment secret: $FASTKV_RESULTS_SECRET, else `<name>.key` in the private
    directory; with `create` (the receiver, holding the lock) it is made if missing:
    32 random bytes, 0600, complete before it appears under its name.

    Raises:
        ValueError: the variable is shorter than MIN_SECRET_BYTES.
        FileNotFoundError: no key file and not `create` (no receiver bound yet).
        PermissionError: the key file is not this user's private regular file.
    """
    env = env_secret()
    if env is not None:
        return env
    key_name = f"{name}.key"
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(key_name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        tmp = f".{key_name}.{os.getpid()}.{secrets.token_hex(8)}"
        wfd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
        try:
            os.fchmod(wfd, 0o600)
            os.write(wfd, secrets.token_bytes(KEY_FILE_BYTES))
            os.close(wfd)
            wfd = -1
            # a receiver killed mid-way may have left one: then that one stands
            with contextlib.suppress(FileExistsError):
                os.link(tmp, key_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            if wfd >= 0:
                os.close(wfd)
            os.unlink(tmp, dir_fd=dir_fd)
        fd = os.open(key_name, flags, dir_fd=dir_fd)
    try:
        st = _check_private_file(fd, f"key file {key_name!r}")
        data = os.read(fd, KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if st.st_size != KEY_FILE_BYTES or len(data) != KEY_FILE_BYTES:
        raise PermissionError(
            errno.EACCES,
            f"results channel key file {key_name!r}: {len(data)} bytes, expected "
            f"{KEY_FILE_BYTES}; delete it (both ends make a new one)",
        )
    return data


def connection_key(secret: bytes, epoch: bytes, nonce: bytes) -> bytes:
    """The MAC key of one connection: the secret bound to the receiver's epoch and the
    connection's nonce."""
    return hmac.new(secret, _KEY_LABEL + epoch + nonce, hashlib.sha256).digest()


def read_epoch(dir_fd: int, name: str) -> bytes | None:
    """The epoch of the receiver bound to `name`, from its lock file (None: no
    receiver has written one).

    Raises:
        PermissionError: the lock file is not this user's private regular file.
    """
    try:
        fd = os.open(f"{name}.lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        _check_private_file(fd, f"lock file {name}.lock")
        fields = os.read(fd, 128).split()
    finally:
        os.close(fd)
    try:
        epoch = bytes.fromhex(fields[1].decode())
    except (IndexError, ValueError, UnicodeDecodeError):
        return None
    return epoch if len(epoch) == _EPOCH_BYTES else None


# --- wire format -------------------------------------------------------------------


def encode(rank: int, results: Iterable[Result]) -> list[bytes]:
    """The payloads carrying one rank's results, RESULTS_PER_DATAGRAM per payload.

    A TransferResult row carries its id, success, error (cut to MAX_ERROR_CHARS
    characters) and the positions of its failed blocks (storage transfers); one
    naming more than MAX_FAILED_BLOCKS failed positions goes as "every block
    failed" (no positions, success False): the scheduler then drops the whole
    transfer, never keeps a bad block. A LookupResult row carries the lookup id and
    the leading blocks found (at most MAX_LOOKUP_HITS).

    Raises:
        ValueError: an id, position or hit count outside what the format holds.
        TypeError: an entry is neither a TransferResult nor a LookupResult.
    """
    rows = list(results)
    for i, r in enumerate(rows):
        if isinstance(r, LookupResult):
            check_int(f"results[{i}].lookup_id", r.lookup_id, 0, (1 << 63) - 1)
            check_int(f"results[{i}].num_hits", r.num_hits, 0, MAX_LOOKUP_HITS)
        elif isinstance(r, TransferResult):
            check_int(f"results[{i}].transfer_id", r.transfer_id, 0, (1 << 63) - 1)
            for j, pos in enumerate(r.failed_blocks):
                check_int(f"results[{i}].failed_blocks[{j}]", pos, 0, (1 << 32) - 1)
        else:
            raise TypeError(
                f"results[{i}]: expected TransferResult or LookupResult, got {r!r:.80}"
            )
    out = []
    for i in range(0, len(rows), RESULTS_PER_DATAGRAM):
        chunk = rows[i : i + RESULTS_PER_DATAGRAM]
        parts = [_PAYLOAD_HEAD.pack(WIRE_VERSION, rank, len(chunk))]
        for r in chunk:
            if isinstance(r, LookupResult):
                parts.append(_LOOKUP_ROW.pack(_KIND_LOOKUP, r.lookup_id, r.num_hits))
                continue
            error = r.error[:MAX_ERROR_CHARS].encode("utf-8", "replace")
            failed = tuple(r.failed_blocks)
            if len(failed) > MAX_FAILED_BLOCKS:
                failed = ()  # with success False: every block failed
            success = r.success and not r.failed_blocks
            parts.append(
                _ROW.pack(_KIND_TRANSFER, r.transfer_id, int(success), len(error), len(failed))
            )
            parts.append(error)
            parts.extend(_FAILED.pack(p) for p in failed)
        out.append(b"".join(parts))
    return out


def decode(data: bytes) -> tuple[int, list[Result]]:
    """One payload back into (rank, results). Work is bounded by the payload's size
    (at most RESULTS_PER_DATAGRAM rows, flat layout, every length checked against
    its bound before it is read).

    Raises:
        ValueError: not a payload of this format (the message says what is wrong).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"datagram: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if not _PAYLOAD_HEAD.size <= len(data) <= _MAX_PAYLOAD:
        raise ValueError(
            f"datagram: {len(data)} bytes, must be in [{_PAYLOAD_HEAD.size}, {_MAX_PAYLOAD}]"
        )
    version, rank, count = _PAYLOAD_HEAD.unpack_from(data)
    if version != WIRE_VERSION:
        raise ValueError(f"datagram: version {version}, this end speaks {WIRE_VERSION}")
    if count > RESULTS_PER_DATAGRAM:
        raise ValueError(f"datagram: {count} results, at most {RESULTS_PER_DATAGRAM}")
    offset = _PAYLOAD_HEAD.size
    results: list[Result] = []
    for i in range(count):
        if offset + 1 > len(data):
            raise ValueError(f"datagram: results[{i}] cut short")
        kind = data[offset]
        if kind == _KIND_LOOKUP:
            if offset + _LOOKUP_ROW.size > len(data):
                raise ValueError(f"datagram: results[{i}] cut short")
            _, lookup_id, hits = _LOOKUP_ROW.unpack_from(data, offset)
            offset += _LOOKUP_ROW.size
            if lookup_id < 0:
                raise ValueError(f"datagram: results[{i}] lookup id {lookup_id} < 0")
            results.append(LookupResult(lookup_id, hits))
            continue
        if kind != _KIND_TRANSFER:
            raise ValueError(f"datagram: results[{i}] kind {kind}, expected 0 or 1")
        if offset + _ROW.size > len(data):
            raise ValueError(f"datagram: results[{i}] cut short")
        _, transfer_id, success, length, num_failed = _ROW.unpack_from(data, offset)
        offset += _ROW.size
        if success > 1 or transfer_id < 0 or length > MAX_ERROR_BYTES:
            raise ValueError(f"datagram: results[{i}] is not (id >= 0, bool, short error)")
        if num_failed > MAX_FAILED_BLOCKS or (success and num_failed):
            raise ValueError(
                f"datagram: results[{i}] names {num_failed} failed blocks "
                f"(at most {MAX_FAILED_BLOCKS}, none on a success)"
            )
        end = offset + length + num_failed * _FAILED.size
        if end > len(data):
            raise ValueError(f"datagram: results[{i}] error or failed blocks cut short")
        try:
            error = data[offset : offset + length].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"datagram: results[{i}] error is not UTF-8") from None
        offset += length
        failed = tuple(
            _FAILED.unpack_from(data, offset + k * _FAILED.size)[0] for k in range(num_failed)
        )
        offset = end
        results.append(TransferResult(transfer_id, bool(success), error, failed))
    if offset != len(data):
        raise ValueError(f"datagram: {len(data) - offset} bytes after the last result")
    return rank, results


def seal(key: bytes, nonce: bytes, seq: int, payload: bytes) -> bytes:
    """One message on a connection: magic, nonce, sequence number, payload, HMAC
    (`key` = connection_key(secret, epoch, nonce))."""
    head = _FRAME_HEAD.pack(_FRAME_MAGIC, nonce, seq)
    return head + payload + hmac.new(key, head + payload, hashlib.sha256).digest()


def frame_nonce(frame: bytes) -> bytes:
    """The connection nonce a message claims (not yet verified).

    Raises:
        ValueError: too short or too long to be a message.
    """
    low, high = _FRAME_HEAD.size + _MAC_BYTES, MAX_FRAME_BYTES
    if not low <= len(frame) <= high:
        raise ValueError(f"message: {len(frame)} bytes, must be in [{low}, {high}]")
    magic, nonce, _ = _FRAME_HEAD.unpack_from(frame)
    if magic != _FRAME_MAGIC:
        raise ValueError(f"message: magic {magic!r}, expected {_FRAME_MAGIC!r}")
    return nonce


def unseal(key: bytes, frame: bytes) -> tuple[int, bytes]:
    """(sequence number, payload) of a message sealed with `key`.

    Raises:
        ValueError: not a message, or the MAC does not verify.
    """
    frame_nonce(frame)
    body, mac = frame[:-_MAC_BYTES], frame[-_MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise ValueError("message: MAC does not verify (wrong secret, forged or altered)")
    _, _, seq = _FRAME_HEAD.unpack_from(body)
    return seq, body[_FRAME_HEAD.size :]


# --- logging peers without letting them flood the log -------------------------------


class _LogLimiter:
    """At most `burst` lines per `interval_s` per kind; the next line allowed says
    how many were suppressed."""

    def __init__(self, burst: int = 5, interval_s: float = 10.0) -> None:
        self.burst = burst
        self.interval_s = interval_s
        self._window: dict[str, tuple[float, int, int]] = {}  # start, logged, suppressed

    def __call__(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        start, logged, suppressed = self._window.get(kind, (now, 0, 0))
        if now - start >= self.interval_s:
            start, logged = now, 0
        if logged >= self.burst:
            self._window[kind] = (start, logged, suppressed + 1)
            return
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        log.error(msg, *args)
        self._window[kind] = (start, logged + 1, 0)


# --- forked children drop inherited ends --------------------------------------------

_OPEN_ENDS: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for end in list(_OPEN_ENDS):
        end._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _peer_uid(sock: socket.socket) -> int:
    _, uid, _ = _CREDS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    )
    return uid


# --- the scheduler's end ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    datagrams: int
    """Messages read from connected workers (authenticated or not)."""
    results: int
    """Per-rank results accepted."""
    combined: int
    """Transfers every rank has reported (what `poll` returned)."""
    rejected_datagrams: int
    """Messages that failed the MAC, sequence, size or format check."""
    rejected_results: int
    """A rank out of range, or a transfer a rank reported twice."""
    rejected_connections: int = 0
    """Connections from another uid, or past `max_connections`."""


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    nonce: bytes = b""
    key: bytes = b""
    next_seq: int = 0
    rank: int | None = None


class ResultsReceiver:
    """The scheduler's end: binds the channel and combines the ranks' results.

    Args:
        name: the channel name, shared with every worker (see `check_name`).
        tp_size: how many ranks report each transfer.
        same_user_only: refuse connections from another uid (kept on except in
            tests of the MAC itself).
        directory: the private directory; default `runtime_dir()`.
        max_connections: connections held at once (workers reconnect after a
            scheduler restart; past the bound new ones are closed).

    Raises:
        ValueError: a bad name, tp_size or max_connections.
        PermissionError: the directory or key file is not private to this user.
        OSError: another receiver holds the name (the message names the channel and
            its pid), or binding failed.
    """

    def __init__(
        self,
        name: str,
        tp_size: int,
        *,
        same_user_only: bool = True,
        directory: str | None = None,
        max_connections: int | None = None,
    ) -> None:
        check_name(name)
        self._ranks = RankResults(tp_size)
        if max_connections is None:
            max_connections = 4 * tp_size + 16
        check_int("max_connections", max_connections, 1)
        self.name = name
        self.tp_size = tp_size
        self.max_connections = max_connections
        self.directory = directory if directory is not None else runtime_dir()
        self._uid = os.getuid() if same_user_only else None
        self._log = _LogLimiter()
        self._conns: list[_Conn] = []
        self._epoch = secrets.token_bytes(_EPOCH_BYTES)
        # One nonce per connection this receiver accepted (16 bytes each; only this
        # uid can connect, and workers reconnect only after errors).
        self._nonces_seen: set[bytes] = set()
        self._datagrams = self._results = self._combined = 0
        self._bad_datagrams = self._bad_results = self._bad_connections = 0
        self._sock: socket.socket | None = None
        self._lock_fd = -1
        self._sock_ino = -1
        self._dir_fd = open_private_dir(self.directory)
        try:
            self._lock_fd = self._take_lock()  # first: a closing one deletes its key
            self._secret = load_secret(self._dir_fd, name, create=True)
            self._sock = self._bind()
        except BaseException:
            self._release(unlink=False)
            raise
        _OPEN_ENDS.add(self)

    @property
    def path(self) -> str:
        """The socket's file path."""
        return os.path.join(self.directory, f"{self.name}.sock")

    def _take_lock(self) -> int:
        """Lock `<name>.lock` (made if missing), retrying while a closing receiver
        unlinks the file we locked; write our pid and epoch into it."""
        for _ in range(100):
            fd = self._lock_once()
            if fd >= 0:
                return fd
        raise OSError(
            errno.EAGAIN, f"results channel {self.name!r}: the lock file keeps changing"
        )

    def _lock_once(self) -> int:
        filename = f"{self.name}.lock"
        fd = os.open(
            filename,
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=self._dir_fd,
        )
        try:
            st = _check_private_file(fd, f"lock file {filename}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fields = os.pread(fd, 128, 0).decode(errors="replace").split()
                holder = fields[0] if fields else "?"
                raise OSError(
                    errno.EADDRINUSE,
                    f"results channel {self.name!r}: bound by another receiver (pid "
                    f"{holder}; if it is this process, close() the previous one). Set "
                    "FASTKV_RESULTS_CHANNEL to tell schedulers apart",
                ) from None
            try:  # the receiver we waited for unlinked it while closing: lock anew
                now = os.stat(filename, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                return -1
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {self._epoch.hex()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _bind(self) -> socket.socket:
        filename = f"{self.name}.sock"
        # left by a receiver that died: the lock says no one else uses it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(filename, dir_fd=self._dir_fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            sock.bind(_in_dir(self._dir_fd, filename))
            sock.listen(64)
            self._sock_ino = os.stat(
                filename, dir_fd=self._dir_fd, follow_symlinks=False
            ).st_ino
        except OSError as e:
            sock.close()
            raise OSError(
                e.errno, f"results channel {self.name!r}: cannot bind ({e.strerror})"
            ) from None
        return sock

    def poll(self) -> list[Result]:
        """Accept waiting workers and read every message waiting (never blocks);
        return the transfers that every rank has now reported, combined. Never
        raises for anything a peer sent: bad input is counted, logged (rate-limited)
        and its connection closed."""
        if self._sock is None:
            return []
        done: list[Result] = []
        try:
            self._accept()
        except Exception as e:  # nothing a peer does may escape
            self._log("internal", "results channel %r: accept failed: %r", self.name, e)
        for conn in list(self._conns):
            try:
                self._drain(conn, done)
            except Exception as e:  # nothing a peer sends may escape
                self._bad_datagrams += 1
                self._log(
                    "internal", "results channel %r: dropped a connection: %r", self.name, e
                )
                self._drop(conn)
        self._combined += len(done)
        return done

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of fds: try again next poll
                self._log("accept", "results channel %r: accept failed: %s", self.name, e)
                return
            try:
                sock.setblocking(False)
                uid = _peer_uid(sock)
                if self._uid is not None and uid != self._uid:
                    self._bad_connections += 1
                    self._log(
                        "uid",
                        "results channel %r: refused a connection from uid %d",
                        self.name,
                        uid,
                    )
                    sock.close()
                    continue
                if len(self._conns) >= self.max_connections:
                    self._bad_connections += 1
                    self._log(
                        "full",
                        "results channel %r: %d connections open, refused another",
                        self.name,
                        len(self._conns),
                    )
                    sock.close()
                    continue
            except OSError as e:
                self._log("accept", "results channel %r: accept failed: %s", self.name, e)
                sock.close()
                continue
            self._conns.append(_Conn(sock))

    def _drain(self, conn: _Conn, done: list[Result]) -> None:
        for _ in range(MESSAGES_PER_POLL):  # the rest waits for the next poll
            try:
                frame = conn.sock.recv(MAX_FRAME_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the worker went away
                self._drop(conn)
                return
            if not frame:  # the worker closed its end
                self._drop(conn)
                return
            self._datagrams += 1
            try:
                if not conn.key:  # the connection's first message names its nonce
                    nonce = frame_nonce(frame)
                    if nonce in self._nonces_seen:
                        raise ValueError("message: a connection nonce used before (replay)")
                    conn.nonce, conn.key = (
                        nonce,
                        connection_key(self._secret, self._epoch, nonce),
                    )
                seq, payload = unseal(conn.key, frame)
                if seq != conn.next_seq:
                    raise ValueError(f"message: sequence {seq}, expected {conn.next_seq}")
                rank, results = decode(payload)
                if conn.rank is not None and rank != conn.rank:
                    raise ValueError(f"message: rank {rank} on rank {conn.rank}'s connection")
            except ValueError as e:
                self._bad_datagrams += 1
                self._log(
                    "message", "results channel %r: closed a connection: %s", self.name, e
                )
                self._drop(conn)
                return
            if conn.next_seq == 0:
                self._nonces_seen.add(conn.nonce)
            conn.next_seq += 1
            conn.rank = rank
            for result in results:  # one at a time: a bad one spoils no other
                try:
                    combined = self._ranks.add(rank, [result])
                except ValueError as e:
                    self._bad_results += 1
                    self._log(
                        "result", "results channel %r: dropped a result: %s", self.name, e
                    )
                    continue
                self._results += 1
                done += combined

    def _drop(self, conn: _Conn) -> None:
        conn.sock.close()
        if conn in self._conns:
            self._conns.remove(conn)

    def missing(self) -> dict[tuple[str, int], list[int]]:
        """Transfers and lookups some rank has reported and others not yet:
        (kind, id) -> missing ranks (see `RankResults.missing`)."""
        return self._ranks.missing()

    def stats(self) -> ReceiverStats:
        return ReceiverStats(
            self._datagrams,
            self._results,
            self._combined,
            self._bad_datagrams,
            self._bad_results,
            self._bad_connections,
        )

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Release the name now (idempotent): unlink the socket, the key file and
        the lock file, close every connection, release the lock. A receiver made next
        on the same name binds at once (with a new key unless the secret comes from
        the environment; workers read it when they reconnect); results still unread
        are lost (workers that connect later keep theirs)."""
        if self._dir_fd < 0:
            return
        self._release(unlink=True)

    def _release(self, *, unlink: bool) -> None:
        for conn in self._conns:
            conn.sock.close()
        self._conns.clear()
        if self._sock is not None:
            if unlink:
                filename = f"{self.name}.sock"
                try:  # only our own socket: never one a later receiver bound
                    st = os.stat(filename, dir_fd=self._dir_fd, follow_symlinks=False)
                    if st.st_ino == self._sock_ino:
                        os.unlink(filename, dir_fd=self._dir_fd)
                except OSError:
                    pass
            self._sock.close()
            self._sock = None
        if self._lock_fd >= 0:
            if unlink:  # still holding the lock: no receiver can be using these
                for suffix in ("key", "lock"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{self.name}.{suffix}", dir_fd=self._dir_fd)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        _OPEN_ENDS.discard(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited copies, touch nothing shared."""
        self._release(unlink=False)


# --- a worker's end -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SenderStats:
    sent: int
    """Results delivered to the receiver's socket."""
    pending: int
    """Results waiting for the receiver (not bound yet, or its queue was full)."""
    dropped: int
    """Results dropped because more than `max_pending` were waiting."""


class ResultsSender:
    """A worker rank's end: sends its results, keeping what cannot go yet.

    Args:
        name: the channel name (see `check_name`).
        rank: this worker's tensor-parallel rank.
        max_pending: results kept while the receiver is unreachable; past it the
            oldest are dropped (logged and counted): the scheduler then never
            frees those transfers' blocks, which loses capacity, never data.
        directory: the private directory; default `runtime_dir()`.

    Raises:
        ValueError: a bad name, rank, max_pending or $FASTKV_RESULTS_SECRET.
        PermissionError: the directory is not private to this user (a squatter's
            directory is refused: results never go to another user).
    """

    def __init__(
        self,
        name: str,
        rank: int,
        *,
        max_pending: int = 1 << 16,
        directory: str | None = None,
    ) -> None:
        check_name(name)
        check_int("rank", rank, 0)
        check_int("max_pending", max_pending, 1)
        self.name = name
        self.rank = rank
        self.max_pending = max_pending
        self.directory = directory if directory is not None else runtime_dir()
        self._pending: deque[TransferResult] = deque()
        self._sent = self._dropped = 0
        self._log = _LogLimiter()
        self._conn: socket.socket | None = None
        self._key = self._nonce = b""
        self._seq = 0
        self._warned_unreachable = False
        self._closed = False
        env_secret()  # a bad variable fails here, not at every send
        self._secret = b""  # read at every connect (the receiver makes it)
        self._dir_fd = open_private_dir(self.directory)
        _OPEN_ENDS.add(self)

    def send(self, results: Iterable[Result]) -> int:
        """Queue `results` and send everything queued that the receiver takes now.

        Returns:
            How many results are still waiting.

        Raises:
            TypeError: an entry is neither a TransferResult nor a LookupResult.
            ValueError: an id, failed position or hit count the wire format cannot
                hold. Nothing is queued when it raises.
        """
        results = list(results)
        encode(self.rank, results)  # checks every entry before anything is queued
        self._pending.extend(results)
        overflow = len(self._pending) - self.max_pending
        if overflow > 0:
            for _ in range(overflow):
                self._pending.popleft()
            self._dropped += overflow
            log.error(
                "results channel %r, rank %d: dropped the %d oldest undelivered results "
                "(the scheduler has not read them; their blocks stay reserved)",
                self.name,
                self.rank,
                overflow,
            )
        return self.flush()

    def _connect(self) -> bool:
        """Connect and check the receiver is this uid; False: not reachable yet."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            sock.connect(_in_dir(self._dir_fd, f"{self.name}.sock"))
            uid = _peer_uid(sock)
        except (BlockingIOError, InterruptedError):  # its backlog is full
            sock.close()
            return False
        except (ConnectionRefusedError, FileNotFoundError):  # not bound (any more)
            sock.close()
            if not self._warned_unreachable:
                log.warning(
                    "results channel %r: no scheduler bound yet; rank %d keeps its "
                    "results and retries",
                    self.name,
                    self.rank,
                )
                self._warned_unreachable = True
            return False
        except OSError as e:
            sock.close()
            self._log(
                "connect",
                "results channel %r, rank %d: connect failed: %s",
                self.name,
                self.rank,
                e,
            )
            return False
        if uid != os.getuid():  # only root could have bound it; never hand it results
            sock.close()
            self._log(
                "uid",
                "results channel %r, rank %d: receiver runs as uid %d, not "
                "this uid; results kept",
                self.name,
                self.rank,
                uid,
            )
            return False
        # Read after connecting: the receiver wrote its epoch before it bound, and a
        # newer one can only exist once this connection's receiver closed (then the
        # send fails and the results stay queued).
        try:
            epoch = read_epoch(self._dir_fd, self.name)
        except OSError as e:
            sock.close()
            self._log("epoch", "results channel %r, rank %d: %s", self.name, self.rank, e)
            return False
        if epoch is None:
            sock.close()
            return False
        try:  # read again: the receiver makes a new key when it restarts
            self._secret = load_secret(self._dir_fd, self.name)
        except FileNotFoundError:  # its receiver closed meanwhile
            sock.close()
            return False
        except (OSError, ValueError) as e:
            sock.close()
            self._log("secret", "results channel %r, rank %d: %s", self.name, self.rank, e)
            return False
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        self._key = connection_key(self._secret, epoch, self._nonce)
        self._conn, self._seq = sock, 0
        return True

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._key, self._nonce = None, b"", b""

    def flush(self) -> int:
        """Send what is queued, oldest first, until the receiver stops taking.
        Never blocks.

        Returns:
            How many results are still waiting.
        """
        pending = self._pending
        while pending and not self._closed:
            if self._conn is None and not self._connect():
                break
            assert self._conn is not None
            batch = [pending[i] for i in range(min(RESULTS_PER_DATAGRAM, len(pending)))]
            (payload,) = encode(self.rank, batch)
            try:
                self._conn.send(seal(self._key, self._nonce, self._seq, payload))
            except (BlockingIOError, InterruptedError):  # the receiver's queue is full
                break
            except OSError as e:  # the receiver closed: reconnect at the next flush
                self._log(
                    "send",
                    "results channel %r, rank %d: connection lost (%s); results kept",
                    self.name,
                    self.rank,
                    e,
                )
                self._disconnect()
                break
            self._seq += 1
            for _ in batch:
                pending.popleft()
            self._sent += len(batch)
            self._warned_unreachable = False
        return len(pending)

    def stats(self) -> SenderStats:
        return SenderStats(self._sent, len(self._pending), self._dropped)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Try once more to send what is queued, then close (idempotent; what is left
        is lost, and logged)."""
        if self._closed:
            return
        left = self.flush()
        if left:
            log.error(
                "results channel %r, rank %d: closed with %d undelivered results",
                self.name,
                self.rank,
                left,
            )
        self._disconnect()
        self._closed = True
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        _OPEN_ENDS.discard(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: leave the parent's connection (and its sequence
        numbers) alone; this copy connects afresh when it sends."""
        self._conn, self._key, self._nonce = None, b"", b""


__all__ = [
    "MAX_ERROR_CHARS",
    "RESULTS_PER_DATAGRAM",
    "RUNTIME_DIR_ENV",
    "SECRET_ENV",
    "ReceiverStats",
    "ResultsReceiver",
    "ResultsSender",
    "SenderStats",
    "check_name",
    "connection_key",
    "decode",
    "encode",
    "env_secret",
    "frame_nonce",
    "load_secret",
    "open_private_dir",
    "read_epoch",
    "runtime_dir",
    "seal",
    "unseal",
]
