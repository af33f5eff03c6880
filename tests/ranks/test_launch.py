"""Launchers: local (default), torchrun (refused at once for the cpu backend), check-env."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamring.host.launch import Launcher, detect_launcher

from conftest import ROOT, _env


def test_detect_launcher():
    assert detect_launcher({}) is Launcher.LOCAL
    assert detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "2"}) is Launcher.MPI
    assert detect_launcher({"OMPI_COMM_WORLD_SIZE": "4"}) is Launcher.MPI
    assert detect_launcher({"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}) is Launcher.TORCHRUN


@pytest.mark.ranks
def test_torchrun_with_cpu_backend_fails_at_once_naming_launchers():
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch"
    t0 = time.monotonic()
    p = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "streamring", "run"], capture_output=True,
                       text=True, timeout=120, env=_env(), cwd=ROOT)
    assert p.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "cannot bootstrap from torchrun" in p.stderr and "mpirun -n N" in p.stderr and "--ranks N" in p.stderr


def test_check_env(cli):
    r = cli("check-env")
    assert r.rc == 0, r
    assert "MPI library" in r.out and "cpu backend: ready" in r.out


# --------------------------------------------------------------------------------------
# Preloaded ranks (streamring.host.preload): forks of one server that imported torch and the command
# --------------------------------------------------------------------------------------
def _run_rows(cli, preload: str) -> list:
    r = cli("run", "--ranks", 2, "--set", "layer.num_experts=8", env={"STREAMRING_PRELOAD": preload})
    assert r.rc == 0, r
    return r.json["ranks"]


def test_preloaded_ranks_run_as_fresh_ones_do(cli):
    """The same job with the ranks preloaded (the default) and as fresh interpreters: every row says
    how its process started, the outputs are the same bits, and a preloaded rank runs as many torch
    threads as a fresh one (MKL, loaded in the server, picks its default from Hydra's MPI_LOCALNRANKS)."""
    fresh = _run_rows(cli, "0")
    pre = _run_rows(cli, "1")
    assert [x["preloaded"] for x in fresh] == [False, False], fresh
    assert [x["preloaded"] for x in pre] == [True, True], pre
    assert [x["torch_threads"] for x in pre] == [x["torch_threads"] for x in fresh], (pre, fresh)
    for a, b in zip(pre, fresh):
        assert a["bitwise_equal"] and b["bitwise_equal"]
        assert a["ref_max_abs_err"] == b["ref_max_abs_err"], (a, b)  # the same output against the same reference


@pytest.mark.slow(reason="a fresh 2-rank job, two on the shared server, and two stress jobs at once, the first "
                        "long enough that the second starts while it runs")
def test_a_shared_preload_server_serves_job_after_job_one_at_a_time(cli, shared_preload, tmp_path):
    """The suite's shared servers (tests/conftest.py: one per rank count, streamring.host.preload): a job of the
    default environment forks its ranks from the one of its rank count and runs as a fresh job does; the
    server outlives it and serves the next; a job started while another's ranks live gets plain ranks, and
    both keep their bits and leave nothing behind (the suite's watcher checks the files)."""
    import json
    import os
    import threading

    from conftest import descendants, wait_until
    from streamring.host.preload import SHARED_ENV

    pid = next(int(e.split(":")[0]) for e in shared_preload[SHARED_ENV].split(",") if e.split(":")[1] == "2")
    fresh = _run_rows(cli, "0")
    for _ in range(2):
        r = cli("run", "--ranks", 2, "--set", "layer.num_experts=8")
        assert r.rc == 0, r
        rows = r.json["ranks"]
        assert [x["preloaded"] for x in rows] == [True, True], rows
        assert [x["torch_threads"] for x in rows] == [x["torch_threads"] for x in fresh]
        assert [x["ref_max_abs_err"] for x in rows] == [x["ref_max_abs_err"] for x in fresh]
        os.kill(pid, 0)  # still serving
    # two jobs at once: the second, started while the first's ranks run, gets plain ranks
    results = {}

    def stress(i, chunks):
        out = tmp_path / f"concurrent-{i}.json"
        r = cli("stress", "--ranks", 2, "--set", f"stress.chunks_per_rank={chunks}", "--json", out, json_out=False)
        results[i] = (r, json.loads(out.read_text()) if out.exists() else None)

    first = threading.Thread(target=stress, args=(0, 1500))
    first.start()
    assert wait_until(lambda: len(descendants(pid)) >= 2, 60.0), "the first job's ranks did not start"
    stress(1, 50)
    first.join()
    (r0, j0), (r1, j1) = results[0], results[1]
    assert r0.rc == 0 and r1.rc == 0 and j0["violations"] == j1["violations"] == 0, (r0, r1)
    assert [x["preloaded"] for x in j0["ranks"]] == [True, True], j0["ranks"]
    assert [x["preloaded"] for x in j1["ranks"]] == [False, False], j1["ranks"]
    assert "starting this rank without it" in r1.err, r1


# --------------------------------------------------------------------------------------
# launch/: the device scripts (run on the GPU machine; here only read)
# --------------------------------------------------------------------------------------
def test_device_scripts_parse_and_name_only_what_exists():
    """Every launch/*.sh parses (bash -n), sources the one environment script when it runs on the device,
    and every launch/ file, tests/ file and `python -m` module it names exists."""
    import importlib.util
    import re

    launch = ROOT / "launch"
    for sh in sorted(launch.glob("*.sh")) + [launch / "slurm.sbatch"]:
        p = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
        assert p.returncode == 0, (sh.name, p.stderr)
        text = sh.read_text()
        user_or_cpu_side = ("mpirun.sh", "torchrun.sh", "slurm.sbatch", "fetch_wheels.sh", "build_deep_gemm.sh",
                            "pack_deep_gemm.sh", "preflight.sh",
                            "mps_rank_env.sh")  # (a rank's wrapper: device_env.sh's mps_partitions set it up)
        assert sh.name in user_or_cpu_side or re.search(r"\. launch/device_env\.sh", text), \
            f"{sh.name} does not source launch/device_env.sh"
        named = set(re.findall(r"\b((?:launch|tests)(?:/[\w.-]+)+\.(?:sh|py|c))\b", text))
        missing = {f for f in named if not (ROOT / f).exists()}
        assert not missing, (sh.name, missing)
        for mod in set(re.findall(r"python3? -m ((?:bench|streamring)(?:\.\w+)*)", text)):
            assert importlib.util.find_spec(mod) is not None, (sh.name, mod)


@pytest.mark.ranks
def test_mpirun_sh_runs_without_the_venv_on_path(tmp_path):
    """launch/mpirun.sh with only the system's PATH (the venv not activated): it takes the checkout's
    .venv/bin/python and the mpiexec beside it, and the 2-rank job passes (it used to exit 1 with no output)."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("this checkout has no .venv (bash tests/run.sh makes one)")
    env = {k: v for k, v in _env().items() if not k.startswith(("VIRTUAL_ENV", "MPIEXEC"))}
    env["PATH"] = "/usr/bin:/bin"
    p = subprocess.run(["bash", str(ROOT / "launch" / "mpirun.sh"), "2", "run", "--set", "run.tokens_per_rank=8",
                        "--set", "run.epochs=1", "--json", str(tmp_path / "run.json")],
                       capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert p.returncode == 0 and "PASS" in p.stdout, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
