"""Ctrl-C to the local launcher: the job ends at once, no rank process or MPI file is left, no rank is blamed."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import CONFIGS, ROOT, FileWatcher, _env, descendants, files_held, wait_until


def _sigint_as_in_a_terminal():
    # Ctrl-C reaches a terminal's foreground job with SIGINT at its default. A suite started in the
    # background by a shell without job control runs with SIGINT ignored, the launcher would inherit
    # that (Python keeps an inherited SIG_IGN) and sit out the signal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.ranks
def test_ctrl_c_leaves_no_process_and_no_file_and_blames_no_rank():
    proc = subprocess.Popen([sys.executable, "-m", "streamring", "stress", "--config", CONFIGS / "soak.yaml"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)
    w = FileWatcher(proc.pid, period_s=0.1)
    tree: set = set()
    try:
        _interrupt_and_check(proc, w, tree)
    except BaseException:
        _end_failed_job(proc, w, tree)
        raise


def _end_failed_job(proc, w, tree: set):
    """After a failure, so that no later test sees this job: the launcher's own teardown first (SIGTERM
    to its session), then SIGKILL to every process of the job still there, then the MPI files its
    processes held."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=10)
    for pid in tree | descendants(proc.pid) | {proc.pid}:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=10)
    w.poll()
    for f in w.leftovers():
        with contextlib.suppress(OSError):
            os.unlink(f)


def _interrupt_and_check(proc, w, tree: set):
    def every_rank_holds_the_segment():
        """The job is under way: Hydra's file exists and each of soak.yaml's 4 ranks maps the segment."""
        assert proc.poll() is None, proc.communicate()
        tree.update(descendants(proc.pid))
        w.poll()
        holders = [pid for pid in tree if any(f.startswith("/dev/shm/") for f in files_held(pid))]
        return len(holders) >= 4 and any(f.startswith("/tmp/") for f in w.files)

    assert wait_until(every_rank_holds_the_segment, 120, period_s=0.1), (w.files, tree)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10, err
    assert proc.returncode == 130, err
    assert "interrupted (Ctrl-C)" in err and "no rank had failed" in err and "failed rank" not in err, err

    def running():
        alive = []
        for pid in tree:
            try:
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state not in "ZX":
                alive.append(pid)
        return alive

    # (a process being torn down may take a moment to go, a file a moment to be unlinked; leftovers stay)
    wait_until(lambda: not w.leftovers() and not running(), 5.0)
    assert w.leftovers() == [], (w.files, err)
    assert running() == [], running()


def test_ranks_record_the_mpi_files_they_map_for_the_launcher(tmp_path, monkeypatch):
    # a window made and its job killed between two launcher scans: the rank's own record names it
    from streamring.host import jobfiles
    from streamring.host.jobstate import JOB_DIR_ENV, record_job_files, recorded_job_files

    shm = "/dev/shm/mpich_shm_recordtest_0"
    monkeypatch.setenv(JOB_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(jobfiles, "held_files", lambda pid: {shm} if pid == os.getpid() else set())
    record_job_files(3)
    assert (tmp_path / "rank-3.files").is_file()
    assert recorded_job_files(tmp_path) == {shm}
    monkeypatch.delenv(JOB_DIR_ENV)
    record_job_files(4)  # outside the local launcher: nothing written
    assert not (tmp_path / "rank-4.files").exists()


def test_orphaned_segments_are_this_users_new_unheld_ones(tmp_path):
    # a job that died inside the MPI call making a window: the segment its root made is nobody's
    from streamring.host.jobfiles import orphaned_files

    older = tmp_path / "mpich_shar_tmpOLDER0"
    older.write_bytes(b"x")
    time.sleep(0.05)  # (ctime comes from the kernel's coarse clock)
    since = time.time()
    time.sleep(0.05)
    orphan, held, mapped, unlike = (tmp_path / n for n in (
        "mpich_shar_tmpORPHAN", "mpich_shar_tmpHELD00", "mpich_shm_MAPPED", "not_mpich_NEW000"))
    for f in (orphan, held, mapped, unlike):
        f.write_bytes(b"\0" * 4096)
    # one process holds a segment open, another maps one (its descriptor closed): a live job's files
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'rb'); "
                               "print(flush=True); time.sleep(60)", str(held)], stdout=subprocess.PIPE)
    mapper = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time\n"
                               "with open(sys.argv[1], 'r+b') as f: m = mmap.mmap(f.fileno(), 4096)\n"
                               "print(flush=True); time.sleep(60)", str(mapped)], stdout=subprocess.PIPE)
    try:
        holder.stdout.readline(), mapper.stdout.readline()
        assert orphaned_files(since, str(tmp_path)) == [str(orphan)]
        mapper.kill(), mapper.wait()
        assert orphaned_files(since, str(tmp_path)) == sorted([str(orphan), str(mapped)])
    finally:
        for p in (holder, mapper):
            p.kill(), p.wait()
