"""Two "hosts" on this machine, each a Linux network namespace, run `torchrun --nnodes=2` with
the exact command `Lab.attach` prints, against a lab in the test process (root namespace).

The test builds, and removes at teardown whatever happens:

- a bridge `<tag>br` with address 10.213.X.1/24 in the root namespace (the notebook's host,
  `labhost`), X chosen free on this machine;
- per host i (0, 1, 2) a namespace `<tag>n<i>` holding one end of a veth pair (10.213.X.1<i>/24)
  whose other end is on the bridge, and `/etc/netns/<tag>n<i>/hosts` naming labhost, node0 and
  node1 (`ip netns exec` mounts it over /etc/hosts).

Each node's torchrun runs as `ip netns exec NS unshare --uts sh -c 'hostname node<i>; exec
"$@"' sh <the printed command>`: its own address, host name and name lookup, as on a cluster
(torchrun's rendezvous on node0, gloo between 10.213.X.11 and .12). The lab binds only
10.213.X.1 (only because the test asks: `host=`) and accepts only the two nodes' addresses
(`allow=`); nothing leaves the machine (the subnet has no route out). Every process is
started and ended by pid. Where namespaces cannot be made (not root, no `ip`, a container
without CAP_NET_ADMIN), the tests skip and say why.

The third namespace (10.213.X.13) is a host the lab does not allow.

Checked: the notebook's side listens only on the bridge's address; a message from the third
host is rejected (even signed with the key) and warned of; cells run on both hosts
(each sees its own host name), a collective, pull/push, tracing with each rank's clock offset
measured, Stop (with every CPU busy), a node that dies (its processes killed, every CPU busy:
the cell stops naming that rank and its host as the root cause, the notebook gets control
back, and the other node's rank leaves), and a kernel that dies (every rank on every node
exits).
"""

from __future__ import annotations

import _thread
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from processes import alive, key, subtree, wait_gone
from test_attach import end, wait_all
from test_security import LOOPBACK, _listening

import labkit
from labkit import LabError, LabkitWarning
from labkit.wire import sock_dir

pytestmark = pytest.mark.timeout(300)

TAG = f"lk{os.getpid() % 100000}"
NODES = 2
LAB_RDZV_PORT = 29516  # the module's lab's; tests that make their own take the next ones
RDZV_PORTS = iter(range(29517, 29600))  # one per torchrun job: node0's rendezvous store


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    for x in range(10, 250):
        if f" 10.213.{x}." not in used:
            return x
    raise RuntimeError("no free 10.213.X.0/24 subnet on this machine")


class Hosts:
    """The bridge, the namespaces and their hosts files (see the module docstring)."""

    def __init__(self) -> None:
        self.x = _free_subnet()
        self.bridge = f"{TAG}br"
        self.ns = [f"{TAG}n{i}" for i in range(NODES + 1)]  # the last: a host not allowed
        self.lab_addr = f"10.213.{self.x}.1"
        self.addr = [f"10.213.{self.x}.{11 + i}" for i in range(NODES + 1)]
        self.logs = tempfile.mkdtemp(prefix=f"{TAG}-logs-")

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.lab_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = f"127.0.0.1 localhost\n{self.lab_addr} labhost\n"
        hosts += "".join(f"{a} node{i}\n" for i, a in enumerate(self.addr))
        for i, ns in enumerate(self.ns):
            _ip("netns", "add", ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
            outer, inner = f"{TAG}v{i}", f"{TAG}p{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("addr", "add", f"{self.addr[i]}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    def down(self) -> None:
        """Remove everything `up` made (deleting a namespace deletes its veth pair)."""
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        shutil.rmtree(self.logs, ignore_errors=True)

    def start(self, command: str, node: int) -> subprocess.Popen:
        """Run `command` (as Lab.attach printed it) on host `node`."""
        env = dict(os.environ, LABKIT_PREWARM="0")
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        cmd = ["ip", "netns", "exec", self.ns[node], "unshare", "--uts", "sh", "-c"]
        cmd += [f'hostname node{node} && exec "$@"', "sh", *shlex.split(command)]
        with open(os.path.join(self.logs, f"node{node}.log"), "ab") as log:  # torchrun's output
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _cannot_make_namespaces() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces and a bridge needs root"
    if not (shutil.which("ip") and shutil.which("unshare")):
        return "needs iproute2's `ip` and util-linux's `unshare`"
    probe = f"{TAG}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def hosts():
    why = _cannot_make_namespaces()
    if why:
        pytest.skip(f"two hosts in network namespaces cannot be made: {why}")
    h = Hosts()
    try:
        h.up()
        yield h
    finally:
        h.down()


def attach_lab(h: Hosts, rdzv: str | None = None, **kw) -> labkit.Lab:
    return labkit.Lab.attach(
        NODES,
        host=h.lab_addr,
        nnodes=NODES,
        rdzv=rdzv or f"node0:{next(RDZV_PORTS)}",
        allow=h.addr[:NODES],  # the nodes' addresses: not the third host's
        wait=False,
        **kw,
    )


@pytest.fixture(scope="module")
def lab(hosts):
    lab = attach_lab(hosts, rdzv=f"node0:{LAB_RDZV_PORT}")
    procs = [hosts.start(lab.command, i) for i in range(NODES)]
    try:
        lab.wait_attached(180)
        yield lab
    finally:
        try:
            lab.stop()
        finally:
            end(procs)


def test_the_printed_command_is_what_each_host_runs(hosts, lab):
    assert lab.command == (
        f"torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
        f"--rdzv-endpoint=node0:{LAB_RDZV_PORT} -m labkit.rank --connect {hosts.lab_addr}:"
        f"{lab.endpoint.rsplit(':', 1)[1]} --key-file {lab.key_file}"
    )
    assert lab.channel.endpoint("ctrl").startswith(f"tcp://{hosts.lab_addr}:")
    # the notebook's side listens on the bridge's address only (and loopback, nothing else)
    bridge = "".join(f"{int(b):02X}" for b in reversed(hosts.lab_addr.split(".")))
    listening = {addr for addr, _ in _listening([os.getpid()])}
    assert listening and listening <= LOOPBACK | {bridge}, listening
    assert "attached from torchrun on node0, node1" in lab.choice.reason


def test_cells_collectives_pull_and_push_across_hosts(hosts, lab):
    res = lab.run(
        "import socket, os\n"
        "t = torch.ones(3) * (rank + 1)\n"
        "dist.all_reduce(t)\n"
        "(socket.gethostname(), os.environ['MASTER_ADDR'], t.tolist())"
    )
    hosts_seen = {r: v[0] for r, v in res.values_by_rank.items()}
    assert hosts_seen == {0: "node0", 1: "node1"} or hosts_seen == {0: "node1", 1: "node0"}
    masters = {v[1] for v in res.values_by_rank.values()}  # rank 0's host, by its name
    assert masters == {hosts_seen[0]}, masters
    assert all(v[2] == [3.0, 3.0, 3.0] for v in res.values_by_rank.values())
    lab.push(w=torch_tensor([1.0, 2.0]))
    got = lab.pull("w * (rank + 1)")
    assert {r: v.tolist() for r, v in got.items()} == {0: [1.0, 2.0], 1: [2.0, 4.0]}


def torch_tensor(values):
    import torch

    return torch.tensor(values)


INTRUDER = textwrap.dedent("""
    import sys, time, zmq
    from labkit.wire.codec import Codec
    from labkit.wire.key_file import read_key_file
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect("tcp://" + sys.argv[1])
    msg = dict(type="attach", rank=0, gen=1, world_size=2, host="intruder", pid=1, gpus=0,
               nccl=False, cpus=1)
    sock.send_multipart(Codec(read_key_file(sys.argv[2])).encode(msg))  # even with the key
    time.sleep(1)
    sock.close(linger=0)
""")


def test_a_host_not_allowed_is_rejected_and_warned(hosts, lab):
    env = dict(os.environ, LABKIT_PREWARM="0")
    cmd = ["ip", "netns", "exec", hosts.ns[NODES], sys.executable, "-c", INTRUDER]
    subprocess.run([*cmd, lab.endpoint, lab.key_file], env=env, check=True, timeout=60)
    before = lab.channel.rejected
    with pytest.warns(LabkitWarning, match=rf"from {hosts.addr[NODES]}, not one of the hosts"):
        assert lab.run("rank").values_by_rank == {0: 0, 1: 1}
    assert lab.channel.rejected == before + 1


def test_tracing_across_hosts_has_each_ranks_clock_offset(lab):
    assert sorted(lab.offsets) == [0, 1]
    assert all(abs(o) < 1.0 for o in lab.offsets.values()), lab.offsets  # one machine's clock
    t0 = time.time()
    lab.run("x = torch.ones(1000)\ndist.all_reduce(x)\ndist.barrier()")
    t1 = time.time()
    recs = lab.trace()
    assert sorted((r.rank, r.op) for r in recs if r.op == "all_reduce") == [
        (0, "all_reduce"),
        (1, "all_reduce"),
    ]
    assert all(t0 - 0.5 <= r.start <= r.end <= t1 + 0.5 for r in recs), recs


def test_stop_reaches_both_hosts(lab, cpu_load):
    lab.run("kept = rank + 40")
    timer = threading.Timer(1.0, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    res = lab.run("while True:\n    pass")
    timer.cancel()
    assert time.monotonic() - t0 < 20
    assert {r.error["type"] for r in res.values()} == {"KeyboardInterrupt"}
    assert lab.pull("kept") == {0: 40, 1: 41}


def ranks_of(proc: subprocess.Popen) -> set:
    """The labkit ranks (torchrun's workers) below one node's torchrun."""
    agent = {k for k in (key(proc.pid),) if k}
    out = set()
    for k in subtree(agent):
        try:
            cmd = Path(f"/proc/{k[0]}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"labkit.rank" in cmd and not any(b"torchrun" in c for c in cmd):
            out.add(k)
    return out


def test_a_node_that_dies_is_named_and_the_notebook_gets_control_back(hosts, cpu_load):
    lab = attach_lab(hosts)
    procs = [hosts.start(lab.command, i) for i in range(NODES)]
    try:
        lab.wait_attached(180)
        node1 = lab.run("import socket\nsocket.gethostname()").values_by_rank
        dying = next(r for r, h in node1.items() if h == "node1")
        assert len(ranks_of(procs[0])) == 1, "cannot tell node0's rank among its processes"
        # node1 goes down: its torchrun agent and worker, killed by pid
        node = {k for k in (key(procs[1].pid),) if k}
        for k in node | subtree(node):
            if alive(k):
                os.kill(k[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(LabError) as err:
            lab.run("t = torch.ones(1)\ndist.all_reduce(t)\nimport time\ntime.sleep(1)")
        assert time.monotonic() - t0 < 60
        text = str(err.value)
        assert text.startswith(f"rank {dying} (on node1) sent no heartbeat"), text
        assert f"because rank {dying} died, rank {1 - dying} raised RuntimeError" in text, text
        with pytest.raises(LabError, match="torchrun"):
            lab.run("1")  # the lab says what to do instead of hanging
        lab.stop()
        # node0's rank leaves (its torchrun agent may then wait in its exit barrier for the
        # dead node, as torchrun does; the test ends it)
        left = wait_gone(ranks_of(procs[0]), 40)
        assert not left, f"node0's ranks outlived the lab: {left}"
    finally:
        try:
            lab.stop()
        finally:
            end(procs)


KERNEL = textwrap.dedent("""
    import labkit, sys
    lab = labkit.Lab.attach(2, host=sys.argv[1], nnodes=2, rdzv=sys.argv[2], wait=False)
    print("CMD", lab.command, flush=True)
    lab.wait_attached(180)
    print("ready", flush=True)
    lab.run("print('spinning', flush=True)\\nwhile True:\\n    pass")
""")


def test_every_rank_on_every_host_exits_when_the_kernel_dies(hosts):
    kernel = subprocess.Popen(
        [sys.executable, "-u", "-c", KERNEL, hosts.lab_addr, f"node0:{next(RDZV_PORTS)}"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, LABKIT_PREWARM="0"),
    )
    procs = []
    try:
        line = ""
        while not line.startswith("CMD "):
            line = kernel.stdout.readline()
            assert line, "the kernel ended early"
        command = shlex.split(line[4:].strip())
        procs = [hosts.start(line[4:].strip(), i) for i in range(NODES)]
        while "spinning" not in line:
            line = kernel.stdout.readline()
            assert line, "the kernel ended early"
        kernel.kill()
        kernel.wait()
        assert None not in wait_all(procs, 60), "ranks outlived the kernel"
        # its private directory (the key file): ranks not on the kernel's host leave it; the
        # next lab started here removes it (sock_dir.sweep, when a channel makes its own)
        key_dir = os.path.dirname(command[command.index("--key-file") + 1])
        sock_dir.sweep()
        assert not os.path.exists(key_dir), "the killed kernel's directory was left"
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        kernel.stdout.close()
        end(procs)
