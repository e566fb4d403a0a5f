"""The wire format: signatures are checked before anything is unpickled; tensors travel raw."""

import os
import pickle

import pytest
import torch

from labkit.wire.codec import AuthenticationError, Codec, new_key
from labkit.wire.messages import Done


class Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this would create a file
        return (open, (self.path, "w"))


def test_roundtrip_tensors_out_of_band():
    codec = Codec(new_key())
    x = torch.randn(256, 256)
    msg = Done(
        type="done", id=1, error=None, value={"x": x, "p": torch.nn.Parameter(torch.ones(3))}
    )
    frames = codec.encode(msg)
    assert len(frames) >= 3  # signature, header, and at least one raw buffer
    assert sum(memoryview(f).nbytes for f in frames[2:]) >= x.numel() * 4
    out = codec.decode(frames)
    assert torch.equal(out["value"]["x"], x)
    assert isinstance(out["value"]["p"], torch.nn.Parameter)


def test_bfloat16_and_empty_and_noncontiguous():
    codec = Codec(new_key())
    vals = [torch.randn(5).to(torch.bfloat16), torch.empty(0, 3), torch.arange(12.0).view(3, 4).t()]
    out = codec.decode(codec.encode({"v": vals}))["v"]
    for a, b in zip(vals, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_wrong_key_rejected_before_unpickling(tmp_path):
    path = tmp_path / "pwned"
    evil = Codec(new_key()).encode({"x": Boom(str(path))})
    with pytest.raises(AuthenticationError):
        Codec(new_key()).decode(evil)
    assert not path.exists()


def test_tampered_buffer_rejected():
    codec = Codec(new_key())
    frames = codec.encode({"x": torch.ones(1000)})
    buf = bytearray(memoryview(frames[2]).cast("B"))
    buf[0] ^= 1
    with pytest.raises(AuthenticationError):
        codec.decode([frames[0], frames[1], bytes(buf)])


def test_unsigned_pickle_rejected(tmp_path):
    path = tmp_path / "pwned"
    with pytest.raises(AuthenticationError):
        Codec(os.urandom(32)).decode([b"\0" * 32, pickle.dumps(Boom(str(path)))])
    assert not path.exists()


def test_plain_messages_skip_cloudpickle_and_the_rest_fall_back(monkeypatch):
    from labkit.wire import codec as wire

    used = []
    real = wire._Pickler.__init__

    def counting(self, *args, **kwargs):
        used.append(True)
        real(self, *args, **kwargs)

    monkeypatch.setattr(wire._Pickler, "__init__", counting)
    c = Codec(new_key())
    small = torch.arange(6.0).view(2, 3).t().requires_grad_()
    out = c.decode(c.encode({"type": "done", "id": 3, "v": [1, 2.5, "x", None, (small,)]}))
    assert not used, "a message of plain values and a small tensor went through cloudpickle"
    got = out["v"][4][0]
    assert got.dtype == small.dtype and got.requires_grad and torch.equal(got, small.detach())

    def double(x):  # defined here, as a cell defines it: cloudpickle carries it by value
        return 2 * x

    out = c.decode(c.encode({"type": "exec", "fn": double, "s": torch.Size([2])}))
    assert used and out["fn"](21) == 42 and out["s"] == torch.Size([2])


@pytest.mark.parametrize("numel", [10, 100_000], ids=["blake2b", "poly1305"])
def test_every_byte_is_covered_by_the_tag(numel):
    codec = Codec(new_key())
    frames = codec.encode({"x": torch.ones(numel), "note": "a" * 50})
    assert (sum(memoryview(f).nbytes for f in frames[1:]) <= 64 * 1024) == (numel == 10)
    for i in (1, 2):
        for at in (0, memoryview(frames[i]).nbytes - 1):
            bad = [bytes(memoryview(f).cast("B")) for f in frames]
            broken = bytearray(bad[i])
            broken[at] ^= 1
            bad[i] = bytes(broken)
            with pytest.raises(AuthenticationError):
                Codec(codec.key).decode(bad)
    # moving a byte from the buffer to the header keeps the bytes but not the lengths
    moved = [frames[0], bytes(frames[1]) + bytes(memoryview(frames[2])[:1]), frames[2][1:]]
    with pytest.raises(AuthenticationError):
        Codec(codec.key).decode(moved)
    assert torch.equal(Codec(codec.key).decode(frames)["x"], torch.ones(numel))


def test_a_small_message_is_tagged_with_keyed_blake2b_as_the_codec_says():
    """The tag of a small message is BLAKE2b keyed with the lab key, over the nonce and each
    frame's length and bytes, whichever way the codec computes it; another key's tag fails."""
    import hashlib

    key = new_key()
    frames = Codec(key).encode({"type": "exec", "id": 7, "code": "pass", "x": torch.ones(3)})
    nonce, body = frames[0][:16], [bytes(memoryview(f).cast("B")) for f in frames[1:]]
    data = b"".join(len(b).to_bytes(8, "little") + b for b in body)
    assert frames[0][16:] == hashlib.blake2b(nonce + data, key=key, digest_size=16).digest()
    other = hashlib.blake2b(nonce + data, key=new_key(), digest_size=16).digest()
    with pytest.raises(AuthenticationError):
        Codec(key).decode([nonce + other, *body])
