"""Simulated hosts on one machine: network namespaces that Hydra's ``mpiexec`` reaches as remote hosts.

``SimCluster(hosts=2, slots=2)`` builds (as root, with ``ip`` and ``nsenter``/``unshare``)::

    root namespace                     <tag>-sw namespace              <tag>-hN namespaces
    <tag>r  10.A.B.1/24  ──veth──  pr ─┐                             ┌─ eth0 10.A.B.11/24  (host 0)
                                       ├─ br0 (a bridge, no address) ┤
                                       │                             └─ eth0 10.A.B.12/24  (host 1) ...

* every "host" is a network namespace whose only interfaces are ``lo`` and one veth
  (``eth0``) on a bridge that lives in a namespace of its own, so host-to-host traffic
  never touches the root namespace's stack, firewall or other interfaces; IPv6 is off
  there, so the hosts' only addresses are the ones above;
* the root namespace gets one veth into that bridge, with its own address: that is
  where ``mpiexec`` listens for its proxies (``-localhost``), nothing else;
* ``mpiexec -f HOSTFILE -launcher ssh -launcher-exec SCRIPT -localhost ROOT_IP``
  (:meth:`SimCluster.mpiexec_args`) starts one ``hydra_pmi_proxy`` per host through
  SCRIPT, which does what ``ssh HOST CMD`` does, into the host's namespace: it enters
  the namespace, gives the proxy a UTS namespace of its own with the host's name
  (``unshare --uts`` + ``hostname``) and runs the command line through ``sh -c``;
* MPI sees one node per host (Hydra gives every proxy its own node id; the hostnames
  differ too), so ``MPI_COMM_TYPE_SHARED`` holds only a host's own ranks and the CPU
  backend's ``window: auto`` picks ``Win.Allocate`` windows;
* :meth:`SimCluster.mpi_env` makes the inter-host traffic go over the veths: UCX (the
  ``mpich`` wheel's default netmod) would otherwise reach the other "host" through its
  shared-memory transports (cma/posix/sysv: namespaces share one kernel), so it is
  restricted to ``UCX_TLS=self,tcp``; with ``netmod="ofi"`` MPICH uses libfabric's
  ``tcp`` provider instead. :meth:`SimCluster.link_bytes` reads the veth counters,
  so a caller can check that the bytes really crossed the link.

What the namespaces do not separate: the file system (like a cluster's shared home),
the process table (``/proc`` shows every host's processes: code that names a dead peer
must not look at another host's pids, see ``jobstate``) and the CPUs.

Everything is removed by :meth:`SimCluster.down` (also called on a failed ``up`` and by
the context manager), which first kills every process left in the namespaces; a later
``up`` removes what a killed earlier run (its creating pid gone) left behind. Every loop
here is bounded in count and time.

Command line (root)::

    python -m streamring.host.netns --hosts 2 --slots 2 -- streamring stress --config configs/stress-basic.yaml

runs ``mpiexec <the arguments above> -n hosts*slots python -m streamring stress ...``
on a fresh simulated cluster and removes it afterwards.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "srsim"  # every namespace/interface this module creates starts with it
NETNS_DIR = Path("/run/netns")
NETMODS = ("ucx", "ofi")


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``nsenter``/``unshare``, or the kernel refuses)."""


def _run(cmd: list[str], timeout: float = 10.0, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def unavailable_reason() -> str:
    """'' when this process can build a :class:`SimCluster`, else why not (for a test's skip reason)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces and veth pairs needs root (euid is not 0)"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not on PATH (iproute2 / util-linux)"
    name = f"{PREFIX}-probe-{os.getpid()}"
    try:
        p = _run(["ip", "netns", "add", name], check=False)
        if p.returncode != 0:
            return f"`ip netns add` is refused here: {p.stderr.strip()}"
        p = _run(["ip", "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb"], check=False)
        if p.returncode != 0:
            return f"veth pairs cannot be created in a namespace here: {p.stderr.strip()}"
        p = _run(["unshare", "--uts", "hostname", "probe"], check=False)
        if p.returncode != 0:
            return f"`unshare --uts` is refused here: {p.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"namespace probe failed: {exc}"
    finally:
        _run(["ip", "netns", "del", name], check=False)
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_list() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]


def _kill_netns_processes(ns: str, patience_s: float = 5.0) -> list[int]:
    """SIGTERM, then (after half of ``patience_s``) SIGKILL, every process in namespace ``ns``.

    Returns the pids still there when ``patience_s`` has passed (empty: all gone).
    """
    start = time.monotonic()
    for _ in range(int(patience_s / 0.05) + 1):  # bounded in count and in time
        pids = [int(x) for x in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        elapsed = time.monotonic() - start
        if not pids or elapsed > patience_s:
            return pids
        sig = signal.SIGTERM if elapsed < patience_s / 2 else signal.SIGKILL
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return [int(x) for x in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces and root-side veths left by a run whose creating process is gone; return their names."""
    removed = []
    for ns in _netns_list():
        parts = ns.split("-")
        if len(parts) < 3 or parts[0] != prefix or not parts[1].isdigit() or _pid_alive(int(parts[1])):
            continue
        _kill_netns_processes(ns)
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        digits = name[len(prefix):-1]
        if name.startswith(prefix) and name.endswith("r") and digits.isdigit() and not _pid_alive(int(digits)):
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class SimHost:
    """One simulated host: its namespace, address, hostname and MPI slots."""

    index: int
    netns: str
    address: str
    hostname: str
    slots: int


_LAUNCHER_EXEC = r"""#!/bin/sh
# Hydra's -launcher-exec for a SimCluster (streamring.host.netns), generated: it stands in for
# `ssh [options] HOST COMMAND...`. Like ssh it joins COMMAND into one line for `sh -c`; it runs it
# in HOST's network namespace, in a UTS namespace of its own carrying HOST's hostname.
while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done
host=$1; shift
case $host in
@CASES@
  *) echo "simulated-host launcher: unknown host '$host' (hosts: @HOSTS@)" >&2; exit 255 ;;
esac
# `exec` all the way down: the proxy is the process Hydra started, so a signal to it reaches the proxy
# (what closing an ssh connection does to a remote proxy), and no shell is left in between.
exec nsenter --net="/run/netns/$ns" -- unshare --uts -- /bin/sh -c 'hostname "$0" && exec /bin/sh -c "exec $1"' "$hn" "$*"
"""


class SimCluster:
    """``hosts`` simulated hosts with ``slots`` MPI slots each (see the module docstring).

    Args:
        hosts: number of hosts (network namespaces), >= 1.
        slots: ranks per host in the hostfile.
        netmod: ``"ucx"`` (the ``mpich`` wheel's default; TCP transport only) or ``"ofi"``
            (libfabric's tcp provider).
        tag: names the namespaces ``srsim-<tag>-hN``; default: this process's pid (so a
            later run can tell a leftover from a live cluster).
    """

    def __init__(self, hosts: int = 2, slots: int = 2, netmod: str = "ucx", tag: str | None = None):
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if netmod not in NETMODS:
            raise ValueError(f"netmod {netmod!r} is not one of {NETMODS}")
        self.num_hosts, self.slots, self.netmod = hosts, slots, netmod
        self.tag = tag or str(os.getpid())
        if not self.tag.isdigit() or len(PREFIX) + len(self.tag) + 1 > 15:
            raise ValueError(f"tag must be at most {14 - len(PREFIX)} digits (interface names), got {self.tag!r}")
        self.switch_ns = f"{PREFIX}-{self.tag}-sw"
        self.root_if = f"{PREFIX}{self.tag}r"
        self.hosts: list[SimHost] = []
        self.root_address = ""
        self.state_dir: Path | None = None
        self._created_ns: list[str] = []
        self._created_root_if = False

    # -- building ---------------------------------------------------------------------------
    def _pick_subnet(self) -> ipaddress.IPv4Network:
        """A /24 in 10.0.0.0/8 that overlaps no route of the root namespace (bounded search)."""
        used = []
        for line in _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout.splitlines():
            word = line.split()[0] if line.split() else ""
            if word in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
                word = line.split()[1]
            try:
                used.append(ipaddress.ip_network(word if word != "default" else "0.0.0.0/32", strict=False))
            except ValueError:
                continue
        seed = int(self.tag)
        for i in range(256):
            k = (seed + i * 7919) % (100 * 256)
            net = ipaddress.ip_network(f"10.{100 + k // 256}.{k % 256}.0/24")
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        raise RuntimeError("no free /24 in 10.100.0.0-10.199.255.0 for the simulated hosts (256 tried)")

    def up(self) -> "SimCluster":
        """Create the namespaces, veths, bridge, hostfile and launcher script; on any failure remove them."""
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _ns_sh(self, ns: str, script: str) -> None:
        _run(["nsenter", f"--net={NETNS_DIR / ns}", "--", "/bin/sh", "-c", script])

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created_ns.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # No IPv6 (its link-local addresses and router solicitations): the hosts' only addresses are ours.
        self._ns_sh(ns, "[ -w /proc/sys/net/ipv6/conf/all/disable_ipv6 ] || exit 0; "
                        "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                        "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6")

    def _build(self) -> None:
        net = self._pick_subnet()
        addrs = list(net.hosts())
        self.root_address = str(addrs[0])
        sw = self.switch_ns
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        # Root namespace <-> switch: the only address the root namespace gets.
        _run(["ip", "link", "add", self.root_if, "type", "veth", "peer", "name", "pr", "netns", sw])
        self._created_root_if = True
        _run(["ip", "addr", "add", f"{self.root_address}/{net.prefixlen}", "dev", self.root_if])
        _run(["ip", "link", "set", self.root_if, "up"])
        _run(["ip", "-n", sw, "link", "set", "pr", "master", "br0"])
        _run(["ip", "-n", sw, "link", "set", "pr", "up"])
        for i in range(self.num_hosts):
            ns = f"{PREFIX}-{self.tag}-h{i}"
            self._add_ns(ns)
            port = f"p{i}"
            _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", sw])
            addr = str(addrs[10 + i])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            self.hosts.append(SimHost(i, ns, addr, f"{PREFIX}-{self.tag}-host{i}", self.slots))
        self.state_dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{self.tag}-"))
        self.hostfile.write_text("".join(f"{h.address}:{h.slots}\n" for h in self.hosts))
        cases = "\n".join(f"  {h.address}|{h.hostname}) ns={h.netns}; hn={h.hostname} ;;" for h in self.hosts)
        script = _LAUNCHER_EXEC.replace("@CASES@", cases).replace("@HOSTS@", " ".join(h.address for h in self.hosts))
        self.launcher_exec.write_text(script)
        self.launcher_exec.chmod(0o755)
        self._wait_reachable()

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        """Every host reaches the root address over TCP (the bridge forwards once its ports are up)."""
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((self.root_address, 0))
        srv.listen(len(self.hosts))
        srv.settimeout(timeout_s)
        port = srv.getsockname()[1]
        try:
            for h in self.hosts:
                probe = (f"import socket,time\nend=time.monotonic()+{timeout_s}\n"
                         f"while True:\n"
                         f"    try: socket.create_connection(('{self.root_address}',{port}),timeout=1).close(); break\n"
                         f"    except OSError:\n"
                         f"        if time.monotonic()>end: raise\n"
                         f"        time.sleep(0.05)\n")
                _run(["nsenter", f"--net={NETNS_DIR / h.netns}", "--", sys.executable, "-c", probe],
                     timeout=timeout_s + 5)
                srv.accept()[0].close()
        finally:
            srv.close()

    # -- using ------------------------------------------------------------------------------
    @property
    def hostfile(self) -> Path:
        """Hydra hostfile: ``ADDRESS:SLOTS`` per host."""
        return self._state("hostfile")

    @property
    def launcher_exec(self) -> Path:
        """The ssh stand-in that Hydra runs for each host."""
        return self._state("launcher-exec.sh")

    def _state(self, name: str) -> Path:
        if self.state_dir is None:
            raise RuntimeError("SimCluster is not up (call up() or use it as a context manager)")
        return self.state_dir / name

    @property
    def num_ranks(self) -> int:
        return self.num_hosts * self.slots

    def mpiexec_args(self) -> list[str]:
        """Hydra options that place the ranks on the simulated hosts (put them before ``-n``)."""
        return ["-f", str(self.hostfile), "-launcher", "ssh", "-launcher-exec", str(self.launcher_exec),
                "-localhost", self.root_address]

    def mpi_env(self) -> dict[str, str]:
        """Environment that makes MPICH send inter-host traffic over the veths (see the module docstring)."""
        if self.netmod == "ucx":
            return {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "self,tcp", "UCX_NET_DEVICES": "eth0"}
        return {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """``{host's netns: (rx_bytes, tx_bytes)}`` of each host's eth0 (the counters of its veth)."""
        out = {}
        for h in self.hosts:
            p = _run(["ip", "-n", h.netns, "-s", "-j", "link", "show", "eth0"])
            st = json.loads(p.stdout)[0]["stats64"]
            out[h.netns] = (int(st["rx"]["bytes"]), int(st["tx"]["bytes"]))
        return out

    def pids(self) -> dict[str, list[int]]:
        """``{host's netns: [pids of the processes in it]}``."""
        return {h.netns: [int(x) for x in _run(["ip", "netns", "pids", h.netns], check=False).stdout.split()]
                for h in self.hosts}

    # -- tearing down -------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Kill every process left in the namespaces, delete namespaces and veths; return what could not be removed."""
        problems = []
        for ns in reversed(self._created_ns):
            left = _kill_netns_processes(ns)
            if left:
                problems.append(f"{ns}: processes {left} survived SIGKILL")
            p = _run(["ip", "netns", "del", ns], check=False)
            if p.returncode != 0:
                problems.append(f"ip netns del {ns}: {p.stderr.strip()}")
        self._created_ns.clear()
        if self._created_root_if:
            # Deleting the namespace removed the peer and with it the pair; delete explicitly if still there.
            if _run(["ip", "link", "show", self.root_if], check=False).returncode == 0:
                _run(["ip", "link", "del", self.root_if], check=False)
            self._created_root_if = False
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None
        self.hosts = []
        return problems

    def __enter__(self) -> "SimCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def describe(self) -> str:
        return "; ".join(f"{h.hostname} = {h.address} ({h.netns}, {h.slots} slots)" for h in self.hosts) + \
            f"; mpiexec side {self.root_address} ({self.root_if})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamring.host.netns",
                                 description="run a command on simulated hosts (network namespaces), as root")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2, help="ranks per host")
    ap.add_argument("--netmod", choices=NETMODS, default="ucx")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before the job is killed")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="after `--`: `streamring ARGS` (run as python -m streamring ARGS) or any program")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not cmd:
        ap.error("give the command after `--`, e.g. -- streamring stress")
    if cmd[0] == "streamring":
        cmd = [sys.executable, "-m", "streamring", *cmd[1:]]
    from .launch import find_mpiexec

    with SimCluster(args.hosts, args.slots, args.netmod) as cluster:
        print(f"simulated hosts: {cluster.describe()}", file=sys.stderr)
        full = [find_mpiexec(), *cluster.mpiexec_args(), "-n", str(cluster.num_ranks), *cmd]
        env = {**os.environ, **cluster.mpi_env()}
        print("+ " + " ".join(f"{k}={v}" for k, v in cluster.mpi_env().items()) + " " + shlex.join(full),
              file=sys.stderr)
        before = cluster.link_bytes()
        proc = subprocess.Popen(full, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            rc = 124
        after = cluster.link_bytes()
        for ns, (rx, tx) in after.items():
            print(f"{ns} eth0: {(rx - before[ns][0]) / 1e6:.2f} MB received, {(tx - before[ns][1]) / 1e6:.2f} MB sent",
                  file=sys.stderr)
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
