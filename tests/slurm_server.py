"""A real Slurm 22.05 cluster for tests and benchmarks: munged, slurmctld and slurmd.

:func:`slurm_cluster` is a plain context manager (usable from a benchmark script);
:func:`slurm` is the session-scoped pytest fixture around it. Following
``docs/infra.md`` §4 (verified on Debian 12 with ``slurm-wlm`` 22.05.8 and ``munge``
0.5.15, as root, without systemd):

* munged is reused when one answers (``munge -n | unmunge``), else started as user
  ``munge`` and stopped at the end by the PID in its pid file (left running while
  another cluster's slurmctld or slurmd still runs on the host);
* slurmctld and slurmd run from a temporary folder (``SLURM_CONF`` points there; nothing
  is written under ``/etc/slurm``) on free loopback ports, and are stopped by PID;
* the real node is the host's short name with 4 fake GPUs (``gres.conf`` ``File=``
  symlinks to ``/dev/null``: a Count-only GPU line leaves the node INVAL);
* ``RebootProgram`` records each request (one line in :attr:`SlurmCluster.reboot_log`)
  and simulates a successful reboot by restarting slurmd with ``-b`` ("report node
  rebooted when daemon restarted", meant for testing): slurmd then registers with a new
  ``BootTime`` and slurmctld completes the reboot (checked on 22.05.8: REBOOT_REQUESTED,
  then DOWN+DRAIN+REBOOT_ISSUED, then IDLE with the new BootTime, ~3 s in all);
* 100 more nodes ``gpu[001-100]`` and ``optout1`` (feature ``gpuhealth-opt-out``) have
  no slurmd: their address is a loopback port nothing listens on, so they stay
  ``UNKNOWN*`` (never DOWN) and ``scontrol`` can still drain and resume them (on
  22.05 the resume of a never-registered node prints "Invalid node state specified"
  and exits 1, but clears DRAIN and the reason; the adapter checks the state).

A missing binary skips, unless ``GPUHEALTH_TEST_SERVERS=required`` (CI), where it fails.
Debian packages: ``slurm-wlm slurmctld slurmd munge``. Needs root (slurmd, munged).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.servers import free_port as _free_port
from tests.servers import servers_required

READY_TIMEOUT_SECONDS = 30.0
FAKE_NODES = "gpu[001-100]"
FAKE_NODE_NAMES = [f"gpu{i:03d}" for i in range(1, 101)]
OPT_OUT_NODE = "optout1"
MUNGE_PID_FILE = Path("/run/munge/munged.pid")


class SlurmUnavailable(RuntimeError):
    """The cluster cannot run here (binary missing, not root); the message says why."""




def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not any(line.startswith("State:") and "Z" in line.split()[1]
                   for line in status.splitlines())


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM ``pid``, SIGKILL after ``timeout`` s; return once it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _other_slurm_daemons() -> list[int]:
    """PIDs of slurmctld/slurmd processes still running (other clusters on this host)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm in ("slurmctld", "slurmd") and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _binaries() -> dict[str, str]:
    names = ("slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "sbatch", "scancel",
             "munged", "munge", "unmunge")
    found = {}
    for name in names:
        path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")
        if path is None:
            raise SlurmUnavailable(f"{name} not found (apt-get install slurm-wlm slurmctld "
                                   "slurmd munge)")
        found[name] = path
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test Slurm cluster runs slurmd and munged as root")
    return found


def _munge_works(bins: dict[str, str]) -> bool:
    try:
        cred = subprocess.run([bins["munge"], "-n"], capture_output=True, timeout=5, check=False)
        if cred.returncode != 0:
            return False
        check = subprocess.run([bins["unmunge"]], input=cred.stdout, capture_output=True,
                               timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return check.returncode == 0


def _start_munged(bins: dict[str, str]) -> int | None:
    """Start munged unless one answers; return its PID if we started it."""
    if _munge_works(bins):
        return None
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", bins["munged"]], check=True,
                   timeout=15, capture_output=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _munge_works(bins):
            return _read_pid(MUNGE_PID_FILE)
        time.sleep(0.05)
    raise RuntimeError("munged started but munge -n | unmunge does not work")


def _hardware(bins: dict[str, str]) -> str:
    """The CPU layout ``slurmd -C`` reports (a config that differs makes the node INVAL)."""
    line = subprocess.run([bins["slurmd"], "-C"], capture_output=True, text=True, timeout=30,
                          check=True).stdout.splitlines()[0]
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    return " ".join(t for t in line.split() if t.partition("=")[0] in keep)


SLURM_CONF = """\
# gpuhealth test cluster (tests/slurm_server.py); docs/infra.md section 4
ClusterName=gpuhealthtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
ResumeTimeout={resume_timeout}
MessageTimeout={message_timeout}
InactiveLimit=0
KillWait=2
MinJobAge=300
MailProg=/bin/true
GresTypes=gpu
RebootProgram={d}/reboot-program
NodeName={host} {hardware} RealMemory=1000 Gres=gpu:4 State=UNKNOWN
NodeName={fake_nodes} NodeAddr=127.0.0.1 Port={dead_port} CPUs=2 RealMemory=1000 Gres=gpu:4 \
Feature=gpu State=UNKNOWN
NodeName={opt_out} NodeAddr=127.0.0.1 Port={dead_port} CPUs=2 RealMemory=1000 \
Feature=gpu,gpuhealth-opt-out State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
PartitionName=fleet Nodes={fake_nodes},{opt_out} MaxTime=INFINITE State=UP
"""

GRES_CONF = """\
AutoDetect=off
NodeName={host} Name=gpu File={d}/fakegpu/nvidia[0-3]
NodeName={fake_nodes} Name=gpu File={d}/fakegpu/nvidia[0-3]
"""

REBOOT_PROGRAM = """\
#!/bin/sh
# Test RebootProgram: record the request, then simulate a successful reboot by
# restarting slurmd with -b (it reports the node as rebooted when it registers).
echo "$(date +%s) $(hostname -s) reboot requested" >> {reboot_log}
setsid sh -c '
  sleep 0.3
  old=$(cat {d}/slurmd.pid 2>/dev/null)
  [ -n "$old" ] && kill "$old" 2>/dev/null
  for i in $(seq 100); do
    [ -n "$old" ] && [ -e /proc/$old ] && ! grep -q "^State:.*Z" /proc/$old/status || break
    sleep 0.05
  done
  SLURM_CONF={conf} exec {slurmd} -b
' < /dev/null >> {d}/log/reboot-program.log 2>&1 &
exit 0
"""


@dataclass
class SlurmCluster:
    """A running test cluster; run client commands with :meth:`run` (``SLURM_CONF`` set)."""

    folder: Path
    conf: Path
    host: str
    bins: dict[str, str]
    ctld_port: int
    slurmd_port: int
    fake_nodes: list[str] = field(default_factory=lambda: list(FAKE_NODE_NAMES))
    opt_out_node: str = OPT_OUT_NODE
    munged_pid: int | None = None
    ctld_pid: int | None = None

    @property
    def env(self) -> dict[str, str]:
        """What the adapter needs in its ``env``."""
        return {"SLURM_CONF": str(self.conf)}

    @property
    def reboot_log(self) -> Path:
        """One line per reboot request the RebootProgram received."""
        return self.folder / "reboot-requests.log"

    def reboot_requests(self) -> list[str]:
        """The lines of :attr:`reboot_log`."""
        if not self.reboot_log.exists():
            return []
        return [ln for ln in self.reboot_log.read_text().splitlines() if ln.strip()]

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (``"scontrol", "show", ...``) against this cluster."""
        binary = self.bins.get(argv[0], argv[0])
        result = subprocess.run([binary, *argv[1:]], capture_output=True, text=True,
                                timeout=timeout, check=False, input=input_text,
                                env={**os.environ, **self.env}, cwd=self.folder)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: "
                               f"{result.stderr.strip()}")
        return result

    def sbatch(self, script: str, *options: str) -> str:
        """Submit ``script`` (a shell script body) to the real node; return the job id."""
        path = self.folder / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        result = self.run("sbatch", "--parsable", "-p", "debug", "-w", self.host,
                          f"--output={self.folder}/job-%j.out", *options, str(path))
        return result.stdout.strip().split(";")[0]

    def node(self, name: str) -> dict[str, str]:
        """``scontrol show node -o`` as a dict of the simple fields plus ``Reason``."""
        line = self.run("scontrol", "show", "node", "-o", name).stdout.strip()
        out: dict[str, str] = {}
        head, _, reason = line.partition(" Reason=")
        for token in head.split():
            key, sep, value = token.partition("=")
            if sep:
                out.setdefault(key, value)
        out["Reason"] = reason.rsplit(" [", 1)[0] if reason else ""
        return out

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict of the fields (AdminComment taken whole)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip()
        out: dict[str, str] = {}
        head, _, tail = line.partition(" AdminComment=")
        for token in head.split():
            key, sep, value = token.partition("=")
            if sep:
                out.setdefault(key, value)
        if tail:
            out["AdminComment"] = tail.split("  ")[0].split(" StdErr=")[0].strip()
        return out

    def sinfo_state(self, name: str) -> str:
        """``sinfo`` state word of one node (``idle``, ``drained*``, ``draining``...)."""
        return self.run("sinfo", "-h", "-N", "-n", name, "-o", "%T").stdout.strip()

    def wait(self, check: Callable[[], Any], timeout: float = 20.0, what: str = "",
             detail: Callable[[], Any] | None = None) -> Any:
        """Poll ``check`` every 0.1 s until truthy; return it, or raise with the last value
        (and ``detail()``, e.g. the job as Slurm shows it)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(0.1)
        more = f"; {detail()!r}" if detail is not None else ""
        raise AssertionError(f"{what or check} not true within {timeout} s (last {last!r})"
                             f"{more}")

    def reset_host(self) -> None:
        """Cancel every job and return the real node to ``idle`` (between tests)."""
        self.run("scancel", "--full", "-u", "root", check=False)
        self.wait(lambda: not self.run("squeue", "-h", "-t", "R,CG,S").stdout.strip(),
                  what="no running job")
        state = self.node(self.host)
        if "DRAIN" in state.get("State", "") or "DOWN" in state.get("State", ""):
            self.resume_host()
        self.run("scontrol", "update", f"NodeName={self.host}", "Comment=", check=False)
        self.wait(lambda: self.sinfo_state(self.host) == "idle", what=f"{self.host} idle")

    def resume_host(self) -> None:
        """``State=RESUME`` the real node, then SIGHUP slurmd so that it registers at once.

        After a resume slurmctld marks the node NOT_RESPONDING (``idle*``) until its next
        ping reaches it, 7-18 s here behind the pings of the 100 slurmd-less nodes; a
        slurmd that re-reads its configuration registers within ~0.5 s.
        """
        self.run("scontrol", "update", f"NodeName={self.host}", "State=RESUME", check=False)
        pid = _read_pid(self.folder / "slurmd.pid")
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    @contextlib.contextmanager
    def conf_lines(self, *lines: str, timeout: float = 30.0) -> Iterator[None]:
        """Add ``lines`` to ``slurm.conf`` (``HealthCheckProgram=...``) while the block runs.

        slurmctld and slurmd re-read the file (``scontrol reconfigure``); at the end the
        file is restored and read again, so the other tests of the session see the
        cluster as it was.
        """
        original = self.conf.read_text()
        self.conf.write_text(original + "# added by a test (SlurmCluster.conf_lines)\n"
                             + "".join(f"{line}\n" for line in lines))
        try:
            self._reconfigure(timeout)
            yield
        finally:
            self.conf.write_text(original)
            self._reconfigure(timeout)

    def _reconfigure(self, timeout: float) -> None:
        """``scontrol reconfigure``, then wait until the real node answers again."""
        self.run("scontrol", "reconfigure", timeout=timeout)
        self.wait(lambda: "*" not in self.sinfo_state(self.host), timeout,
                  f"{self.host} responding after reconfigure")

    def log(self, name: str = "slurmctld") -> str:
        """The tail of a daemon log."""
        path = self.folder / "log" / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def _job_processes(self) -> list[int]:
        """PIDs of job scripts of this cluster and of their slurmstepd parents."""
        found: set[int] = set()
        marker = str(self.folder).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if marker not in (entry / "cmdline").read_bytes():
                    continue
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            found.add(int(entry.name))
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            try:
                if (Path("/proc") / str(parent) / "comm").read_text().startswith("slurmstepd"):
                    found.add(parent)
            except OSError:
                pass
        return sorted(found)

    def stop(self) -> None:
        """Cancel the jobs, stop slurmd, slurmctld (and munged if we started it) by PID.

        Job steps outlive slurmd, so the jobs are cancelled first and any job process
        left (its command line names this cluster's folder) is stopped by PID too.
        """
        with contextlib.suppress(OSError, subprocess.SubprocessError, RuntimeError):
            self.run("scancel", "--full", "-u", "root", check=False, timeout=10)
            deadline = time.monotonic() + 5
            while self._job_processes() and time.monotonic() < deadline:
                time.sleep(0.1)
        for pid in self._job_processes():
            stop_pid(pid, timeout=2)
        slurmd_pid = _read_pid(self.folder / "slurmd.pid")
        if slurmd_pid is not None:
            stop_pid(slurmd_pid)
        ctld = _read_pid(self.folder / "slurmctld.pid") or self.ctld_pid
        if ctld is not None:
            stop_pid(ctld)
        if self.munged_pid is not None:
            others = _other_slurm_daemons()
            if others:  # another cluster (a parallel session) still needs munge
                self.munged_pid = None
            else:
                stop_pid(self.munged_pid)


@contextlib.contextmanager
def slurm_cluster(folder: Path | None = None, *, resume_timeout: int = 60,
                  message_timeout: int = 5) -> Iterator[SlurmCluster]:
    """Start munged (or reuse one), slurmctld and slurmd; yield the cluster; stop them.

    Args:
        folder: Where the configuration, state and logs go; a temporary folder by default.
        resume_timeout: slurm.conf ``ResumeTimeout`` (also the reboot time-out), seconds.
        message_timeout: slurm.conf ``MessageTimeout``, seconds.

    Raises:
        SlurmUnavailable: A binary is missing or we are not root.
        RuntimeError: A daemon did not start or the node did not become idle; the
            message has the log's tail.
    """
    bins = _binaries()
    with contextlib.ExitStack() as stack:
        if folder is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpuhealth-slurm-"))
            folder = Path(tmp)
        folder.chmod(0o755)
        for sub in ("state", "spool", "log", "fakegpu"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        for i in range(4):
            link = folder / "fakegpu" / f"nvidia{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        host = socket.gethostname().split(".")[0]
        ctld_port, slurmd_port = _free_port(), _free_port()
        values = {
            "d": str(folder), "host": host, "ctld_port": ctld_port,
            "slurmd_port": slurmd_port, "dead_port": _free_port(),
            "fake_nodes": FAKE_NODES, "opt_out": OPT_OUT_NODE,
            "hardware": _hardware(bins), "resume_timeout": resume_timeout,
            "message_timeout": message_timeout, "conf": str(folder / "slurm.conf"),
            "slurmd": bins["slurmd"], "reboot_log": str(folder / "reboot-requests.log"),
        }
        conf = folder / "slurm.conf"
        conf.write_text(SLURM_CONF.format(**values))
        (folder / "gres.conf").write_text(GRES_CONF.format(**values))
        program = folder / "reboot-program"
        program.write_text(REBOOT_PROGRAM.format(**values))
        program.chmod(0o755)
        cluster = SlurmCluster(folder=folder, conf=conf, host=host, bins=bins,
                               ctld_port=ctld_port, slurmd_port=slurmd_port)
        stack.callback(cluster.stop)
        cluster.munged_pid = _start_munged(bins)
        env = {**os.environ, "SLURM_CONF": str(conf)}
        for daemon in ("slurmctld", "slurmd"):
            started = subprocess.run([bins[daemon]], env=env, capture_output=True, text=True,
                                     timeout=30, check=False, cwd=folder)
            if started.returncode != 0:
                raise RuntimeError(f"{daemon} exited {started.returncode}: {started.stderr}\n"
                                   f"{cluster.log(daemon)}")
            if daemon == "slurmctld":
                cluster.ctld_pid = _read_pid(folder / "slurmctld.pid")
        try:
            cluster.wait(lambda: cluster.run("sinfo", "-h", "-N", "-n", host, "-o", "%T",
                                             check=False).stdout.strip() == "idle",
                         timeout=READY_TIMEOUT_SECONDS, what=f"node {host} idle")
        except AssertionError as exc:
            raise RuntimeError(f"{exc}\nslurmctld:\n{cluster.log()}\nslurmd:\n"
                               f"{cluster.log('slurmd')}") from exc
        yield cluster




@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """The session's Slurm cluster; skips (or fails when required) if Slurm cannot run."""
    try:
        manager = slurm_cluster()
        cluster = manager.__enter__()
    except SlurmUnavailable as exc:
        if servers_required():
            pytest.fail(f"GPUHEALTH_TEST_SERVERS=required but {exc}")
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        manager.__exit__(None, None, None)
