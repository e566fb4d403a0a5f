"""Every message between the kernel, its ranks and its fork server, typed once (both sides).

A message is a dict whose `type` (or, for the fork server's commands, `cmd`) names it; each one
is a TypedDict below with that tag as a `Literal`, so both sides build and read the same fields.
TypedDicts are plain dicts at run time: `Done(type="done", id=cell, error=None)` costs what the
dict literal did. Between the kernel and a rank the dicts travel signed and pickled (`codec`);
between the kernel and its fork server, as one JSON object per line over the server's pipes.

| channel     | direction      | message         | meaning                                         |
|-------------|----------------|-----------------|-------------------------------------------------|
| ctrl        | rank -> kernel | `Attach`        | a torchrun rank asks to join (before `hello`)   |
| ctrl        | kernel -> rank | `Welcome`       | ... is let in: side endpoint, backend, device   |
| ctrl        | kernel -> rank | `Refused`       | ... or is turned away, with why                 |
| ctrl        | rank -> kernel | `Hello`         | started: pid, host, device, rank 0's store port |
| ctrl        | kernel -> rank | `Init`          | join the process group (rendezvous port)        |
| ctrl        | rank -> kernel | `Ready`         | the process group is formed                     |
| ctrl        | kernel -> rank | `Exec`          | run a cell's code or a pickled function         |
| ctrl        | kernel -> rank | `Pull`          | send back the value of a name                   |
| ctrl        | kernel -> rank | `Push`          | bind names in the rank's namespace              |
| ctrl        | kernel -> rank | `Trace`         | send the comm/span records of a cell            |
| ctrl        | rank -> kernel | `Done`          | the answer to exec/pull/push/trace              |
| ctrl        | kernel -> rank | `Ping`          | clock probe                                     |
| ctrl        | rank -> kernel | `Pong`          | ... answered with the rank's clock              |
| ctrl        | kernel -> rank | `Exit`          | leave now                                       |
| ctrl        | rank -> kernel | `Fatal`         | the rank cannot go on (start-up failed)         |
| side        | rank -> kernel | `Stream`        | output text (stdout/stderr), numbered           |
| side        | rank -> kernel | `Status`        | heartbeat: busy cell, running line, comm op     |
| side        | kernel -> rank | `Interrupt`     | Stop pressed, for a rank labkit cannot signal   |
| side        | kernel -> rank | `AskStacks`     | send every thread's Python stack now            |
| side        | rank -> kernel | `Stacks`        | ... as text, and the Flight Recorder's entries  |
| ctrl        | kernel -> rank | `Debug`         | open pdb on the rank's last exception           |
| ctrl        | rank -> kernel | `DebugPrompt`   | pdb's output and prompt: the rank waits ...     |
| ctrl        | kernel -> rank | `DebugInput`    | ... for the line the user typed (None: end)     |
| side        | rank -> kernel | `Progress`      | a tqdm bar's state (labkit.rank.progress)       |
| server pipe | kernel -> srv  | `SpawnCommand`  | fork one rank with this `RankConfig`            |
| server pipe | kernel -> srv  | `SignalCommand` | signal ranks the server forked                  |
| server pipe | kernel -> srv  | `ExitCommand`   | kill the ranks and leave                        |
| server pipe | srv -> kernel  | `ServerHello`   | the server's facts: torch, GPUs, backends, CPUs |
| server pipe | srv -> kernel  | `Spawned`       | a rank was forked: its pid                      |
| server pipe | srv -> kernel  | `Exited`        | a rank exited: its code (negative: signal)      |
| server pipe | srv -> kernel  | `Warm`          | its one-off warm-up imports are done            |

Every rank -> kernel message also carries `rank` and `gen` (`FromRank`), added by the rank's
`reply()`/`send_side()`; the kernel drops messages of an older generation. `RankErrorInfo` and
`DisplayInfo` are parts of messages. No tag names two messages (tests/test_wire.py checks it).

Imports only the standard library and labkit.wire.flight_records (a part of `Stacks`).
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from labkit.wire.flight_records import FrSnapshot

# -- parts of messages -------------------------------------------------------------------------


class RankErrorInfo(TypedDict):
    """An exception raised on a rank, as the kernel shows it (in `Done` and `Fatal`)."""

    type: str  # the exception's class name, e.g. "ZeroDivisionError"
    message: str
    traceback: str  # formatted, without labkit's own frames
    time: float  # when it was raised, on the rank's clock (the kernel corrects the offset)


class TensorInfo(TypedDict):
    shape: tuple[int, ...]
    dtype: str
    device: str
    requires_grad: bool


class _DisplayInfo(TypedDict):
    type: str  # the value's class name
    text: str  # its repr, cut at 20,000 characters


class DisplayInfo(_DisplayInfo, total=False):
    """What the kernel needs to show a cell's last value richly (computed on the rank)."""

    tensor: TensorInfo


class FromRank(TypedDict, total=False):
    """What every rank -> kernel message carries, added by the rank's reply()/send_side()."""

    rank: int
    gen: int  # the generation of the ranks: a restart makes a new one


# -- kernel -> rank, ctrl socket ----------------------------------------------------------------


class Init(TypedDict):
    type: Literal["init"]
    port: int | None  # rank 0's store port, from its hello; None for torchrun's ranks


class _Exec(TypedDict):
    type: Literal["exec"]
    id: int  # the cell


class Exec(_Exec, total=False):
    code: str  # the cell's source, or
    fn: bytes  # a cloudpickled function, called with the namespace names it takes
    display: bool  # describe the value for display (default True)
    want_value: bool  # send the value itself back (default True)


class Pull(TypedDict):
    type: Literal["pull"]
    id: int
    name: str  # a name or an attribute path such as model.fc


class Push(TypedDict):
    type: Literal["push"]
    id: int
    names: dict[str, Any]


class _Trace(TypedDict):
    type: Literal["trace"]
    id: int
    cell: int | None  # None: the last cell


class Trace(_Trace, total=False):
    enabled: bool  # turn tracing on or off first


class Ping(TypedDict):
    type: Literal["ping"]
    id: int


class Exit(TypedDict):
    type: Literal["exit"]


class Welcome(TypedDict):
    """The kernel's answer to a torchrun rank's `Attach`."""

    type: Literal["welcome"]
    gen: int
    side: str  # the side endpoint, "tcp://HOST:PORT" (the rank puts in the host it reached)
    backend: str  # "gloo" or "cpu:gloo,cuda:nccl", chosen by the kernel (policy.choose)
    device: str  # "cpu" or "cuda"
    pg_timeout: float
    kernel: tuple[str, int]  # (host, pid): ranks outliving it remove its key file


class Refused(TypedDict):
    type: Literal["refused"]
    why: str


# -- kernel -> rank, side socket ----------------------------------------------------------------


class Interrupt(TypedDict):
    """Stop pressed for `cell`. The rank latches it: the cell stops when its user code runs,
    or is not started at all. The kernel re-sends it while it waits (it is idempotent)."""

    type: Literal["interrupt"]
    cell: int


class AskStacks(TypedDict):
    """Send every thread's stack now: read and answered by the rank's heartbeat thread, so it
    works while the main thread runs user code or waits in a C++ collective."""

    type: Literal["ask_stacks"]
    id: int  # the kernel's number for this request; the answer carries it


class Leave(TypedDict):
    """The kernel gave up on a cell of ranks it cannot kill (attached): exit now."""

    type: Literal["leave"]
    why: str


# -- rank -> kernel, ctrl socket ----------------------------------------------------------------


class Attach(FromRank):
    """A torchrun rank's first words, sent to the lab's endpoint with rank and gen 1."""

    type: Literal["attach"]
    world_size: int  # torchrun's WORLD_SIZE
    host: str
    pid: int
    gpus: int  # GPUs this rank's node sees
    nccl: bool  # whether this node's torch has NCCL
    cpus: int | None  # this node's cores


class Hello(FromRank):
    type: Literal["hello"]
    pid: int
    host: str
    port: int | None  # rank 0's store port (a forked lab); None elsewhere
    device: str  # "cpu", "cuda:0", ...
    time: float
    num_cpus: int | None
    threads: int  # torch's intra-op threads in this rank (torch.get_num_threads())


class Ready(FromRank):
    type: Literal["ready"]
    init_s: float  # seconds init_process_group took


class _Done(FromRank):
    type: Literal["done"]
    id: int
    error: RankErrorInfo | None


class Done(_Done, total=False):
    value: Any
    value_error: str  # why the value could not be sent (or rebuilt in the kernel)
    display: DisplayInfo  # exec only, when there is a value and display was asked
    duration: float  # exec only: seconds the cell ran
    t_end: float  # exec only: when it ended, on the rank's clock
    stream_seq: int  # exec only: the last Stream (or Progress) seq sent before this reply
    progress: dict[str, Any]  # exec only: the tracer's progress (see Status.progress)


class Pong(FromRank):
    type: Literal["pong"]
    id: int
    time: float  # the rank's clock


class Fatal(FromRank):
    type: Literal["fatal"]
    error: RankErrorInfo


# -- rank -> kernel, side socket ----------------------------------------------------------------


class _Stream(FromRank):
    type: Literal["stream"]
    name: Literal["stdout", "stderr"]
    text: str
    cell: int | None  # the cell running when it was written


class Stream(_Stream, total=False):
    seq: int  # 1, 2, ... per rank, added by send_side()


class _Status(FromRank):
    type: Literal["status"]
    busy: int | None  # the cell running, or None when idle
    time: float  # the rank's clock


class Status(_Status, total=False):
    line: int | None  # the line of the cell running (busy only)
    op: dict[str, Any] | None  # the comm op the rank is inside: op, seq, group, peer, since, ...
    progress: dict[str, Any]  # collectives per group (seq), p2p messages per peer (sent/received)
    taken: int  # the id of the last request (exec, pull, push, trace) the rank took
    debugging: bool  # in a pdb session, waiting for the user (labkit.rank.debugger)
    cuda_memory: dict[str, Any]  # labkit.rank.cuda_memory.snapshot(); absent without CUDA
    received: float  # set by the kernel on arrival (its monotonic clock); never sent


class Stacks(FromRank):
    type: Literal["stacks"]
    id: int  # the `AskStacks` answered
    busy: int | None  # the cell running, or None when idle
    text: str  # every thread's stack, main thread first, innermost frame first (rank.stacks)
    where: str | None  # the main thread's cell line ("line 3: time.sleep(60)"), if any
    fr: FrSnapshot | None  # the Flight Recorder, for the kernel's hang verdict; None when off


# -- the debugger: kernel <-> rank, ctrl socket (labkit.rank.debugger, kernel.inspection.debug) --


class Debug(TypedDict):
    """kernel -> rank: open a post-mortem pdb session on the last exception a cell raised there
    (answered with `Done`: `value` True if there was one; `error` KeyboardInterrupt at Stop)."""

    type: Literal["debug"]
    id: int


class DebugPrompt(FromRank):
    """rank -> kernel: pdb's output so far and its prompt; the rank waits for a `DebugInput`.
    Sent in a `debug` request's session, or in a cell's at `breakpoint()` (`id`: the cell)."""

    type: Literal["debug_prompt"]
    id: int  # the request the session belongs to
    output: str
    prompt: str


class DebugInput(TypedDict):
    """kernel -> rank: the line the user typed; None ends the session (no input box to ask in).
    A breakpoint's session then continues the cell; a post-mortem's returns the rank."""

    type: Literal["debug_input"]
    id: int
    line: str | None


# -- rank -> kernel, side socket: progress bars (labkit.rank.progress) -------------------------


class _Progress(FromRank):
    """A tqdm bar's state, sent at most every 0.1 s per bar and when it closes. Numbered in
    the rank's output sequence (`seq`, as `Stream`), so a `done` follows its last state."""

    type: Literal["progress"]
    bar: int  # 1, 2, ... per rank process: which bar
    cell: int | None  # the cell running when it was sent
    n: float  # tqdm's counter
    total: float | None  # None: unknown
    desc: str
    unit: str
    unit_scale: bool | float  # tqdm's own argument (the kernel formats with it)
    rate: float | None  # units per second (tqdm's smoothed rate), None before it is known
    elapsed: float  # seconds since the bar started
    postfix: str  # set_postfix's text
    leave: bool  # whether the bar stays once closed (tqdm's `leave`)
    closed: bool  # the final state


class Progress(_Progress, total=False):
    seq: int  # added by send_side(), in the same numbering as `Stream.seq`


# -- the fork server's pipes: JSON lines --------------------------------------------------------


class SpawnCommand(TypedDict):
    cmd: Literal["spawn"]
    cfg: dict[str, Any]  # RankConfig.to_wire()


class SignalCommand(TypedDict):
    cmd: Literal["signal"]
    pids: list[int]
    sig: int


class ExitCommand(TypedDict):
    cmd: Literal["exit"]


class ServerHello(TypedDict):
    """The fork server's facts, its first line (`labkit doctor` prints them)."""

    type: Literal["facts"]
    torch: str
    gpus: int
    cuda: str | None
    gloo: bool
    nccl: bool
    mpi: bool
    cpus: int | None
    pid: int
    python: str


class Spawned(TypedDict):
    type: Literal["spawned"]
    rank: int
    pid: int
    gen: int


class Exited(TypedDict):
    type: Literal["exited"]
    pid: int
    rank: int | None  # None: not a rank this server knew of
    code: int  # exit code; negative: killed by that signal


class Warm(TypedDict):
    type: Literal["warm"]


# -- by channel and direction -------------------------------------------------------------------

_KernelToRankCtrl = Init | Exec | Pull | Push | Trace | Ping | Exit | Welcome | Refused
_Debugger = Debug | DebugInput
KernelToRank = _KernelToRankCtrl | Interrupt | AskStacks | Leave | _Debugger
RankToKernel = (
    Attach | Hello | Ready | Done | Pong | Fatal | Stream | Status | Stacks | DebugPrompt | Progress
)
KernelToServer = SpawnCommand | SignalCommand | ExitCommand
ServerToKernel = ServerHello | Spawned | Exited | Warm
