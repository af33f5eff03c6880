"""A new user's first hour (issue 16): sizes checked before memory is taken, tables that fit, clean aborts,
errors reported once before the ranks start, verdicts that say what was compared."""

import fcntl
import io
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from conftest import CONFIGS, ROOT, FileWatcher, _env, descendants
from streamring.cli import build_parser
from streamring.device.memcheck import Capacity, HeapSizeError, check_fits, fmt_bytes
from streamring.host.report import Column, Report

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RANK_LINE = "[streamring rank"


# ----------------------------------------------------------------------------------------------
# 1. sizes
# ----------------------------------------------------------------------------------------------
def test_check_fits_gives_bytes_capacity_and_keys():
    shm = Capacity("free /dev/shm", 3_999, remedy="mount a larger /dev/shm")
    check_fits(1_000, 4, capacities=[Capacity("free /dev/shm", 4_000)])  # exactly fits
    with pytest.raises(HeapSizeError) as e:
        check_fits(1_000, 4, capacities=[shm], what="the ring", keys="ring.num_slots (now 4)")
    msg = str(e.value)
    assert "1,000 bytes per rank x 4 ranks = 4,000 bytes" in msg and "but free /dev/shm is 3,999 bytes" in msg, msg
    assert "ring.num_slots (now 4)" in msg and "mount a larger /dev/shm" in msg, msg
    # a per-rank reservation (NVSHMEM_SYMMETRIC_SIZE) is not shared by the ranks
    sym = Capacity("NVSHMEM_SYMMETRIC_SIZE", 1_000, per_rank=True)
    check_fits(1_000, 8, capacities=[sym])
    with pytest.raises(HeapSizeError, match="1,001 bytes per rank, but NVSHMEM_SYMMETRIC_SIZE is 1,000 bytes"):
        check_fits(1_001, 8, capacities=[sym])
    # the default capacities are this machine's: a petabyte per rank never fits
    with pytest.raises(HeapSizeError, match="MemAvailable|/dev/shm"):
        check_fits(1 << 50, 1)
    assert fmt_bytes(3 * 1024**3) == "3,221,225,472 bytes (3.0 GiB)"


@pytest.mark.parametrize("command,sets,key", [
    ("run", ["run.tokens_per_rank=1000000000"], "run.tokens_per_rank"),
    ("stress", ["ring.num_slots=4096", "ring.tokens_per_slot=1048576"], "ring.tokens_per_slot (now 1048576)"),
])
def test_oversized_heap_is_refused_before_any_rank_starts(cli, command, sets, key):
    args = [command]
    for s in sets:
        args += ["--set", s]
    t0 = time.monotonic()
    with FileWatcher(os.getpid()) as w:
        r = cli(*args, json_out=False, timeout=120)
    assert r.rc == 2, r
    assert time.monotonic() - t0 < 30, r  # no rank, no allocation
    assert r.err.count("needs ") == 1 and "per rank x 4 ranks = " in r.err and key in r.err, r
    assert RANK_LINE not in r.err and "Traceback" not in r.err, r
    assert not any(f.startswith("/dev/shm") for f in w.files), w.files  # MPI never started


def test_heap_alloc_checks_the_size_on_every_rank_and_stays_usable(mpirun):
    """The heap's own check (ranks started by mpirun) and the CLI's byte count of `run` against the real rings."""
    r = mpirun(2, "tests/mp_scenarios.py", "alloc_size_check", timeout=120)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r


# ----------------------------------------------------------------------------------------------
# 2. tables
# ----------------------------------------------------------------------------------------------
COLS = [Column("rank"), Column("chunks published"), Column("tokens published"), Column("tokens checked"),
        Column("acquire wait med/max ms"), Column("reuse wait med/max ms"), Column("publish->acquire med/max ms"),
        Column("violations"), Column("chunks/s"), Column("note", wrap=True, justify="left")]
ROWS = [[str(r), "69", str(35 * r), "123456", "0.046/2.881", "0.009/0.024", "3.550/7.122", "0", "461",
         "a free text note that may wrap in a narrow terminal"] for r in range(4)]


@pytest.mark.parametrize("width", [40, 80, 132])
def test_table_fits_the_terminal_and_keeps_every_value(width):
    buf = io.StringIO()
    Report(file=buf, width=width).table("a title longer than some terminals are wide " * 3, COLS, ROWS)
    lines = ANSI.sub("", buf.getvalue()).splitlines()
    assert max(len(ln) for ln in lines) <= width, "\n".join(lines)
    text = "\n".join(lines)
    for row in ROWS:
        for cell in row[:-1]:
            assert cell in text  # numbers are never cut ("expe…") nor wrapped
    if width == 132:
        assert sum(1 for ln in lines if ln.startswith("┏")) == 1  # one table when it fits


def test_plain_form_in_logs_is_one_line_per_row():
    buf = io.StringIO()
    Report(file=buf, width=None).table("title", COLS, ROWS)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "title"
    header = lines[1].split()
    assert header[:3] == ["rank", "chunks_published", "tokens_published"]
    for r, ln in enumerate(lines[2:]):
        assert ln.split()[:9] == ROWS[r][:9]
    assert not any(ch in buf.getvalue() for ch in "┏│━")


def _run_on_terminal(args, columns=80, env=None, timeout=180):
    """Run the CLI with its stdout on a pseudo-terminal of ``columns`` columns; returns (rc, stdout text)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "streamring", *map(str, args)], stdout=slave,
                            stderr=subprocess.PIPE, env=_env(env), cwd=ROOT, start_new_session=True)
    os.close(slave)
    chunks, end = [], time.monotonic() + timeout
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not data:
            break
        chunks.append(data)
        assert time.monotonic() < end, "timed out"
    os.close(master)
    proc.wait(timeout=60)
    return proc.returncode, ANSI.sub("", b"".join(chunks).decode("utf-8", "replace")).replace("\r", "")


QUICK_STRESS = ["stress", "--ranks", 2, "--set", "stress.chunks_per_rank=5", "--set", "stress.epochs=1"]


@pytest.mark.parametrize("columns,env", [(80, None), (132, {"COLUMNS": "60"})], ids=["tty80", "COLUMNS=60"])
def test_rank_table_fits_the_users_terminal(columns, env):
    """Ranks print through mpiexec's pipe: the launcher passes the terminal's width (COLUMNS first) down."""
    rc, out = _run_on_terminal(QUICK_STRESS, columns=columns, env=env)
    width = int(env["COLUMNS"]) if env else columns
    assert rc == 0, out
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= width, out
    assert "violations" in out and "PASS" in out, out
    rank_rows = [ln for ln in lines if re.match(r"^│ +[01] │", ln)]
    assert len(rank_rows) >= 2 * 2, out  # both ranks, in every table of the split


def test_rank_table_in_a_log_is_plain(cli):
    r = cli(*QUICK_STRESS)
    assert r.rc == 0, r
    lines = r.out.splitlines()
    hdr = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["rank"])
    keys = lines[hdr].split()
    rows = [ln.split() for ln in lines[hdr + 1: hdr + 3]]
    assert [row[0] for row in rows] == ["0", "1"] and all(len(row) == len(keys) for row in rows), r.out
    assert not any(ch in r.out for ch in "┏│━"), r.out
    published = dict(zip(keys, rows[0]))
    assert published["tokens_pub"] == str(r.json["ranks"][0]["tokens_published"]), r.out


# ----------------------------------------------------------------------------------------------
# 3. leftovers, 5. the verdict after Ctrl-C
# ----------------------------------------------------------------------------------------------
def test_ctrl_c_leaves_no_process_and_no_file_and_blames_no_rank():
    proc = subprocess.Popen([sys.executable, "-m", "streamring", "stress", "--config", CONFIGS / "soak.yaml"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            start_new_session=True)
    w = FileWatcher(proc.pid, period_s=0.1)
    end = time.monotonic() + 120
    tree: set = set()
    # wait until the job holds its shared-memory segment and Hydra's file
    while not (any(f.startswith("/dev/shm/") for f in w.files) and any(f.startswith("/tmp/") for f in w.files)):
        assert time.monotonic() < end and proc.poll() is None, proc.communicate()
        w.poll()
        tree |= descendants(proc.pid)
        time.sleep(0.1)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10, err
    assert proc.returncode == 130, err
    assert "interrupted (Ctrl-C)" in err and "no rank had failed" in err and "failed rank" not in err, err
    time.sleep(0.5)
    assert [f for f in w.files if os.path.exists(f)] == [], (w.files, err)
    running = []
    for pid in tree:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in "ZX":
            running.append(pid)
    assert running == [], running


# ----------------------------------------------------------------------------------------------
# 4. errors knowable at launch: once, before the ranks start, exit 2
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["run", "--ranks", 3], "num_experts must be divisible by num_ranks=3"),
    (["stress", "--ranks", 3, "--set", "stress.chunks_per_rank=[1, 2]"], "a list needs one entry per rank (3)"),
    (["stress", "--set", "stress.fault={rank: 7, at: ack}"], "stress.fault.rank must be in [0, 4)"),
    (["stress", "--json", "/nonexistent-dir-of-streamring/out.json"], "does not exist"),
], ids=["experts-vs-ranks", "list-length", "fault-rank", "json-dir"])
def test_launch_time_errors_once_before_ranks(cli, args, needle):
    t0 = time.monotonic()
    r = cli(*args, json_out=False, timeout=120)
    assert r.rc == 2, r
    assert r.err.count(needle) == 1 and RANK_LINE not in r.err and "launcher" not in r.err, r
    assert time.monotonic() - t0 < 30, r


def test_launch_time_errors_under_mpirun_are_printed_once(mpirun):
    r = mpirun(3, "-m", "streamring", "stress", "--set", "stress.tokens_per_chunk=[1, 2]")
    assert r.rc == 2 and r.err.count("one entry per rank") == 1 and RANK_LINE not in r.err, r


def test_nvshmem_without_a_gpu_is_one_clear_error(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = cli("run", "--backend", "nvshmem", json_out=False, timeout=120)
    assert r.rc == 2, r
    assert r.err.count("needs a CUDA GPU") == 1 and "Traceback" not in r.err and RANK_LINE not in r.err, r
    assert len(r.err.strip().splitlines()) <= 2, r


# ----------------------------------------------------------------------------------------------
# 5. verdicts
# ----------------------------------------------------------------------------------------------
def test_run_batch_only_does_not_claim_a_streamed_comparison(cli):
    r = cli("run", "--ranks", 2, "--set", "run.mode=batch", "--set", "run.tokens_per_rank=20", "--set", "run.epochs=1")
    assert r.rc == 0, r
    verdict = [ln for ln in r.out.splitlines() if ln.startswith("PASS")]
    assert len(verdict) == 1 and "streamed == batch" not in verdict[0], r.out
    assert "batch output within the float64 reference tolerance" in verdict[0], r.out
    assert "streamed path was not run (run.mode=batch)" in verdict[0], r.out


def test_broken_protocol_reports_its_violations_without_waiting_for_the_watchdog(cli):
    """stress-basic has wait_timeout_s=20: skip-acquire used to wedge the ring and end at the watchdog."""
    t0 = time.monotonic()
    r = cli("stress", "--config", CONFIGS / "stress-basic.yaml", "--inject", "skip-acquire",
            "--set", "wait_timeout_s=60", timeout=200)
    assert r.rc == 1, r
    assert time.monotonic() - t0 < 45, r  # well before the 60 s watchdog
    assert r.json is not None and r.json["violations"] > 0, r
    assert "watchdog" not in r.err, r
    fail = [ln for ln in r.out.splitlines() if ln.startswith("FAIL")]
    assert len(fail) == 1 and "stale_or_torn" in fail[0] and "token reads compared" in fail[0], r.out
    assert any(x["stopped_early"] for x in r.json["ranks"]), r.json["ranks"]


def test_uneven_stress_shows_each_ranks_tokens(cli):
    r = cli("stress", "--config", CONFIGS / "stress-uneven.yaml", *sum((["--set", f"stress.{d}.max_s=0"] for d in (
        "route_delay", "layout_delay", "consumer_delay")), []))
    assert r.rc == 0, r
    # chunks_per_rank [0, 5, 23, 11] of 8 tokens, partial last chunks of 3, 3 epochs: every rank publishes
    # the same number of chunks (empty ones too), the tokens differ
    epochs = 3
    assert [x["tokens_published"] for x in r.json["ranks"]] == [0, epochs * (4 * 8 + 3), epochs * (22 * 8 + 3),
                                                                 epochs * (10 * 8 + 3)]
    assert len({x["chunks_published"] for x in r.json["ranks"]}) == 1
    assert "tokens_pub" in r.out and f" {epochs * (22 * 8 + 3)} " in r.out, r.out


# ----------------------------------------------------------------------------------------------
# 6. help texts
# ----------------------------------------------------------------------------------------------
def test_every_model_check_option_has_help():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["model-check"]
    missing = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
    assert missing == [], missing


def test_pdl_is_refused_before_launch():
    """The EP GPU layer refuses ``pdl`` (streamed != batch on one and on two H200s): the run's config
    check says so before any rank starts, with the policies it offers; the host-verb path allows it."""
    from streamring.config import ConfigError, load_config
    from streamring.runner import check_run_job

    fp8 = ["backend=nvshmem", "nvshmem.progress=pdl", "layer.weight_dtype=fp8"]
    for ranks in (1, 2):
        with pytest.raises(ConfigError, match=r"nvshmem.progress=pdl is refused .* use one of \['serialized', "):
            check_run_job(load_config(None, fp8), ranks)
    check_run_job(load_config(None, fp8 + ["run.gpu_path=host_verbs"]), 2)
    check_run_job(load_config(None, ["backend=nvshmem", "nvshmem.progress=spin_kernel", "layer.weight_dtype=fp8"]), 2)
