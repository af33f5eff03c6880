"""Ctrl-C to the local launcher: the job ends at once, no rank process or MPI file is left, no rank is blamed."""

import os
import signal
import subprocess
import sys
import time

from conftest import CONFIGS, ROOT, FileWatcher, _env, descendants


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
