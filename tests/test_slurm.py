"""A real one-machine Slurm runs the lab's ranks: `srun ... <the command Lab.attach printed>`.

The test configures and starts munged, slurmctld and slurmd itself (Debian's `slurm-wlm` and
`munge`, in a temporary directory, on ports of their own, each started and ended by pid), runs
`srun --nodes=1 --ntasks-per-node=1 torchrun --nnodes=1 --nproc-per-node=2 -m labkit.rank
--connect ... --key-file ...` against a lab, runs cells on the ranks (which see their Slurm job),
then `scancel`s the job: the job ends and the notebook's next cell says its ranks are gone.
Skips, saying why, where Slurm is not installed or the test is not root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from test_attach import end, wait_all

import labkit
from labkit import LabError

pytestmark = pytest.mark.timeout(240)

TOOLS = ("munged", "slurmctld", "slurmd", "srun", "scancel", "sinfo", "squeue")
MUNGE_KEY = "/etc/munge/munge.key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """\
ClusterName=labkit
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm")
    if os.geteuid() != 0 or not os.access(MUNGE_KEY, os.R_OK):
        pytest.skip(f"running slurmd and munged here needs root and {MUNGE_KEY}")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(
        CONF.format(
            host=socket.gethostname().split(".")[0],
            ctld_port=_free_port(),
            slurmd_port=_free_port(),
            d=d,
            cpus=os.cpu_count(),
        )
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = []
    try:
        daemons.append(
            subprocess.Popen(
                [
                    "munged",
                    "-F",
                    "--force",
                    f"--socket={d}/munge.sock",
                    f"--key-file={MUNGE_KEY}",
                    f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/munged.log",
                    f"--seed-file={d}/munge.seed",
                ],  # fmt: skip
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        deadline = time.monotonic() + 30
        while not (d / "munge.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        for cmd in (["slurmctld", "-D", "-i", "-f", str(conf)], ["slurmd", "-D", "-f", str(conf)]):
            daemons.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        state = ""
        while state != "idle" and time.monotonic() < deadline + 30:
            time.sleep(0.5)
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True)
            state = out.stdout.decode().strip()
        assert state == "idle", f"the Slurm node did not come up: {state!r}"
        yield env
    finally:
        end(daemons)


def test_srun_runs_the_printed_command_and_scancel_ends_it(slurm):
    env = dict(slurm, LABKIT_PREWARM="0")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    lab = labkit.Lab.attach(2, wait=False)
    line = f"srun --nodes=1 --ntasks-per-node=1 {lab.command}"  # as the README's Slurm section
    job = [subprocess.Popen(line.split(), env=env, stdout=subprocess.DEVNULL)]
    try:
        lab.wait_attached(180)
        res = lab.run(
            "import os\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
            "(os.environ.get('SLURM_JOB_ID'), t.item())"
        )
        ids = {v[0] for v in res.values_by_rank.values()}
        assert len(ids) == 1 and None not in ids, ids  # both ranks are in one Slurm job
        assert {v[1] for v in res.values_by_rank.values()} == {3.0}
        job_id = ids.pop()
        subprocess.run(["scancel", job_id], env=env, check=True, timeout=30)
        assert wait_all(job, 60) != [None], "scancel did not end srun"
        with pytest.raises(LabError, match=r"rank \d \(on .*\) sent no heartbeat"):
            lab.run("1")
        squeue = subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True)
        assert squeue.stdout.strip() == b""
    finally:
        try:
            lab.stop()
        finally:
            end(job)
