"""Two nodes on loopback: two torchrun agents (--nnodes 2 --nproc_per_node 1, c10d rendezvous at 127.0.0.1, gloo)
train to the losses of one process, and only global rank 0 writes the run's shared files. A node SIGKILLed (its
agent and its worker) makes the other exit instead of hanging, and both relaunched with --resume end with every
step's loss of one uninterrupted process. An --out that one node does not see is refused at start."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import zoo
from recipes import pretrain
from recipes.data.tokenizer_choice import ASSETS

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="finds the agents' workers (and any stray process) through /proc")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
ARGS = ["--steps", str(STEPS), "--seq-len", "32", "--batch-tokens", "64", "--no-progress", "--device", "cpu"]
MARK = "ZOO_TEST_MULTINODE"  # in the environment of every process a test starts, so that it can end them all
WAIT_S = 120  # a launch that takes longer hangs


def rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def children(pid):
    """The pids whose parent is `pid` (torchrun starts its workers in sessions of their own)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def marked(mark):
    """The pids of every process whose environment holds MARK=mark: agents, workers, and workers orphaned by a
    killed agent."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"{MARK}={mark}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """Two torchrun agents on this machine, as on two nodes, meeting at 127.0.0.1:PORT. On a cluster the agent on the
    endpoint's host serves the rendezvous; here both agents are on that host, so --rdzv-conf is_host names node 0."""

    def __init__(self, tmp_path):
        self.tmp, self.mark, self.started = tmp_path, uuid.uuid4().hex, []

    def launch(self, name, args_of_node):
        """Start both agents; `args_of_node(n)` is node n's recipe arguments. Returns their Popens; their
        stdout/stderr go to TMP/NAME.node{n}.out/err."""
        port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{MARK: self.mark})
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        agents = []
        for n in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"{name}-{port}",
                   "--rdzv-conf", f"is_host={int(n == 0)}", "--max-restarts", "0",
                   "-m", "recipes.pretrain", *args_of_node(n)]
            with open(self.tmp / f"{name}.node{n}.out", "w") as out, open(self.tmp / f"{name}.node{n}.err", "w") as err:
                agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err,
                                               start_new_session=True))
        self.started += agents
        return agents

    def output(self, name, n, stream="out"):
        return (self.tmp / f"{name}.node{n}.{stream}").read_text()

    def wait(self, name, agents):
        """Both agents' exit codes; fails the test if one is still running after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        codes = []
        for n, agent in enumerate(agents):
            try:
                codes.append(agent.wait(timeout=max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name}: node {n}'s torchrun still runs after {WAIT_S} s: "
                            f"{self.output(name, n, 'err')[-3000:]}")
        return codes

    def end_all(self):
        """SIGKILL every process a launch started, its workers too (orphaned or not)."""
        for pid in marked(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for agent in self.started:
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            agent.wait()


@pytest.fixture
def nodes(tmp_path):
    launched = Nodes(tmp_path)
    try:
        yield launched
    finally:
        launched.end_all()
        deadline = time.monotonic() + 10
        while marked(launched.mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not marked(launched.mark), "a process of the test survived SIGKILL"


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    """The debug model's initial weights as a checkpoint directory: FSDP loads them sharded, rank 0 reading them
    and sending each node its shards."""
    path = tmp_path_factory.mktemp("init")
    torch.manual_seed(0)
    zoo.save(zoo.load("debug"), path, tokenizer_from=str(ASSETS))
    return path


@pytest.fixture(scope="module")
def one(tmp_path_factory, init):
    """The --out of one uninterrupted process."""
    out = tmp_path_factory.mktemp("one") / "run"
    pretrain.main([*ARGS, "--model", str(init), "--save-every", "0", "--out", str(out)])
    return out


def assert_equals_one(out, one):
    """Every step logged once (a second writer would log it twice), each loss and gradient norm within what the
    2-process tests allow (FSDP's reductions add in another order than one process), and the same exported weights:
    within 1e-4, as 16 AdamW steps grow the 2-process tests' 1e-5 after 3 (a step moves a weight by up to --lr)."""
    have, want = rows(out), rows(one)
    assert [r["step"] for r in have] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in have] == pytest.approx([r["loss"] for r in want], abs=2e-5)
    assert [r["grad_norm"] for r in have] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
    have, want = (zoo.load(str(o / "model")).state_dict() for o in (out, one))
    assert have.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(have[name], t, atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_a_killed_node_then_resume_equals_uninterrupted(nodes, init, one, tmp_path):
    """SIGKILL node 1 (agent and worker, as when the machine dies) after a checkpoint: node 0's torchrun exits with
    an error (gloo sees the connection close) instead of waiting; both relaunched with --resume continue from the
    newest complete checkpoint, and every step's loss is one uninterrupted process's. The two launches are also the
    test of two nodes against one process: every step (before and after the kill) equals one process's, the final
    checkpoint holds both nodes' shards, and global rank 0 alone reports and exports."""
    out = tmp_path / "killed"
    args = [*ARGS, "--model", str(init), "--save-every", "2", "--out", str(out)]
    agents = nodes.launch("killed", lambda n: args)
    deadline = time.monotonic() + WAIT_S
    workers = []
    while not workers or not list((out / "checkpoints").glob("step_*/trainer_state.json")):
        workers = workers or children(agents[1].pid)
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            pytest.fail(f"no checkpoint while both nodes ran: {[a.poll() for a in agents]} "
                        f"{nodes.output('killed', 0, 'err')[-2000:]} {nodes.output('killed', 1, 'err')[-2000:]}")
        time.sleep(0.01)
    for pid in [*workers, agents[1].pid]:  # each a session leader: its group is itself and what it started
        os.killpg(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        code = agents[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node 0 still runs 60 s after node 1 was killed: {nodes.output('killed', 0, 'err')[-3000:]}")
    assert code != 0, nodes.output("killed", 0)[-2000:]
    waited = time.monotonic() - killed_at
    assert not (out / "model").exists(), "the run finished before node 1 was killed"
    done = sorted(int(p.parent.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*/trainer_state.json"))
    assert done and max(done) < STEPS

    agents = nodes.launch("resumed", lambda n: [*args, "--resume"])
    codes = nodes.wait("resumed", agents)
    assert codes == [0, 0], nodes.output("resumed", codes.index(max(codes)), "err")[-3000:]
    said = nodes.output("resumed", 0) + nodes.output("resumed", 1)
    assert f"resumed from {out / 'checkpoints' / f'step_{max(done):08d}'} at step {max(done)}" in said, said[-2000:]
    assert_equals_one(out, one)
    # the final checkpoint holds both nodes' shards and RNG states, written into the one --out
    final = out / "checkpoints" / f"step_{STEPS:08d}"
    assert sorted(p.name for p in final.glob("rng_rank*.json")) == ["rng_rank0.json", "rng_rank1.json"]
    assert len(list(final.glob("shard-*.safetensors"))) == 2
    # global rank 0 alone reports and exports, on whichever node the rendezvous made it
    said_by = [nodes.output("resumed", n) for n in (0, 1)]
    assert sorted(s.count("done: ") for s in said_by) == [0, 1], said_by
    assert sum(s.count(f"saved {out / 'model'}") for s in said_by) == 1
    assert sum(len(re.findall(r"^step\s+\d+\s+loss", s, re.M)) for s in said_by) == STEPS - max(done)
    print(f"node 0 exited {waited:.1f} s after node 1 was killed; resumed at step {max(done)} of {STEPS}")


def test_an_out_that_a_node_does_not_see_is_refused(nodes, init, tmp_path):
    """Each node its own --out, as on disks of their own: without the check the run trains, but its checkpoints lack
    node 1's shards and no --resume loads them. Both nodes stop at start, saying why, and leave nothing behind."""
    outs = [tmp_path / "node0-disk", tmp_path / "node1-disk"]
    agents = nodes.launch("split", lambda n: [*ARGS, "--model", str(init), "--out", str(outs[n])])
    codes = nodes.wait("split", agents)
    errors = nodes.output("split", 0, "err") + nodes.output("split", 1, "err")
    assert codes[0] != 0 and codes[1] != 0, errors[-3000:]
    for n in (0, 1):  # each node says why, its first rank in one line of its own: node 1's agent may not report,
        # as it loses the rendezvous when node 0's agent (its host) exits first
        assert re.search(r"^error: --out .*: rank 0 does not see what rank 1 of 2 wrote there; --out must be one "
                         r"directory that every node sees", nodes.output("split", n, "err"), re.M), errors[-3000:]
    assert not re.search(r"^\[rank\d\]:", errors, re.M), errors[-3000:]  # a worker's traceback: not refused cleanly
    assert [sorted(p.name for p in o.iterdir()) for o in outs] == [[], []]
