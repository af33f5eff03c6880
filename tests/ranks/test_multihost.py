"""mpirun across hosts: 2 ranks on each of 2 simulated hosts (network namespaces, streamring/host/netns.py).

Hydra's ``mpiexec`` in this namespace starts one proxy per host through an ssh stand-in
that enters the host's namespace with its own hostname; the ranks talk over the veths
(UCX on TCP), so the CPU backend runs on ``Win.Allocate`` windows with passive-target RMA
over a network, as on a cluster. Skipped, with the reason, where namespaces cannot be made
(not root, no iproute2/util-linux, a kernel that refuses).

Stress configs that fit: those written for 4 ranks or without per-rank lists, short
enough for the 2-core CI machine over software RMA on TCP (every RMA completion needs the
target process to be scheduled, so 4 ranks on 2 cores run ~5-10x slower than on one
host's shared windows): stress-uneven (zero, uneven and partial chunks), stress-stragglers
(a slow remote rank), stress-ready-order (source_order=ready with stragglers) and
stress-aba (6 epochs on the same buffers, run at 4 ranks). Left out: stress-basic
(120 chunks per rank with random delays: ~35 s here) and stress-serialized (one slot,
~15 s), which the single-host suite runs; stress-zero-tokens (its per-rank list has 3
entries); stress-wrap and the soaks (10^4 to 10^5 wraps: minutes over TCP).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CONFIGS, Result, _run, wait_until

from streamring.host import netns
from streamring.host.launch import MPIEXEC_ARGS_ENV, find_mpiexec

# one worker of pytest-xdist (tests/run.sh) runs this file: one simulated cluster (a session fixture) serves it
pytestmark = pytest.mark.xdist_group("simulated-hosts")

PROBE = Path(__file__).resolve().parents[1] / "helpers" / "multihost_probe.py"
SLOTS = 2
HOSTS = 2
RANKS = SLOTS * HOSTS


@pytest.fixture(scope="session")
def cluster():
    """Two simulated hosts for the whole session; removed at the end, also when a test failed."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"simulated hosts need network namespaces: {reason}")
    c = netns.SimCluster(hosts=HOSTS, slots=SLOTS).up()
    try:
        yield c
    finally:
        problems = c.down()
        assert not problems, problems
        assert not [ns for ns in netns._netns_list() if ns.startswith(f"{netns.PREFIX}-{c.tag}-")]


class Job:
    """One job on the cluster: its result, the bytes its hosts' veths carried, processes left behind."""

    def __init__(self, result: Result, link_mb: dict, leftovers: dict, wall_s: float):
        self.result, self.link_mb, self.leftovers, self.wall_s = result, link_mb, leftovers, wall_s

    def __repr__(self):
        return f"{self.result!r}\nlink MB {self.link_mb}\nleft over {self.leftovers}\nwall {self.wall_s:.1f}s"


def _reap(cluster: netns.SimCluster, patience_s: float = 15.0) -> dict:
    """Wait (bounded) for the hosts to empty; kill what is still there and return it (orphans)."""
    end = time.monotonic() + patience_s
    left = cluster.pids()
    while any(left.values()) and time.monotonic() < end:
        time.sleep(0.2)
        left = cluster.pids()
    leftovers = {ns: pids for ns, pids in left.items() if pids}
    for ns in leftovers:
        netns._kill_netns_processes(ns)
    return leftovers


def run_job(cluster, tmp_path, *args, via="mpiexec", timeout=180, env=None, script=None, ranks=RANKS,
            hydra=()) -> Job:
    """``streamring ARGS`` (or a probe ``script``) on every rank of the cluster.

    ``via="mpiexec"``: the cluster user's command, ``mpiexec -f HOSTFILE ... -n 4 python -m streamring ...``;
    ``via="launcher"``: ``streamring ... --ranks 4`` with the hostfile handed to the local launcher through
    ``STREAMRING_MPIEXEC_ARGS``. ``hydra``: more mpiexec options (e.g. ``-ppn 1``).
    """
    jp = tmp_path / f"job-{len(list(tmp_path.iterdir()))}.json"
    prog = [sys.executable, str(script)] if script else [sys.executable, "-m", "streamring"]
    tail = list(map(str, args)) + (["--json", str(jp)] if script is None else [])
    full_env = {**cluster.mpi_env(), **(env or {})}
    if via == "mpiexec":
        cmd = [find_mpiexec(), *cluster.mpiexec_args(), *hydra, "-n", str(ranks), *prog, *tail]
    else:
        cmd = [*prog, *tail, "--ranks", str(ranks)]
        full_env[MPIEXEC_ARGS_ENV] = shlex.join([*cluster.mpiexec_args(), *hydra])
    before = cluster.link_bytes()
    t0 = time.monotonic()
    try:
        proc = _run(cmd, timeout, full_env)
    finally:
        leftovers = _reap(cluster)
    wall = time.monotonic() - t0
    after = cluster.link_bytes()
    link_mb = {ns: (after[ns][0] - before[ns][0] + after[ns][1] - before[ns][1]) / 1e6 for ns in after}
    return Job(Result(proc, jp if script is None else None), link_mb, leftovers, wall)


# -- the hosts ----------------------------------------------------------------------------------
def test_ranks_are_on_two_hosts_that_mpi_sees_as_two_nodes(cluster, tmp_path):
    job = run_job(cluster, tmp_path, "identify", script=PROBE, timeout=120)
    assert job.result.rc == 0 and not job.leftovers, job
    ranks = json.loads(next(line for line in job.result.out.splitlines() if line.startswith("[")))
    assert sorted(r["rank"] for r in ranks) == list(range(RANKS)), job
    by_host = {}
    for r in ranks:
        by_host.setdefault(r["hostname"], []).append(r["rank"])
        assert r["processor"] == r["hostname"]
        assert r["node_size"] == SLOTS  # MPI: one node per host
        assert r["shared_windows"] is False  # the CPU backend took Win.Allocate windows
    assert sorted(by_host) == sorted(h.hostname for h in cluster.hosts), by_host
    assert sorted(map(sorted, by_host.values())) == [[0, 1], [2, 3]], by_host
    # each host's only interfaces: loopback and its veth, with the address the hostfile names
    addr = {h.hostname: h.address for h in cluster.hosts}
    for r in ranks:
        assert r["interfaces"] == {"lo": "127.0.0.1", "eth0": addr[r["hostname"]]}, r


def test_inter_host_bytes_cross_the_veths_and_a_bypass_is_caught(cluster, tmp_path):
    """8 MB put from every rank to a rank on the other host must show on the veth counters.

    Negative control: with UCX's default transports the ranks reach the other "host"
    through shared memory (one kernel), the veths stay nearly idle and the check fails.
    """
    mb = 8
    job = run_job(cluster, tmp_path, "traffic", mb, script=PROBE, timeout=120)
    assert job.result.rc == 0 and "PROBE OK" in job.result.out and not job.leftovers, job
    for ns, moved in job.link_mb.items():  # each host sends 2 x 8 MB and receives 2 x 8 MB
        assert moved >= 2 * 2 * mb, (ns, job)
    bypass = run_job(cluster, tmp_path, "traffic", mb, script=PROBE, timeout=120,
                     env={"UCX_TLS": "all", "UCX_NET_DEVICES": "all"})
    assert bypass.result.rc == 0 and "PROBE OK" in bypass.result.out, bypass
    assert all(moved < mb for moved in bypass.link_mb.values()), bypass


# -- stress and the MoE layer across hosts -----------------------------------------------------------
FITTING = ["stress-uneven", "stress-stragglers", "stress-ready-order", "stress-aba"]


@pytest.mark.parametrize("name", FITTING)
def test_stress_config_passes_across_hosts(cluster, tmp_path, name):
    job = run_job(cluster, tmp_path, "stress", "--config", CONFIGS / f"{name}.yaml", timeout=240)
    r = job.result
    assert r.rc == 0 and not job.leftovers, job
    assert r.json["violations"] == 0
    ranks = r.json["ranks"]
    assert len(ranks) == RANKS
    consumed = [x["chunks_consumed"] for x in ranks]
    published = sum(x["chunks_published"] for x in ranks)
    assert consumed == [published] * RANKS, (consumed, published)
    # half of every rank's reads come from the other host: at least that crossed each veth
    read_mb = sum(x["bytes_read"] for x in ranks) / 1e6
    for ns, moved in job.link_mb.items():
        assert moved >= 0.25 * read_mb, (ns, moved, read_mb, job)


INJECT_CASES = [("skip-acquire", "stress-basic"), ("signal-before-payload", "stress-basic"),
                ("skip-ack-wait", "stress-basic"), ("ignore-epoch", "stress-aba")]


@pytest.mark.parametrize("mode,name", INJECT_CASES, ids=[m for m, _ in INJECT_CASES])
def test_every_inject_mode_is_caught_across_hosts(cluster, tmp_path, mode, name):
    job = run_job(cluster, tmp_path, "stress", "--config", CONFIGS / f"{name}.yaml", "--inject", mode,
                  "--set", "wait_timeout_s=10",
                  "--set", "stress.chunks_per_rank=" + ("2" if mode == "ignore-epoch" else "12"),
                  # The published-but-unwritten window is the only thing a reader can catch; at the
                  # default 2 ms a reader on a 2-core machine under load can miss all 12 windows (seen
                  # once at a load average of 20). 50 ms makes a miss need 12 scheduling gaps that long.
                  *(["--set", "stress.inject_delay_s=0.05"] if mode == "signal-before-payload" else []),
                  timeout=180)
    r = job.result
    assert r.rc == 1 and not job.leftovers, job
    if r.json is None:
        # the mutation wedged the ring: caught by a watchdog or a generation check, with the slot dump
        assert ("watchdog" in r.err or "ProtocolViolation" in r.err) and "route_ready_gen" in r.err, job
        return
    assert r.json["violations"] > 0 and r.json["config"]["stress"]["inject"] == mode
    kinds = set().union(*(x["violation_kinds"] for x in r.json["ranks"]))
    expected = {"skip-acquire": {"stale_or_torn"}, "signal-before-payload": {"stale_or_torn"},
                "skip-ack-wait": {"early_reuse"}, "ignore-epoch": {"stale_or_torn"}}[mode]
    assert expected <= kinds, (mode, kinds)


def test_moe_layer_streamed_equals_batch_bitwise_across_hosts(cluster, tmp_path):
    job = run_job(cluster, tmp_path, "run", "--set", "run.tokens_per_rank=[40, 0, 75, 33]", timeout=240)
    r = job.result
    assert r.rc == 0 and not job.leftovers, job
    assert r.json["ok"] and len(r.json["ranks"]) == RANKS
    for rank in r.json["ranks"]:
        assert rank["bitwise_equal"] and rank["ref_ok"], rank
        assert rank["max_abs_stream_minus_batch"] == 0.0


# -- a rank failing on one host --------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_rank_failure_on_one_host_is_named_and_leaves_nothing(cluster, tmp_path, kind):
    """Rank 1 (host 0) is killed or stopped mid-stream, through the local launcher with the hostfile.

    A rank killed by a signal takes its host's other ranks with it (Hydra's proxy SIGKILLs
    them); the ranks on the other host name the unreachable host and its ranks. A stopped
    rank is named by its host-mate's watchdog (``/proc``) or by the other host's watchdog
    on a flush that never completes. Either way the job ends non-zero within the deadline,
    the launcher names rank 1 among the failed, and neither host keeps a process.
    """
    wait_s = 6
    marker = f"stress.seed={os.getpid()}{len(kind)}"  # unique in this job's command lines
    shm_before = {p.name for p in Path("/dev/shm").glob("mpich_shm_*")}
    job = run_job(cluster, tmp_path, "stress", "--set", f"wait_timeout_s={wait_s}",
                  "--set", "stress.chunks_per_rank=60",
                  "--set", f"stress.fault={{rank: 1, at: consume, after_chunks: 4, kind: {kind}}}",
                  "--set", marker, via="launcher", timeout=150)
    r = job.result
    assert r.rc != 0, job
    assert job.wall_s < wait_s + 90, job  # the deadline plus start-up and teardown on a loaded 2-core machine
    assert not job.leftovers, job  # no orphan on either host
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.strip()
    assert left == "", left
    host0 = cluster.hosts[0].hostname
    launcher = [ln for ln in r.err.splitlines() if ln.startswith("streamring launcher:")]
    failed = [ln for ln in launcher if "the failed rank" in ln]
    assert any(ln.startswith("streamring launcher: rank 1 (pid") or
               ("ranks [" in ln and "1" in ln.split("[")[1].split("]")[0].split(", ")) for ln in failed), job
    # another rank's report names rank 1 (or, for a kill, rank 1's host, which went down with it)
    if kind == "kill":
        assert (f"unreachable (host {host0}, ranks [0, 1] there)" in r.err
                or f"towards rank 1 (host {host0})" in r.err or f"towards rank 0 (host {host0})" in r.err), job
    else:
        assert ("rank 1 (pid" in r.err and "stopped" in r.err) or f"towards rank 1 (host {host0})" in r.err, job

    def leaked():
        # Other jobs (tests run at once in other workers) make segments meanwhile: only a segment that no
        # process maps is a leak, and only one that stays (a live job's launcher removes its own at its end).
        from streamring.host.jobfiles import held_files

        new = {p.name for p in Path("/dev/shm").glob("mpich_shm_*")} - shm_before
        if new:
            mapped = set().union(*(held_files(int(p.name)) for p in Path("/proc").glob("[0-9]*")))
            new = {n for n in new if f"/dev/shm/{n}" not in mapped}
        return new

    assert wait_until(lambda: not leaked(), 10.0), leaked()


def test_stopped_peer_alone_on_its_host_is_named_by_the_blocked_call_watchdog(cluster, tmp_path):
    """One rank per host (``-ppn 1``), rank 1 stopped: rank 0 waits inside MPI_Win_flush for it.

    No host-mate can see the stopped process and the flush has no deadline of its own:
    before the blocked-call watchdog (host/bootstrap.py) this job hung for ever. Now the
    watchdog thread names the flush, rank 1 and its host, and the job ends.
    """
    wait_s = 5
    job = run_job(cluster, tmp_path, "stress", "--set", f"wait_timeout_s={wait_s}", "--set", "stress.chunks_per_rank=60",
                  "--set", "stress.fault={rank: 1, at: consume, after_chunks: 4, kind: hang}", via="launcher",
                  ranks=2, hydra=["-ppn", "1"], timeout=150)
    r = job.result
    host1 = cluster.hosts[1].hostname
    assert r.rc != 0 and not job.leftovers, job
    assert job.wall_s < wait_s + 90, job
    assert f"towards rank 1 (host {host1}): that peer makes no progress" in r.err, job
    assert any(ln.startswith("streamring launcher: rank 1 (pid") and "the failed rank" in ln
               for ln in r.err.splitlines()), job


def test_cluster_check_catches_a_leftover_process(cluster, tmp_path):
    """Negative control of the orphan check: a process left in a host's namespace is found and removed."""
    h = cluster.hosts[1]
    sleeper = subprocess.Popen(["nsenter", f"--net=/run/netns/{h.netns}", "--", "sleep", "60"],
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while sleeper.pid not in cluster.pids()[h.netns] and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _reap(cluster, patience_s=0.5)
        assert left == {h.netns: [sleeper.pid]}, left
        assert sleeper.wait(timeout=10) != 0
        assert cluster.pids()[h.netns] == []
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(timeout=10)


def test_leftovers_of_a_killed_run_are_removed(cluster):
    """A namespace and root veth named after a creator that is gone are removed by the next cluster's ``up``."""
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    ns, veth = f"{netns.PREFIX}-{dead.pid}-h0", f"{netns.PREFIX}{dead.pid}r"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"], check=True, timeout=10)
    try:
        removed = netns.remove_stale()
        assert ns in removed and veth in removed, removed
        assert ns not in netns._netns_list()
        assert subprocess.run(["ip", "link", "show", veth], capture_output=True, timeout=10).returncode != 0
        assert all(live in netns._netns_list() for live in cluster.pids())  # the live cluster stays
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=10)


def test_ranks_not_ok_decides_the_launchers_code_when_mpiexec_says_0(tmp_path):
    """An mpiexec may exit 0 after a rank's MPI_Abort (Open MPI's with orte_enable_recovery, seen on the
    GPU host): the local launcher then fails the job from the ranks' own reports."""
    from streamring.host.jobstate import ranks_not_ok

    for r in range(3):
        (tmp_path / f"rank-{r}.pid").write_text(f"{100 + r} h")
    (tmp_path / "rank-0.status").write_text("ok")
    (tmp_path / "rank-1.status").write_text("WatchdogError: rank 1: watchdog: the device waited for ...\nmore")
    assert ranks_not_ok(tmp_path, 3) == {1: "WatchdogError: rank 1: watchdog: the device waited for ...",
                                         2: "no report"}
    (tmp_path / "rank-1.status").write_text("ok")
    (tmp_path / "rank-2.status").write_text("ok")
    assert ranks_not_ok(tmp_path, 3) == {}
    # a rank on another host never sees the job directory: its silence is not a failure
    assert ranks_not_ok(tmp_path, 4) == {}


def test_launcher_summary_names_a_lost_host_and_a_stuck_peer(tmp_path):
    """The job-state summary from rank reports alone (another host's /proc cannot be read)."""
    from streamring.host.jobstate import summarize

    for r, host in enumerate(["hA", "hA", "hB", "hB"]):
        (tmp_path / f"rank-{r}.pid").write_text(f"{100 + r} {host}")
    (tmp_path / "rank-2.status").write_text(
        "PeerUnreachable: rank 2: get to rank 0 failed: peer rank 0 unreachable (host hA, ranks [0, 1] there): "
        "Connection reset by remote peer")
    lines = summarize(tmp_path, 4)
    assert any(ln.startswith("ranks [0, 1] on host hA became unreachable together") for ln in lines), lines
    assert any(ln.startswith("rank 1 (pid 101 on hA) died or hung") for ln in lines), lines
    assert any(ln.startswith("rank 3 (pid 103 on hB) was ended by the job abort") for ln in lines), lines
    (tmp_path / "rank-2.status").write_text(
        "WatchdogError: rank 2: watchdog: blocked 5.2s (wait_timeout_s=5.0) inside the transport's completion of get "
        "towards rank 1 (host hA): that peer makes no progress (a stopped or hung process, ...)")
    lines = summarize(tmp_path, 4)
    assert any(ln.startswith("rank 1 (pid 101 on hA) died or hung") and "the failed rank" in ln for ln in lines), lines
    assert any(ln.startswith("rank 0 (pid 100 on hA) was ended by the job abort") for ln in lines), lines
