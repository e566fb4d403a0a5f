"""The wire contract is written once: RankConfig converts to and from the wire and checks its
values; every message is a TypedDict in labkit/wire/messages.py, built through it, and no tag
names two messages. No processes are started.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import typing

import pytest

import labkit
from labkit.wire import messages
from labkit.wire.config import RankConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(labkit.__file__)))
TAGS = ("type", "cmd")  # the key that names a message: `cmd` for the fork server's commands

# Files that may build messages as dict literals, with why (a path ending in "/" covers a
# folder).
EXEMPT = {
    "labkit/wire/messages.py": "the definitions themselves",
}


# -- RankConfig -------------------------------------------------------------------------------


def config(**changes):
    values = dict(
        rank=1,
        world_size=4,
        local_rank=1,
        local_world_size=4,
        ctrl="ipc:///tmp/labkit-x/ctrl",
        side="ipc:///tmp/labkit-x/side",
        key=bytes(range(32)),
        gen=3,
        backend="gloo",
        device="cpu",
        log_dir="/tmp/labkit-logs",
        master_addr="127.0.0.1",
        pg_timeout=1800,
    )
    values.update(changes)
    return RankConfig(**values)


@pytest.mark.parametrize(
    "cfg",
    [
        config(),
        config(log_dir=None),
        config(capture_fds=(7, 9)),
        config(stop_board="/tmp/labkit-x/stop"),
        config(
            attached=True,
            master_port=29500,
            ctrl="tcp://10.0.0.1:5555",
            side="tcp://10.0.0.1:5556",
            backend="nccl",
            device="cuda",
            local_world_size=2,
            pg_timeout=60.5,
        ),
    ],
)
def test_rank_config_round_trips_through_the_wire_and_json(cfg):
    wire = cfg.to_wire()
    assert wire["key"] == cfg.key.hex()
    assert json.loads(json.dumps(wire)) == wire  # JSON-able, as the fork server's line is
    assert RankConfig.from_wire(wire) == cfg
    assert RankConfig.from_wire(json.loads(json.dumps(wire))) == cfg
    assert {f.name for f in dataclasses.fields(RankConfig)} == set(wire)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rank": 5}, r"rank must be in \[0, 4\), got 5"),
        ({"rank": -1}, r"rank must be in \[0, 4\), got -1"),
        ({"rank": True}, r"rank must be in \[0, 4\), got True"),
        ({"world_size": 0}, r"world_size must be an int >= 1, got 0"),
        ({"local_rank": 4}, r"local_rank must be in \[0, 4\), got 4"),
        ({"local_world_size": 8}, r"local_world_size must be in \[1, world_size=4\], got 8"),
        ({"gen": 0}, r"gen must be an int >= 1, got 0"),
        ({"ctrl": "/tmp/ctrl"}, r"ctrl must be an endpoint .*unix://, ipc://, tcp://.*'/tmp/ctrl'"),
        ({"key": b"short"}, r"key must be at least 16 bytes, got 5 bytes"),
        ({"key": "00" * 32}, r"key must be at least 16 bytes, got '00"),
        ({"backend": "auto"}, r"backend must be one of gloo, nccl, cpu:gloo,cuda:nccl, got 'auto'"),
        ({"device": "tpu"}, r"device must be one of cpu, cuda, got 'tpu'"),
        ({"log_dir": ""}, r"log_dir must be a directory path or None, got ''"),
        ({"master_addr": ""}, r"master_addr must be a host name or address, got ''"),
        ({"pg_timeout": 0}, r"pg_timeout must be a number of seconds > 0, got 0"),
        ({"master_port": 70000}, r"master_port must be in \[1, 65536\), got 70000"),
        ({"attached": "yes"}, r"attached must be True or False, got 'yes'"),
        ({"capture_fds": (3,)}, r"capture_fds must be None or two file descriptors"),
        ({"stop_board": "stop"}, r"stop_board must be None or an absolute file path, got 'stop'"),
    ],
)
def test_rank_config_rejects_bad_values_saying_what_is_allowed(changes, message):
    with pytest.raises(ValueError, match=message):
        config(**changes)


def test_rank_config_from_wire_rejects_unknown_fields_and_a_raw_key():
    wire = config().to_wire()
    with pytest.raises(ValueError, match="unknown RankConfig field.*: colour"):
        RankConfig.from_wire(dict(wire, colour="red"))
    with pytest.raises(ValueError, match="key must be hex text"):
        RankConfig.from_wire(dict(wire, key=bytes(range(32))))


# -- the messages ------------------------------------------------------------------------------


def _definitions() -> list[type]:
    """The public TypedDicts of labkit.wire.messages (`_Done` and such are halves of one)."""
    return [
        v
        for name, v in vars(messages).items()
        if not name.startswith("_")
        and isinstance(v, type)
        and typing.is_typeddict(v)
        and v.__module__ == messages.__name__
    ]


def _tag(cls: type) -> tuple[str, str] | None:
    """(tag key, tag) of a message; None for a part of one (its `type` is not a Literal)."""
    hints = typing.get_type_hints(cls)
    for key in TAGS:
        if typing.get_origin(hints.get(key)) is typing.Literal:
            (tag,) = typing.get_args(hints[key])
            return key, tag
    return None


def _message_classes() -> list[type]:
    return [cls for cls in _definitions() if _tag(cls) is not None]


def _tags_by_key() -> dict[str, set[str]]:
    tags: dict[str, set[str]] = {key: set() for key in TAGS}
    for cls in _message_classes():
        key, tag = _tag(cls)
        tags[key].add(tag)
    return tags


def test_every_tag_names_one_message():
    seen: dict[tuple[str, str], str] = {}
    for cls in _message_classes():
        tag = _tag(cls)
        assert tag not in seen, f"{tag[0]}={tag[1]!r} names both {seen[tag]} and {cls.__name__}"
        seen[tag] = cls.__name__
    assert len(seen) >= 24  # 18 between kernel and ranks, 6 over the fork server's pipes


def test_every_message_is_in_exactly_one_direction():
    unions = {
        "KernelToRank": messages.KernelToRank,
        "RankToKernel": messages.RankToKernel,
        "KernelToServer": messages.KernelToServer,
        "ServerToKernel": messages.ServerToKernel,
    }
    for cls in _message_classes():
        found = [name for name, union in unions.items() if cls in typing.get_args(union)]
        assert len(found) == 1, f"{cls.__name__} is in {found or 'no union'}"
    for cls in typing.get_args(messages.RankToKernel):
        assert {"rank", "gen"} <= set(typing.get_type_hints(cls)), cls.__name__


def _key_set(node: ast.AST) -> dict[str, ast.AST] | None:
    """The constant keys of a dict literal or `dict(k=v)` call, with their values."""
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            return None  # a `**spread` or computed key: not a literal message
        return {k.value: v for k, v in zip(node.keys, node.values)}  # type: ignore[union-attr]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "dict"
        and not node.args
        and all(kw.arg for kw in node.keywords)
    ):
        return {kw.arg: kw.value for kw in node.keywords}  # type: ignore[misc]
    return None


def message_literals(source: str, filename: str) -> list[str]:
    """Dicts built by hand that are messages (or parts of one) defined in labkit.wire.messages.

    A dict is one if its tag (`type`/`cmd`) is a constant that names a message, or if it has a
    tag key and exactly the keys of a definition (`{"type": ..., "message": ..., ...}` is a
    RankErrorInfo). `{"type": "log"}` (a plotly axis) is neither.
    """
    tags = _tags_by_key()
    shapes = [  # the parts of messages, such as RankErrorInfo: they have no constant tag
        (cls.__name__, cls.__required_keys__, cls.__required_keys__ | cls.__optional_keys__)
        for cls in _definitions()
        if _tag(cls) is None
    ]
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        keys = _key_set(node)
        if not keys or not any(key in keys for key in TAGS):
            continue
        what = None
        for key in TAGS:
            value = keys.get(key)
            if isinstance(value, ast.Constant) and value.value in tags[key]:
                what = f"a {key}={value.value!r} message"
        for name, required, allowed in shapes:
            if what is None and required <= set(keys) <= allowed:
                what = f"a {name}"
        if what:
            found.append(f"{filename}:{node.lineno}: {what} built as a dict literal")
    return found


def _exempt(path: str) -> bool:
    return any(path == e or (e.endswith("/") and path.startswith(e)) for e in EXEMPT)


def test_messages_are_built_through_their_definitions():
    checked, found = [], []
    for folder, _, files in os.walk(os.path.join(ROOT, "labkit")):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")
            if _exempt(path):
                continue
            checked.append(path)
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                found += message_literals(f.read(), path)
    assert not found, "build these with the TypedDicts of labkit.wire.messages:\n" + "\n".join(
        found
    )
    for path in (
        "labkit/rank/worker.py",
        "labkit/rank/fork_server.py",
        "labkit/kernel/launch/spawn.py",
    ):
        assert path in checked


@pytest.mark.parametrize(
    "source, flagged",
    [
        ('reply({"type": "done", "id": 1, "error": None})', True),
        ('say(dict(cmd="spawn", cfg={}))', True),
        ('err = {"type": "E", "message": "m", "traceback": "", "time": 0.0}', True),
        ('axis = {"type": "log", "title": "bytes"}', False),
        ('axis = {"type": "log"}', False),
        ('info = {"type": type(value).__name__, "colour": 1}', False),
        ("Done(type='done', id=1, error=None)", False),
    ],
)
def test_the_scan_tells_messages_from_other_dicts(source, flagged):
    assert bool(message_literals(source, "example.py")) is flagged


# -- the Stop board ---------------------------------------------------------------------------


def test_the_stop_board_is_private_never_goes_back_and_is_read_only_on_a_rank(tmp_path):
    from labkit.wire.stop_board import StopBoard

    path = str(tmp_path / "stop")
    kernel = StopBoard(path, create=True)
    rank = StopBoard(path)  # a rank maps the same file
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert rank.latest() == 0
        kernel.press(7)
        assert rank.latest() == 7 and rank.cells[0] == 7  # seen through the rank's own map
        kernel.press(5)  # a late Stop for an older cell: the board never goes back
        assert rank.latest() == 7
        with pytest.raises(TypeError):  # the rank's map is read-only
            rank.cells[0] = 99
        with pytest.raises(FileExistsError):  # a board is made once, never taken over
            StopBoard(path, create=True)
    finally:
        rank.close()
        kernel.close()


@pytest.mark.parametrize(
    ("world_size", "device", "facts"),
    [
        (2, "auto", {"gpus": 2, "nccl": True}),  # a GPU per rank: NCCL for CUDA, gloo for CPU
        (2, "cuda", {"gpus": 4, "nccl": True}),
        (4, "auto", {"gpus": 1, "nccl": True}),  # more ranks than GPUs: gloo on the CPU
        (4, "cuda", {"gpus": 1, "nccl": True}),  # ... or gloo on the shared GPU, as asked
        (2, "auto", {"gpus": 0}),
    ],
)
def test_every_backend_the_policy_chooses_starts_a_rank(world_size, device, facts):
    from labkit.kernel.launch.policy import choose

    choice = choose(world_size, "auto", device, facts)
    cfg = config(
        world_size=world_size,
        rank=0,
        local_rank=0,
        local_world_size=world_size,
        backend=choice.backend,
        device=choice.device,
    )
    assert RankConfig.from_wire(cfg.to_wire()) == cfg  # and it survives the fork server's line
