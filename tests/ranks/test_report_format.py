"""What the user reads: tables that fit the terminal (and plain, one line per rank, in a log), verdict
lines that say what was compared."""

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from conftest import CONFIGS, ROOT, _env
from streamring.host.report import Column, Report

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# ----------------------------------------------------------------------------------------------
# tables
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


@pytest.mark.ranks
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
# verdicts
# ----------------------------------------------------------------------------------------------
def test_run_batch_only_does_not_claim_a_streamed_comparison(cli):
    """A batch-only run's verdict claims no streamed comparison; under the table one legend line says what the
    columns count; and while the ranks compute, rank 0 says what the job does at least every ``progress_s``
    (10 s by default; 0.2 s here, so a run of a few seconds shows several lines on stderr)."""
    r = cli("run", "--ranks", 2, "--set", "run.mode=batch", "--set", "run.tokens_per_rank=1500", "--set", "run.epochs=1",
            "--set", "progress_s=0.2")
    assert r.rc == 0, r
    verdict = [ln for ln in r.out.splitlines() if ln.startswith("PASS")]
    assert len(verdict) == 1 and "streamed == batch" not in verdict[0], r.out
    assert "batch output within the float64 reference tolerance" in verdict[0], r.out
    assert "streamed path was not run (run.mode=batch)" in verdict[0], r.out
    # under the table, one line says what its columns count (experts hit: the rank's own experts, of how many)
    lines = r.out.splitlines()
    legend = [i for i, ln in enumerate(lines) if ln.startswith("legend: ")]
    assert len(legend) == 1 and lines[legend[0] + 1].startswith("PASS"), r.out
    assert "local experts hit = of the rank's own 4 experts (rank r holds 4r..4r+3 of 8)" in lines[legend[0]], r.out
    assert re.search(r"^ +0 +1500 +- +\d/4 ", r.out, re.M), r.out
    # the progress lines: the step and the time spent
    beats = [(float(m[1]), m[2]) for m in re.finditer(r"^streamring run: ([\d.]+) s: (.+)$", r.err, re.M)]
    assert len(beats) >= 2, r
    assert any(what.startswith("epoch 1 of 1: the batch forward, 1500 tokens on rank 0") for _, what in beats), r
    times = [t for t, _ in beats]
    assert times == sorted(times) and max(b - a for a, b in zip(times, times[1:])) < 2.0, times


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

