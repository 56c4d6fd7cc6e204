"""scripts/local-slurm.sh start --nodes N: a real multi-node SLURM on this machine (no mocks).

Each node is a network + UTS + mount namespace running its own slurmd; the cluster runs beside the shared
single-node one, which these tests never touch (they check that too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import alive

pytestmark = pytest.mark.slurm

ALLREDUCE = """\
import os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"{socket.gethostname()} rank {dist.get_rank()} of {dist.get_world_size()} sum {value.item()}", flush=True)
dist.destroy_process_group()
"""


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def daemon_pids(state_dir: Path) -> dict[str, int]:
    """{pid file name: pid} of the live daemons a state dir's pid files name."""
    pids = {}
    for pid_file in [*state_dir.glob("*.pid"), *state_dir.glob("munge/*.pid")]:
        pid = int(pid_file.read_text().strip() or 0)
        if pid and alive(pid):
            pids[pid_file.name] = pid
    return pids


def test_sinfo_shows_three_idle_nodes(slurm_cluster):
    cluster = slurm_cluster(3)
    assert cluster.node_states() == {"node1": "idle", "node2": "idle", "node3": "idle"}
    # Each node has one CPU and its own address on the bridge.
    out = cluster.run("sinfo", "-h", "-N", "-o", "%N %c %o").stdout.split("\n")
    addresses = {line.split()[2] for line in out if line}
    assert len(addresses) == 3 and all(line.split()[1] == "1" for line in out if line), out


def test_start_twice_is_idempotent(slurm_cluster):
    cluster = slurm_cluster(3)
    before = daemon_pids(cluster.state_dir)
    assert {"slurmctld.pid", "munged.pid", "slurmd-node1.pid", "slurmd-node3.pid"} <= before.keys(), before
    again = cluster.script("start")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.startswith("SLURM already up (3 nodes)"), again.stdout
    assert daemon_pids(cluster.state_dir) == before
    assert len((cluster.state_dir / "created").read_text().splitlines()) == 1 + 2 * 3  # bridge, 3 netns, 3 veths


def test_two_node_job_runs_srun_on_two_nodes(slurm_cluster, tmp_path):
    cluster = slurm_cluster(3)
    out = tmp_path / "job.out"
    job = cluster.sbatch("-N", "2", "-o", str(out), wrap="srun hostname")
    assert cluster.wait_job(job) == "COMPLETED", out.read_text()
    names = out.read_text().split()
    assert len(names) == 2 and len(set(names)) == 2 and set(names) <= set(cluster.nodes), names


def test_torchrun_gloo_all_reduce_across_two_nodes(slurm_cluster, tmp_path):
    cluster = slurm_cluster(3)
    (tmp_path / "allreduce.py").write_text(ALLREDUCE)
    out = tmp_path / "job.out"
    # The job script's recipe: MASTER_ADDR is the allocation's first node, one torchrun per node through srun.
    wrap = (
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1); '
        f"srun --ntasks-per-node=1 bash -c 'exec {sys.executable} -m torch.distributed.run --nnodes 2 "
        '--nproc_per_node 1 --node_rank "$SLURM_PROCID" --master_addr "$MASTER_ADDR" --master_port 29500 allreduce.py\''
    )
    env_job = cluster.sbatch("-N", "2", "-o", str(out), f"--chdir={tmp_path}", "--export=ALL,OMP_NUM_THREADS=1",
                             wrap=wrap)
    assert cluster.wait_job(env_job, timeout=180) == "COMPLETED", out.read_text()
    lines = sorted(line for line in out.read_text().splitlines() if " sum " in line)
    assert [line.split(" ", 1)[1] for line in lines] == ["rank 0 of 2 sum 3.0", "rank 1 of 2 sum 3.0"], out.read_text()
    assert len({line.split()[0] for line in lines}) == 2, lines  # two different nodes


def test_killed_slurmd_marks_its_node_down(slurm_cluster):
    cluster = slurm_cluster(3)
    pid = cluster.slurmd_pid("node3")
    assert pid and alive(pid)
    os.kill(pid, 9)
    try:
        # SlurmdTimeout=10 in the multi-node conf: well within a minute (measured ~15 s).
        deadline = time.monotonic() + 60
        while not (state := cluster.node_states()["node3"]).startswith("down"):
            assert time.monotonic() < deadline, f"node3 still {state!r}"
            time.sleep(0.5)
        assert cluster.node_states()["node1"] == "idle"
        reason = cluster.run("sinfo", "-h", "-n", "node3", "-o", "%E").stdout.strip()
        assert "Not responding" in reason, reason
    finally:
        # The next start brings node3's slurmd back and waits until it serves again (ReturnToService=2).
        back = cluster.script("start")
    assert back.returncode == 0, back.stdout + back.stderr
    assert cluster.node_states()["node3"] == "idle"


def test_stop_leaves_nothing_behind(slurm_cluster):
    hosts_before = Path("/etc/hosts").read_bytes()
    conf_link_before = os.readlink("/etc/slurm/slurm.conf") if os.path.islink("/etc/slurm/slurm.conf") else None
    shared = daemon_pids(Path(os.environ.get("OPSKIT_SLURM_DIR", "/var/lib/opskit-slurm")))
    cluster = slurm_cluster(2, name="stop")
    created = [line.split() for line in (cluster.state_dir / "created").read_text().splitlines()]
    pids = daemon_pids(cluster.state_dir)
    assert len(pids) == 4, pids  # munged, slurmctld, 2 slurmd
    namespaces = {name for kind, name in created if kind == "netns"}
    links = {name for kind, name in created if kind == "link"}
    assert len(namespaces) == 2 and len(links) == 3, created

    done = cluster.script("stop")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [pid for pid in pids.values() if alive(pid)], pids
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not {line.split()[0] for line in netns.splitlines() if line} & namespaces, netns
    ip_link = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert not [name for name in links if f" {name}:" in ip_link or f" {name}@" in ip_link], ip_link
    assert not (cluster.state_dir / "created").exists()
    # Nothing left that uses its conf, nothing changed outside its state dir, the shared cluster untouched.
    conf = str(cluster.conf).encode()
    left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if alive(pid) and conf in cmdline(pid)]
    assert not left, left
    assert Path("/etc/hosts").read_bytes() == hosts_before
    assert (os.readlink("/etc/slurm/slurm.conf") if os.path.islink("/etc/slurm/slurm.conf") else None) \
        == conf_link_before
    assert {name: pid for name, pid in shared.items() if alive(pid)} == shared

    again = cluster.script("stop")
    assert again.returncode == 0 and "nothing to stop" in again.stdout, again.stdout


def test_scripts_pass_shellcheck(shellcheck):
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    shellcheck(scripts / "local-slurm.sh", scripts / "demo-multinode.sh", scripts / "fresh-ci.sh")


def test_a_cluster_whose_state_dir_is_under_a_mode_700_home_starts_and_runs_a_job(tmp_path):
    """`make demo-multinode` from a clone under /root (mode 700) failed in 1 s: munged (user munge)
    could not write its log in the clone's runs/.slurm-multinode. Its files go to /run then, one folder per state
    dir, removed by stop; so does slurmd's spool of a state dir this deep (a step's socket path would pass 107
    bytes: every srun failed)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    home.chmod(0o700)
    state_dir = home / "clone" / "runs" / ".slurm-multinode"
    env = dict(os.environ, OPSKIT_SLURM_DIR=str(state_dir), SLURM_CONF=str(state_dir / "slurm.conf"))
    script = [str(Path(__file__).parents[1] / "scripts" / "local-slurm.sh")]
    ours = set(Path("/run").glob("opskit-munge-*")) | set(Path("/run").glob("opskit-spool-*"))
    try:
        done = subprocess.run([*script, "start", "--nodes", "2"], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        [munge_dir] = set(Path("/run").glob("opskit-munge-*")) - ours
        assert (munge_dir / "munged.pid").is_file() and not (state_dir / "munge").exists()
        job = subprocess.run(["srun", "-N", "2", "hostname"], capture_output=True, text=True, timeout=60, env=env)
        assert (job.returncode, sorted(job.stdout.split())) == (0, ["node1", "node2"]), job.stdout + job.stderr
    finally:
        stopped = subprocess.run([*script, "stop", "--nodes", "2"], capture_output=True, text=True, timeout=120,
                                 env=env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert set(Path("/run").glob("opskit-munge-*")) | set(Path("/run").glob("opskit-spool-*")) == ours
