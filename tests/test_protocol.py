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
