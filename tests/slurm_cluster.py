"""A real two-node Slurm cluster on localhost for the launcher tests (see .ci/slurm-setup.sh).

slurmctld and two slurmd (`-N node1`, `-N node2`, one port each) run in the foreground as children of
the test process, with auth/none so no munged (and no host-wide munge socket) is involved. Every file
lives in a temp folder; the cluster is torn down at the end of the session whether the tests passed
or not, and the daemons die with the test process should that be killed. Tests skip, saying why,
where Slurm is not installed or the node names do not resolve.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

NODES = ("node1", "node2")
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "squeue")
SETUP_HINT = "run .ci/slurm-setup.sh (as root, needs apt-get)"
FINISHED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    root: Path

    @property
    def env(self) -> dict[str, str]:
        """This process's environment pointed at the test cluster; jobs inherit SLURM_CONF from it."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> str:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
        return result.stdout

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_for_job(self, job_id: str, states: tuple[str, ...] = FINISHED_STATES, *,
                     timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job_id)
            if fields["JobState"] in states:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {fields['JobState']} after {timeout} s, wanted {states}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        tails = []
        for log in sorted(self.root.glob("*.log")):
            tails.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(tails)


def _die_with_parent() -> None:
    """Runs in each daemon before exec: if pytest itself is killed, the kernel stops the daemon too."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _skip_reason() -> str | None:
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"Slurm not installed (missing {', '.join(missing)}); {SETUP_HINT}"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root; run the tests as root"
    for node in NODES:
        try:
            socket.gethostbyname(node)
        except OSError:
            return f"{node} does not resolve; {SETUP_HINT} to add it to /etc/hosts"
    return None


def _write_conf(root: Path) -> Path:
    node_lines = [
        f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} "
        "CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4096"
        for node in NODES
    ]
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=verltest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/none",
        "CredType=cred/none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        # Short grace periods keep cancel and requeue quick; finished jobs stay visible to scontrol.
        "KillWait=5",
        "MinJobAge=600",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        *node_lines,
        f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n")
    (root / "state").mkdir()
    (root / "spool").mkdir()
    return conf


def _wait_idle(cluster: SlurmCluster, daemons: list[subprocess.Popen], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        exited = [" ".join(daemon.args[:1]) for daemon in daemons if daemon.poll() is not None]
        if exited:
            raise RuntimeError(f"{', '.join(exited)} exited during start-up\n{cluster.log_tail()}")
        states = cluster.run("sinfo", "--noheader", "--Node", "--format=%T", check=False).split()
        if len(states) == len(NODES) and all(state == "idle" for state in states):
            return
        time.sleep(0.5)
    raise RuntimeError(f"Slurm nodes not idle after {timeout} s\n{cluster.log_tail()}")


def _stop(cluster: SlurmCluster, daemons: list[subprocess.Popen]) -> None:
    controller_up = bool(daemons) and daemons[0].poll() is None
    try:
        if controller_up:
            # scontrol shutdown leaves running jobs (their slurmstepd are not our children): cancel them first.
            cluster.run("scancel", "--full", "--partition=debug", check=False)
            deadline = time.monotonic() + 15
            while cluster.run("squeue", "--noheader", check=False).strip() and time.monotonic() < deadline:
                time.sleep(0.5)
            cluster.run("scontrol", "shutdown", check=False)
    except subprocess.TimeoutExpired:
        pass  # slurmctld is not answering; the daemons are stopped below all the same
    for daemon in daemons:
        try:
            daemon.wait(timeout=10 if controller_up else 0.1)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running two-node cluster (node1, node2; partition debug); stopped at the end of the session."""
    reason = _skip_reason()
    if reason:
        print(f"skipping Slurm tests: {reason}")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    cluster = SlurmCluster(conf=_write_conf(root), root=root)
    commands = {"slurmctld": ["slurmctld", "-D", "-c", "-f", str(cluster.conf)]}
    commands.update({f"slurmd-{node}": ["slurmd", "-D", "-f", str(cluster.conf), "-N", node] for node in NODES})
    daemons: list[subprocess.Popen] = []
    try:
        for name, command in commands.items():
            log = open(root / f"{name}.stdout.log", "w")
            daemons.append(subprocess.Popen(command, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                                            preexec_fn=_die_with_parent))
            log.close()
        _wait_idle(cluster, daemons)
        yield cluster
    finally:
        _stop(cluster, daemons)
