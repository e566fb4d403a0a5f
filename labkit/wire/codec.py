"""The wire format between the kernel and its ranks (runs on both sides).

A message is a dict. On the wire it is a ZeroMQ multipart message:

    [signature, header, buffer_0, buffer_1, ...]

- `header` is the dict pickled with protocol 5; tensors and numpy arrays inside it are pickled
  out of band, so their bytes travel as raw `buffer_i` frames (no copy into a byte string).
  A message of plain values (dicts, lists, str, numbers; tensors that travel as frames) is
  pickled by the C pickler alone; one with anything else (a function or class from a cell, a
  user's object) by cloudpickle, which carries what was defined in a cell by value.
- `signature` is a 16-byte nonce followed by a 16-byte tag over the length and bytes of every
  other frame, made with the lab key (32 random bytes known only to the kernel and its ranks).
  A message of up to `SMALL_BYTES` (every request and reply without a large value) is tagged
  with keyed BLAKE2b(nonce + frames), a MAC by design and CPython's own C code: the cheapest
  path for the messages every cell sends. A larger one gets a Poly1305 tag whose one-time key
  is HMAC-SHA256(lab key, nonce): Poly1305 runs at several GB/s, so signing a 16 MB tensor
  costs a few milliseconds (HMAC-SHA256 or BLAKE2b alone would cost ~10-20). Both sides pick
  the scheme from the frames' total size, which the tag covers.
  `Codec.decode` checks the tag (constant-time compare) before anything is unpickled; a message
  that fails is rejected with `AuthenticationError` and never unpickled.
- The nonce is the sender's random 8-byte id (new in each `Codec` and each process) and its
  message counter. Each receiving `Codec` remembers, per sender, the highest counter and which
  of the `REPLAY_WINDOW` below it it has seen (a bit mask, as IPsec does), so a captured
  message sent again is rejected as a replay, before it is unpickled (`MAX_SENDERS` senders
  are remembered: a lab's kernel and ranks over many restarts). The window tolerates
  messages from one sender arriving out of order over two sockets (ctrl and side).

A large tensor (`labkit.wire.shm.MIN_BYTES` or more) in a message to one receiver on the same
machine travels through a shared-memory segment instead of a frame, when the codec has a
segment directory (forked labs): only the segment's path is in the signed header
(`labkit.wire.shm`). A codec with a `pool` (a rank's) reuses its segments once the receiver
has freed them (`shm.Pool`).

Every message has a `type`; the messages and their fields are defined once, in
`labkit.wire.messages`.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import cloudpickle
from cryptography.hazmat.primitives.poly1305 import Poly1305

from labkit.wire import shm

KEY_BYTES = 32
NONCE_BYTES = 16
SENDER_BYTES = 8
SMALL_BYTES = 64 * 1024  # messages up to this size are tagged with keyed BLAKE2b
REPLAY_WINDOW = 4096  # messages a sender may send between two that arrive out of order
MAX_SENDERS = 256  # senders remembered (the least recently heard of is forgotten first)


class AuthenticationError(Exception):
    """A message whose signature does not match the lab's key (it was not unpickled)."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def _rebuild_tensor(
    buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool, is_param: bool = False
) -> Any:
    import torch

    raw = memoryview(buf).cast("B")
    dt = getattr(torch, dtype)
    if raw.nbytes == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        # The buffer is a received frame that nothing else holds; torch warns about any
        # read-only buffer, but this memory is the message's own heap copy.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _reduce_tensor(pickler: Any, obj: Any, torch: Any) -> Any:
    """A tensor as (dtype, shape, raw bytes out of band), always on the CPU, or (with the
    pickler's `shm_dir`, `shm.MIN_BYTES` or more) through a shared-memory segment."""
    nbytes = obj.numel() * obj.element_size()
    to_shm = pickler.shm_dir is not None and nbytes >= shm.MIN_BYTES
    if to_shm and isinstance(pickler, _PlainPickler):  # before any copy (a GPU tensor's to the
        raise _NotPlain  # CPU): the segment is written once, by cloudpickle's pickler
    t = obj.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_sparse or t.is_quantized or t.layout != torch.strided:
        return NotImplemented
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    is_param = type(obj) is not torch.Tensor
    if to_shm:
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        pooled = False
        try:
            if pickler.pool is not None:
                path, pooled = pickler.pool.write(pickler.shm_dir, raw)
            else:
                path = shm.write(pickler.shm_dir, raw)
        except OSError:  # /dev/shm full or gone: the socket still works
            path = None
        if path is not None:
            if pickler.kept is not None:
                pickler.kept.append(path)
            unlink = pickler.kept is None
            shape = tuple(t.shape)
            args = (path, nbytes, dtype, shape, obj.requires_grad, is_param, unlink)
            if not pooled:
                return shm.rebuild_tensor, args
            # one receiver gives it back (`recycle`); several each hold it (`hold`)
            return shm.rebuild_tensor, (*args, unlink, not unlink)
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    buf = pickle.PickleBuffer(raw) if t.numel() else b""
    return _rebuild_tensor, (buf, dtype, tuple(t.shape), obj.requires_grad, is_param)


class _NotPlain(Exception):
    """The message holds something the C pickler alone should not pickle."""


class _PlainPickler(pickle.Pickler):
    """The C pickler for messages of plain values: the C code handles dicts, lists, tuples,
    str, bytes and numbers without calling back; a tensor that travels as a frame is reduced
    here; anything else (a function or class from a cell, a user's object, a tensor bound for
    shared memory) raises `_NotPlain`, and the message goes to `_Pickler` instead."""

    shm_dir: str | None = None

    def reducer_override(self, obj: Any) -> Any:
        if obj is _rebuild_tensor:  # what a reduced tensor names: pickled by reference
            return NotImplemented
        torch = _torch_if_loaded()
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            reduced = _reduce_tensor(self, obj, torch)
            if reduced is not NotImplemented:
                return reduced
        raise _NotPlain


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with tensors reduced by `_reduce_tensor`.

    cloudpickle carries functions and classes defined in a cell by value. With `shm_dir`, a
    tensor of `shm.MIN_BYTES` or more is written into a shared-memory segment there instead.
    """

    def __init__(
        self,
        *args: Any,
        shm_dir: str | None = None,
        kept: list[str] | None = None,
        pool: shm.Pool | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.shm_dir = shm_dir
        self.kept = kept  # given: the segments are the sender's to settle (several receivers)
        self.pool = pool  # given: segments are reused (a `shm.Shared` pool with `kept`)

    def reducer_override(self, obj: Any) -> Any:
        torch = _torch_if_loaded()
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            reduced = _reduce_tensor(self, obj, torch)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def _torch_if_loaded() -> Any:
    # The kernel never imports torch just to encode a message; a tensor can only be present if
    # torch was imported already.
    import sys

    return sys.modules.get("torch")


def dumps(
    obj: Any,
    shm_dir: str | None = None,
    kept: list[str] | None = None,
    pool: shm.Pool | None = None,
) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    plain = _PlainPickler(out, protocol=5, buffer_callback=buffers.append)
    plain.shm_dir = shm_dir
    try:
        plain.dump(obj)
        return out.getvalue(), buffers
    except _NotPlain:
        buffers, out = [], io.BytesIO()
    _Pickler(
        out, protocol=5, buffer_callback=buffers.append, shm_dir=shm_dir, kept=kept, pool=pool
    ).dump(obj)
    return out.getvalue(), buffers


class Codec:
    """Signs and verifies messages with one lab's key.

    `shm_dir`: the lab's shared-memory directory (`shm.new_dir()`), or None to send every
    tensor through the socket (ranks on other machines). `recycle`: reuse segments the one
    receiver has freed (a rank's codec: its receiver is the kernel; `shm.Pool`). `shared`:
    reuse the segments of messages to several receivers once they all let go of them (the
    kernel's codec; `shm.Shared`, settled by the sender once every receiver answered).
    """

    def __init__(self, key: bytes, shm_dir: str | None = None, recycle: bool = False):
        if len(key) < 16:
            raise ValueError(f"key must be at least 16 bytes, got {len(key)}")
        self.key = key
        # a small message's MAC starts from this state (copied, never updated): keyed BLAKE2b
        # hashes the key as its first block, and each message would pay that block again
        self._keyed = hashlib.blake2b(key=key, digest_size=16)
        self.shm_dir = shm_dir
        self.pool = shm.Pool() if recycle else None
        self.shared: shm.Shared | None = None
        self._lock = threading.Lock()
        self._pid = 0
        self._sender = b""
        self._count = 0
        self._seen: dict[bytes, tuple[int, int]] = {}  # sender -> (highest counter, bit mask)

    def _nonce(self) -> bytes:
        with self._lock:
            if self._pid != os.getpid():  # a new Codec, or a forked copy: a sender of its own
                self._pid, self._sender, self._count = os.getpid(), os.urandom(SENDER_BYTES), 0
            self._count += 1
            return self._sender + self._count.to_bytes(NONCE_BYTES - SENDER_BYTES, "little")

    def _first_time(self, nonce: bytes) -> bool:
        """Whether this (verified) nonce is new; remembers it (a sliding window per sender)."""
        sender, n = nonce[:SENDER_BYTES], int.from_bytes(nonce[SENDER_BYTES:], "little")
        with self._lock:
            top, mask = self._seen.pop(sender, (0, 0))
            if n - top >= REPLAY_WINDOW:
                top, mask = n, 1
            elif n > top:
                top, mask = n, ((mask << (n - top)) | 1) & ((1 << REPLAY_WINDOW) - 1)
            elif top - n >= REPLAY_WINDOW or mask >> (top - n) & 1:
                self._seen[sender] = (top, mask)
                return False
            else:
                mask |= 1 << (top - n)
            self._seen[sender] = (top, mask)  # last in the dict: the most recently heard of
            if len(self._seen) > MAX_SENDERS:
                del self._seen[next(iter(self._seen))]
            return True

    def _sign(self, frames: list[Any], nonce: bytes) -> bytes:
        sizes = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        if sum(sizes) <= SMALL_BYTES:
            small = self._keyed.copy()  # BLAKE2b(key=lab key) with the key's block done once
            small.update(nonce)
            for frame, size in zip(frames, sizes):
                small.update(size.to_bytes(8, "little"))
                small.update(frame)
            return nonce + small.digest()
        views = [memoryview(frame).cast("B") for frame in frames]
        mac = Poly1305(hmac.digest(self.key, nonce, "sha256"))
        for view in views:
            mac.update(view.nbytes.to_bytes(8, "little"))
            mac.update(view)
        return nonce + mac.finalize()

    def encode(
        self, msg: Mapping[str, Any], shared: bool = True, kept: list[str] | None = None
    ) -> list[Any]:
        """Sign and frame `msg`. `shared`: large tensors may go through shared memory; the
        receiver unlinks each segment when it maps it, unless `kept` is given: then the paths
        are appended to it, for the sender to settle once every receiver has replied
        (`shm.Shared.settle`, or `shm.release` without a pool)."""
        pool = self.pool if kept is None else self.shared
        header, buffers = dumps(msg, self.shm_dir if shared else None, kept, pool)
        frames: list[Any] = [header, *(b.raw() for b in buffers)]
        return [self._sign(frames, self._nonce()), *frames]

    def decode(self, frames: list[Any]) -> dict[str, Any]:
        """Verify, then unpickle. Frames may be bytes or zmq.Frame objects."""
        if len(frames) < 2:
            raise AuthenticationError(f"malformed message: {len(frames)} frame(s)")
        parts = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        signature, body = bytes(parts[0]), parts[1:]
        if len(signature) != NONCE_BYTES + 16 or not hmac.compare_digest(
            signature, self._sign(body, signature[:NONCE_BYTES])
        ):
            raise AuthenticationError(
                "message signature does not match this lab's key (forged or corrupted; from a "
                "rank, a tensor it sent back may have changed while it was being sent: a "
                "request not waited for, such as an irecv or an async_op, still writing into it)"
            )
        if not self._first_time(signature[:NONCE_BYTES]):
            raise AuthenticationError(
                "replayed message: this sender's message with this counter was received before"
            )
        return pickle.loads(body[0], buffers=body[1:])
