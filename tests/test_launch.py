"""`sbpc launch`: the rendered torchrun and slurm scripts, and a two-"host" run on loopback that
trains like the single-host `sbpc run` of the same plan."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def plan_2x2(tmp_path_factory):
    """examples/gpt.py (one layer) on dp=2 x tp=2 with Megatron's hints: tp collectives every layer."""
    from sbpc.cli import main

    path = tmp_path_factory.mktemp("launch") / "gpt.2x2.json"
    os.chdir(ROOT)
    assert main(["compile", "examples/gpt.py", "--mesh", "2x2", "--config", "examples/gpt.megatron.toml",
                 "--set", "layers=1", "-o", str(path)]) == 0
    return path


def launch(plan, *flags, capsys) -> str:
    from sbpc.cli import main

    capsys.readouterr()
    assert main(["launch", str(plan), *flags]) == 0
    return capsys.readouterr().out


def test_torchrun_script_has_the_rank_map_and_the_environment(plan_2x2, capsys):
    text = launch(plan_2x2, "--nodes", "2", "--emit", "torchrun", "--master-addr", "10.0.0.1", "--ifname", "ib0",
                  capsys=capsys)
    assert "#   rank 1: node 0, local rank 1: dp=0, tp=1\n#   rank 2: node 1, local rank 0: dp=1, tp=0\n" in text
    for line in ("export MASTER_ADDR=10.0.0.1", "export MASTER_PORT=29500", "export NCCL_SOCKET_IFNAME=ib0",
                 "export GLOO_SOCKET_IFNAME=ib0", f"cd {ROOT}"):
        assert line + "\n" in text or line + "  #" in text, line
    assert re.search(r"exec torchrun --nnodes 2 --nproc-per-node 2 --node-rank \"\$node_rank\" \\\n.*\\\n"
                     r"  -m sbpc\.runtime\.cli \S+gpt\.2x2\.json --backend cpu \"\$@\"\n", text)
    assert "Warning" not in text  # tp=2 fits in 2 devices per node
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_slurm_script_is_an_sbatch_job_with_srun(plan_2x2, capsys, tmp_path):
    out = tmp_path / "job.sh"
    said = launch(plan_2x2, "--nodes", "2", "--emit", "slurm", "--backend", "cuda", "-o", str(out), capsys=capsys)
    assert f"wrote {out}: 4 ranks on 2 node(s) x 2; submit it: sbatch {out}" in said
    text = out.read_text()
    assert os.access(out, os.X_OK)
    assert text.startswith("#!/usr/bin/env bash\n#SBATCH --job-name=sbpc-gpt\n#SBATCH --nodes=2\n"
                           "#SBATCH --ntasks-per-node=2\n#SBATCH --gpus-per-node=2\n")
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in text
    assert "# export NCCL_SOCKET_IFNAME=eth0" in text  # no --ifname: left to NCCL, shown how to set
    assert re.search(r"srun --kill-on-bad-exit=1 --distribution=block \\\n.*RANK=\"\$SLURM_PROCID\" "
                     r"LOCAL_RANK=\"\$SLURM_LOCALID\" WORLD_SIZE=\"\$SLURM_NTASKS\"; exec sbpc-run .*\n"
                     r"  sbpc-run \S+gpt\.2x2\.json --backend cuda \"\$@\"\n", text)
    subprocess.run(["bash", "-n", str(out)], check=True)


def test_a_tp_group_split_across_nodes_is_flagged(plan_2x2, capsys):
    text = launch(plan_2x2, "--nodes", "4", "--emit", "torchrun", capsys=capsys)
    assert "# Warning: tp=2 does not fit in 1 devices per node, so its groups span nodes" in text


def test_the_script_refuses_a_missing_node_rank(plan_2x2, capsys, tmp_path):
    launch(plan_2x2, "--nodes", "2", "--emit", "torchrun", "-o", str(tmp_path / "l.sh"), capsys=capsys)
    proc = subprocess.run([str(tmp_path / "l.sh"), "--node-rank", "2"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "error: pass --node-rank K with K from 0 to 1, not '2'; hint:" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^ iteration +(\d+)/.*\| lm loss: (\S+) \|", text, re.M)


@pytest.fixture(scope="module")
def single_host_losses(plan_2x2):
    """The step lines of the single-host `sbpc run` of the plan (4 spawned ranks)."""
    import contextlib
    import io

    from sbpc.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # one intra-op thread everywhere: a kernel's rounding may depend on its thread count
        assert main(["run", str(plan_2x2), "--steps", "3", "--threads", "1"]) == 0
    losses = _losses(out.getvalue())
    assert len(losses) == 3
    return losses


def _clean_env(bin_dirs) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = os.pathsep.join([*map(str, bin_dirs), env["PATH"]])
    return env


RUN_FLAGS = ["--steps", "3", "--threads", "1", "--timeout", "120"]


def test_two_hosts_on_loopback_train_like_one(plan_2x2, single_host_losses, capsys, tmp_path):
    """2 nodes x 2 ranks: the emitted torchrun script started twice on 127.0.0.1 (node ranks 0 and
    1) prints the losses of the single-host `sbpc run` of the same plan."""
    script = tmp_path / "launch.sh"
    launch(plan_2x2, "--nodes", "2", "--emit", "torchrun", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-o", str(script), capsys=capsys)
    env = _clean_env([VENV_BIN])  # the venv's torchrun
    nodes = [subprocess.Popen([str(script), "--node-rank", str(k), *RUN_FLAGS], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err for _, err in outs]
    assert _losses(outs[0][0]) == single_host_losses, outs[0]
    assert _losses(outs[1][0]) == []  # rank 0 prints; node 1 holds ranks 2 and 3


FAKE_SRUN = """#!/usr/bin/env bash
# srun of one job step on this machine: its tasks in block order, as SLURM numbers them
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((k = 0; k < SLURM_NTASKS; k++)); do
  SLURM_PROCID=$k SLURM_LOCALID=$((k % SLURM_NTASKS_PER_NODE)) SLURM_NODEID=$((k / SLURM_NTASKS_PER_NODE)) "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def test_the_slurm_job_trains_like_one_host(plan_2x2, single_host_losses, capsys, tmp_path):
    """The sbatch script under a stand-in srun (4 local tasks, SLURM_PROCID 0-3) and scontrol
    (the node list is 127.0.0.1): the same losses as the single-host run."""
    script = tmp_path / "job.sh"
    launch(plan_2x2, "--nodes", "2", "--emit", "slurm", "--master-port", str(_free_port()), "-o", str(script),
           capsys=capsys)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**_clean_env([bin_dir, VENV_BIN]), "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_NODELIST": "node[0-1]"}
    proc = subprocess.run(["bash", str(script), *RUN_FLAGS], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert _losses(proc.stdout) == single_host_losses, proc.stdout
