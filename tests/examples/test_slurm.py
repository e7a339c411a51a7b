"""The composed run under Slurm: examples/composed_training/slurm.sbatch on a one-node Slurm cluster.

The fixture starts a real Slurm: munged, slurmctld and slurmd, with every file (key, sockets, state,
logs, pid files) in a scratch folder under build/tmp/, on free ports. It stops the three daemons and
removes the folder afterwards. Slurm comes from Debian's slurm-wlm and munge packages; if they are missing,
``./course setup-slurm`` installs them. A machine that cannot install them, for lack of root or apt-get,
skips these tests and says why.

The job runs two Slurm tasks on the one node, standing for two nodes of 4 ranks each. Each task starts
one launcher, as on a cluster. The run must train exactly as one launcher of 8 ranks: the same losses
and the same final parameters.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_tcp_port

pytestmark = [pytest.mark.slow, pytest.mark.launch_heavy]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/composed_training/run.py"
SBATCH = "examples/composed_training/slurm.sbatch"
DAEMONS = ("slurmd", "slurmctld", "munged")  # stopped in this order


def _installed() -> bool:
    return all(shutil.which(tool) for tool in ("sbatch", "srun", "slurmctld", "slurmd", "munged"))


def _config(folder: Path, host: str) -> str:
    return "\n".join(
        [
            "ClusterName=course",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={folder / 'munge.socket'}",
            "ProctrackType=proctrack/linuxproc",  # no cgroups in a container
            "TaskPlugin=task/none",  # no CPU binding: the ranks of a task share both cores
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            f"SlurmctldPort={free_tcp_port()}",
            f"SlurmdPort={free_tcp_port()}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            f"NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN",
            "PartitionName=course Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ]
    )


def _stop(folder: Path) -> None:
    for daemon in DAEMONS:
        pid_file = folder / f"{daemon}.pid"
        if not pid_file.exists():
            continue
        pid = int(pid_file.read_text().split()[0])
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm cluster for this module; yields the environment its clients need (SLURM_CONF)."""
    if not _installed():
        setup = subprocess.run([str(ROOT / "course"), "setup-slurm"], cwd=ROOT, capture_output=True, text=True)
        if setup.returncode == 2:  # ./course setup-slurm: this machine cannot install it (not root, no apt-get)
            pytest.skip(f"Slurm is not installed and this machine cannot install it: {setup.stderr.strip()}")
        assert setup.returncode == 0 and _installed(), f"./course setup-slurm failed:\n{setup.stdout}{setup.stderr}"
    folder = ROOT / "build" / "tmp" / f"slurm-{os.getpid()}"
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    try:
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge = [f"--key-file={key}", f"--socket={folder / 'munge.socket'}", f"--pid-file={folder / 'munged.pid'}"]
        munge += [f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}", "--force"]
        subprocess.run(["munged", *munge], check=True, capture_output=True)
        host = socket.gethostname().split(".")[0]
        conf = folder / "slurm.conf"
        conf.write_text(_config(folder, host))
        env = {**os.environ, "SLURM_CONF": str(conf)}
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env, capture_output=True)
        subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env, capture_output=True)
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "the Slurm node did not come up within 60 s:\n" + "".join(
                (folder / f"{d}.log").read_text(errors="replace")[-1500:] for d in ("slurmctld", "slurmd")
            )
            time.sleep(0.5)
        yield env | {"SLURM_SCRATCH_FOLDER": str(folder)}
    finally:
        _stop(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _results(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("step ", "final parameters"))]


def test_two_slurm_tasks_train_exactly_as_one_launcher(slurm, accelerate_launch):
    one = accelerate_launch(SCRIPT, num_processes=8, timeout=300).stdout
    folder = Path(slurm["SLURM_SCRATCH_FOLDER"])
    job = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", f"--output={folder}/job-%j.out", SBATCH],
        cwd=ROOT,
        env=slurm | {"RANKS_PER_NODE": "4", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    logs = "".join(p.read_text(errors="replace") for p in folder.glob("job-*.out"))
    assert job.returncode == 0, f"the Slurm job failed (sbatch: {job.stdout}{job.stderr}):\n{logs[-4000:]}"
    assert "composed run: 2 launchers x 4 ranks" in logs and "on 8 ranks, backend gloo; 4 ranks per launcher" in logs
    assert _results(logs) and _results(logs) == _results(one), (
        f"two Slurm tasks must train exactly as one launcher:\n{_results(logs)}\n{_results(one)}"
    )
