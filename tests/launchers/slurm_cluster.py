"""A one-node Slurm cluster on localhost for tests: its own munge key and socket, slurm.conf,
state and spool directories and loopback ports, all under one folder; the node offers this
machine's real CPUs and no GPUs. Installs nothing: `missing()` says what is not there (the
Makefile's `slurm` target installs Debian's slurm-wlm and munge as root).

    cluster = LocalSlurm(tmp_dir); cluster.start()
    subprocess.run(["sbatch", ...], env=cluster.env)   # SLURM_CONF points at its slurm.conf
    cluster.stop()                                     # ends exactly the daemons it started

A requeued job waits cred_expire + 1 s before it may start again (Slurm's default 120 s); the
cluster sets it to 10 s so that requeue tests take seconds.

    python tests/launchers/slurm_cluster.py DIR   # start one by hand (docs/SLURM.md), Ctrl-C ends it
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run by hand: tests/, where the port helper lies, is not on the path as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ports import free_ports  # noqa: E402

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "sacct", "scancel")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin")
NODE = socket.gethostname().split(".")[0]  # the node name is the host name: ranks reach MASTER_ADDR by it
CRED_EXPIRE = 10


def which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    absent = [n for n in (*DAEMONS, *CLIENTS) if which(n) is None]
    if absent:
        return (f"not installed: {', '.join(absent)} (Debian packages slurm-wlm and munge; `make slurm` as root "
                f"installs them)")
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root (SlurmUser=root); run the tests as root"
    try:
        socket.gethostbyname(NODE)
    except OSError:
        return f"this host's name {NODE!r} does not resolve (the ranks reach MASTER_ADDR by it): add it to /etc/hosts"
    return None


def real_memory_mib() -> int:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return kib // 1024 - 512  # slurmd refuses a node that reports less than configured


class LocalSlurm:
    def __init__(self, root: Path, cpus: int | None = None):
        self.root = Path(root)
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if key != "SLURM_CONF":
                del self.env[key]  # e.g. a test run inside a Slurm job
        self._procs: dict[str, subprocess.Popen] = {}  # the daemons this object started

    def write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(self.root / sub, 0o755 if sub == "munge" else 0o700)  # munged: the socket's folder is x for all
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, slurmd_port = free_ports(2)
        log = self.root / "log"
        self.conf.write_text(f"""# one node on localhost, written by tests/launchers/slurm_cluster.py
ClusterName=vitpretrain
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE}
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}
SlurmctldPidFile={self.root / 'slurmctld.pid'}
SlurmdPidFile={self.root / 'slurmd.pid'}
SlurmctldLogFile={log / 'slurmctld.log'}
SlurmdLogFile={log / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=10
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName={NODE} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={real_memory_mib()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, name: str, *args: str) -> None:
        proc = subprocess.Popen([which(name), *args], env=self.env, stdout=subprocess.DEVNULL,
                                stderr=open(self.root / "log" / f"{name}.stderr", "w"), start_new_session=True)
        self._procs[name] = proc

    def start(self, timeout: float = 60) -> None:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        self.write_config()
        self._daemon("munged", "--foreground", "--force", "--key-file", str(self.root / "munge" / "munge.key"),
                     "--socket", str(self.socket), "--pid-file", str(self.root / "munge" / "munged.pid"),
                     "--log-file", str(self.root / "log" / "munged.log"),
                     "--seed-file", str(self.root / "munge" / "munged.seed"))
        self._wait(lambda: self.socket.exists(), timeout, "munged's socket")
        self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._daemon("slurmd", "-D", "-N", NODE, "-f", str(self.conf))
        self._wait(self._node_idle, timeout, f"node {NODE} to come up idle")

    def _node_idle(self) -> bool:
        out = subprocess.run(["scontrol", "-o", "show", "node", NODE], env=self.env, capture_output=True,
                             text=True).stdout
        return "State=IDLE" in out

    def _wait(self, ready, timeout: float, what: str) -> None:
        end = time.time() + timeout
        while time.time() < end:
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}: {self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted((self.root / "log").glob("*")) if p.is_file())

    def stop(self) -> None:
        """Cancel the jobs left, wait for their steps to end, then end the daemons this object
        started (by process id), slurmd and slurmctld first."""
        if self._procs.get("slurmctld") is not None and self._procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--partition", "debug", check=False)
            end = time.time() + 30
            while time.time() < end and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, Reason, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields


if __name__ == "__main__":
    why = missing()
    if why:
        sys.exit(why)
    cluster = LocalSlurm(Path(sys.argv[1]).resolve())
    cluster.start()
    print(f"export SLURM_CONF={cluster.conf}   # then sbatch / squeue / scontrol as usual; Ctrl-C "
          f"(or SIGTERM) ends the cluster", flush=True)
    stopped = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # also in the background, where SIGINT may be ignored
        signal.signal(sig, lambda signum, frame: stopped.append(signum))
    try:
        while not stopped:
            signal.pause()
    finally:
        cluster.stop()
