"""One worker over two machines (issue 36): `--tensor-parallel 2 --nnodes 2`, node 0 and node 1 each on a host of its
own (network namespaces on one bridge, draftfeed/bench/hosts.py), the broker and the rank on a third.

- The supervision equals transformers' plan over two processes on one machine (tests/tp_reference.py), bit for bit:
  EAGLE-3 on the tiny Llama, DSpark on the tiny DeepSeek-V3 in its real proportions (the case of docs/engines.md,
  "DeepSeek-V3 and Kimi-K2 over two 8-GPU nodes"; the engine makes the same calls for every task).
- A node lost mid-run (its link cut for good, or its processes SIGKILLed): the worker ends, the run completes on
  another worker, every batch once, in order, each equal to the reference; nothing of the two-node worker is left
  running on either host.
- A node started with another plan (degree, target), or that never comes: one line on both nodes, within seconds.
- Mistakes in the node flags: one line before anything loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TESTS_DIR, WORKER_ENV, assert_supervision_equal, run_concurrently, suite_folder, wait_until
from support import preload
from support.lines import wait_for_line
from support.tensor_parallel import SERVED, expected, shared_tensor_parallel_reference

from draftfeed.bench.hosts import Hosts
from draftfeed.consumers.nodes import describe_difference, fingerprint, node_plan
from draftfeed.dataplane.nixl.transport import unavailable
from draftfeed.processes import commands
from draftfeed.tiny import build_tiny_target

pytestmark = pytest.mark.timeout(300)

PORT = 29517  # node 0's --master-addr port: the namespaces' addresses are the tests' own, so any port does
LIVENESS = ["--heartbeat-interval", "0.25", "--liveness", "8"]  # the broker finds a silent worker in 2 s
RUN = [f"run-{i}" for i in range(12)]


@pytest.fixture(scope="module")
def reference(tp_targets, tmp_path_factory) -> dict[str, torch.Tensor]:
    return shared_tensor_parallel_reference(tp_targets, suite_folder(tmp_path_factory))


def start_all(*starts) -> list[commands.Process]:
    """Each start on its own thread (node 0 is ready only once node 1 has joined); the processes in the same order."""
    out: list = [None] * len(starts)

    def each(index: int) -> None:
        out[index] = starts[index]()

    run_concurrently(*[lambda index=index: each(index) for index in range(len(starts))], timeout_s=240)
    return out


def node_flags(hosts: Hosts, node: int, *extra: str) -> list[str]:
    return ["--tensor-parallel", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr", f"{hosts.address('node-0')}:{PORT}", *extra]


def start_node(hosts: Hosts, broker: commands.Process, target: Path, node: int, *extra: str, env: dict[str, str] | None = None) -> commands.Process:
    """Node ``node`` of a two-node worker (node 0 registers with the broker; node 1 says it is ready once its process runs)."""
    return commands.start_worker(
        broker.ready["backend"], str(target), *node_flags(hosts, node, *extra), env=env or WORKER_ENV, prefix=hosts.command(f"node-{node}")
    )


def start_rank(
    hosts: Hosts, broker: commands.Process, service: str, task: str, names: list[str], out: Path, batches: str = "tp_reference"
) -> commands.Process:
    return commands.start(
        [
            "--broker",
            broker.ready["frontend"],
            "--service",
            service,
            "--task",
            task,
            "--names",
            ",".join(names),
            "--out",
            str(out),
            "--batches",
            batches,
        ],
        module="tp_rank",
        env=WORKER_ENV,
        prefix=hosts.command("head"),
    )


def result_of(rank: commands.Process, out: Path) -> tuple[list[str], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    result = json.loads(wait_for_line(rank, "^RESULT ", timeout_s=180)[len("RESULT ") :])
    assert result["error"] is None, result["error"]
    return result["order"], load_file(out)


def received(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {key.split("/", 1)[1]: value for key, value in tensors.items() if key.startswith(f"{name}/")}


class Supervision:
    """A rank's supervision as assert_supervision_equal reads it."""

    def __init__(self, fields: dict[str, torch.Tensor]) -> None:
        self._fields = fields

    def as_dict(self) -> dict[str, torch.Tensor]:
        return self._fields


def pids_on(hosts: Hosts, host: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", hosts.namespace(host)], capture_output=True, text=True, timeout=10).stdout
    return [int(pid) for pid in out.split()]


def show(started: list[commands.Process]) -> None:
    for process in started:  # shown by pytest when the test fails
        print(
            f"---- {' '.join(str(a) for a in process.popen.args[-10:])}\n"
            + "\n".join(line for line in process.log_tail if not line.startswith("batch "))
        )


# ---------------------------------------------------------------- exact over two machines
def test_two_nodes_equal_the_same_plan_on_one_machine(hosts_available, tp_targets, reference, tmp_path):
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), prefix=hosts.command("head"))
            started.append(broker)
            # One worker at a time on the two nodes (each node 0 listens on the same --master-addr port).
            for name, task in SERVED.items():
                service = f"nodes-{name}"
                args = ["--service", service, "--task", task]
                nodes = start_all(
                    lambda target=tp_targets[name], args=args: start_node(hosts, broker, target, 0, *args),
                    lambda target=tp_targets[name], args=args: start_node(hosts, broker, target, 1, *args),
                )
                started += nodes
                names = ["plain-0", "plain-1", "full", "packed-0", "packed-1"]
                out = tmp_path / f"{name}.safetensors"
                rank = start_rank(hosts, broker, service, task, names, out)
                started.append(rank)
                order, tensors = result_of(rank, out)
                assert order == names
                for batch in names:
                    assert_supervision_equal(Supervision(received(tensors, batch)), expected(reference, name, task, batch))
                for node in reversed(nodes):  # SIGTERM on node 0 stops node 1 too
                    assert node.stop(timeout_s=30) == 0, "\n".join(node.log_tail[-20:])
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)


FRONTIER_FAMILIES = ("deepseek-v32", "deepseek-v4", "glm-moe-dsa", "minimax-m2", "qwen3.5-moe", "glm5-next", "minimax-m3-vl", "kimi-k2.5")


@pytest.mark.long
@pytest.mark.parametrize("family", FRONTIER_FAMILIES)
def test_frontier_families_over_two_nodes_equal_the_same_plan_on_one_machine(hosts_available, family, tmp_path):
    """The frontier families at ``--tensor-parallel 2 --nnodes 2`` (hf: transformers' plan, with draftfeed's plan
    entries where it has any, over a process on each of two hosts; the image-text ones on text batches): DSpark on padded
    batches equals the same plan over two processes of the test's own on one machine (tests/tp_reference.py, the class
    the worker loads, one thread a process as the workers'), bit for bit."""
    from safetensors.torch import load_file
    from tp_reference import DSPARK_IDS

    from draftfeed.net import free_port

    target = build_tiny_target(tmp_path / family, arch=family, num_hidden_layers=8)
    names = ["plain-0", "plain-1", "full"]
    reference_file = tmp_path / "reference.safetensors"
    served = [str(free_port()), str(reference_file), f"dspark={target}"]
    preload.run_two_ranks("tp_reference", served, {**os.environ, **WORKER_ENV}, 240, "the tensor-parallel reference")
    reference = load_file(str(reference_file))
    flags = ["--service", f"nodes-{family}", "--task", "dspark", "--target-layer-ids", ",".join(map(str, DSPARK_IDS))]
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), prefix=hosts.command("head"))
            started.append(broker)
            started += start_all(*[lambda node=node: start_node(hosts, broker, target, node, *flags) for node in (0, 1)])
            out = tmp_path / "received.safetensors"
            rank = start_rank(hosts, broker, f"nodes-{family}", "dspark", names, out)
            started.append(rank)
            order, tensors = result_of(rank, out)
            assert order == names
            for name in names:
                prefix = f"0/dspark/{name}/"
                assert_supervision_equal(
                    Supervision(received(tensors, name)), {k[len(prefix) :]: v for k, v in reference.items() if k.startswith(prefix)}
                )
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)


@pytest.mark.long
def test_the_automodel_engine_over_two_nodes_equals_nemos_own_model_sharded_alike(hosts_available, tmp_path):
    """``--engine automodel --tensor-parallel 2 --nnodes 2 --expert-parallel``: NeMo's model of DeepSeek-V4.1 sharded
    over a process on each host (FSDP and NeMo's expert mesh across the bridge); DSpark on padded batches equals NeMo's
    wrappers around NeMo's own model sharded alike in two processes on one machine (tests/automodel_reference.py), bit
    for bit at real positions."""
    from automodel_reference import RUN_BATCHES, batches
    from reference import difference_at_real
    from support.automodel import nemo_path_env, sharded_reference
    from support.nemo import nemo_on_path

    from draftfeed.tiny import build_tiny_nemo_target

    nemo_on_path()
    target = build_tiny_nemo_target(tmp_path / "deepseek-v41")
    reference = sharded_reference({"deepseek-v41": target}, tmp_path / "reference.safetensors")
    names = [f"run-{i}" for i in range(RUN_BATCHES)]
    env = {**WORKER_ENV, **nemo_path_env()}
    flags = ["--engine", "automodel", "--expert-parallel", "--service", "nodes-automodel", "--task", "dspark", "--target-layer-ids", "1,3,5"]
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), prefix=hosts.command("head"))
            started.append(broker)
            started += start_all(*[lambda node=node: start_node(hosts, broker, target, node, *flags, env=env) for node in (0, 1)])
            out = tmp_path / "automodel.safetensors"
            rank = start_rank(hosts, broker, "nodes-automodel", "dspark", names, out, batches="automodel_reference")
            started.append(rank)
            order, tensors = result_of(rank, out)
            assert order == names
            problems = [
                problem
                for name in names
                for field in ("target_hidden_states", "target_last_hidden_states")
                if (
                    problem := difference_at_real(
                        f"{name} {field}",
                        tensors[f"{name}/{field}"],
                        reference[f"deepseek-v41/{name}/dspark/{field}"],
                        batches()[name]["attention_mask"],
                    )
                )
            ]
            assert problems == []
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)


# The policy trainer and a rank in one process on the head host (the test's own process is on none of the hosts): each
# step updates the service from a file (update_target) or publishes the file's tensors from this process's memory on
# the head's address (publish_weights), then asks for a batch at that version and gathers lm_head; saves both in OUT
# (keys VERSION/FIELD, lm_head/VERSION) and prints each step's report and label, as JSON.
UPDATES = """
import json, sys
from safetensors.torch import load_file, save_file
from tp_reference import batches
import draftfeed

broker, service, head, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
received, said = {}, []
for how, path, version in steps:
    if how == "file":
        report = draftfeed.update_target(broker, service, path, version, timeout_s=120)
    else:
        tensors = load_file(path)
        report = draftfeed.publish_weights(broker, service, tensors, version, chunk_bytes=4096, timeout_s=120, endpoint=f"tcp://{head}:*")
    with draftfeed.RemoteEagle3Target(broker, service, min_target_version=version, wait_for_workers=60) as remote:
        supervision = remote.generate_batch(**batches()["plain-0"])
        received[f"lm_head/{version}"] = remote.get_output_embeddings().weight.contiguous().clone()
    received |= {f"{version}/{field}": tensor.contiguous().clone() for field, tensor in supervision.as_dict().items()}
    said.append({"workers": [[r.ok, r.target_version] for r in report.workers], "label": supervision.target_version})
save_file(received, out)
print(json.dumps(said))
"""


@pytest.mark.long  # the suite sends updates to a two-process worker on one host (test_tensor_parallel.py)
def test_updates_from_a_file_and_from_a_publisher_reach_both_nodes(hosts_available, tp_targets, reference, tmp_path):
    """A two-node worker takes weight updates in place (issue 48) from a file every process reads, and published from
    a trainer's memory on a third host, which every process pulls itself over the bridge: a step that changes layer 2
    and lm_head from a file, the original weights back published, a published step, the original back from a file.
    Each version's batch says it; lm_head gathered from the two nodes' shards equals the version's bit for bit; the
    supervision differs from the plan's reference at a step and equals it bit for bit with the original weights back."""
    from safetensors.torch import load_file, save_file

    saved = load_file(str(tp_targets["llama"] / "model.safetensors"))
    original = {name: t for name, t in saved.items() if ".layers.2." in name or name == "lm_head.weight"}
    save_file({name: t + 0.05 for name, t in original.items()}, str(tmp_path / "step.safetensors"))
    save_file(original, str(tmp_path / "back.safetensors"))
    steps = [("file", "step", 1), ("publish", "back", 2), ("publish", "step", 3), ("file", "back", 4)]
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), prefix=hosts.command("head"))
            started.append(broker)
            args = ["--service", "nodes-updates", "--task", "eagle3"]
            nodes = start_all(
                lambda: start_node(hosts, broker, tp_targets["llama"], 0, *args),
                lambda: start_node(hosts, broker, tp_targets["llama"], 1, *args),
            )
            started += nodes
            out = tmp_path / "updates.safetensors"
            wire = json.dumps([[how, str(tmp_path / f"{weights}.safetensors"), version] for how, weights, version in steps])
            command = [*hosts.command("head"), sys.executable, "-c", UPDATES, broker.ready["frontend"], "nodes-updates", hosts.address("head")]
            done = subprocess.run([*command, str(out), wire], capture_output=True, text=True, timeout=240, env={**_env(), **WORKER_ENV})
            assert done.returncode == 0, done.stderr[-3000:]
            said, got = json.loads(done.stdout.strip().splitlines()[-1]), load_file(out)
            assert said == [{"workers": [[True, version]], "label": version} for _how, _weights, version in steps], said
            want = expected(reference, "llama", "eagle3", "plain-0")
            for how, weights, version in steps:
                lm_head = original["lm_head.weight"] + 0.05 if weights == "step" else original["lm_head.weight"]
                assert torch.equal(got[f"lm_head/{version}"], lm_head), f"version {version} ({how}): lm_head's shards"
                if weights == "back":
                    assert_supervision_equal(Supervision(received(got, str(version))), want)
                else:
                    assert not torch.equal(got[f"{version}/aux_hidden_states"], want["aux_hidden_states"]), f"version {version} ({how})"
            if unavailable() is None:  # the published pieces are read over NIXL, across the bridge, by every process
                for node in nodes:
                    assert sum("read over NIXL" in line for line in node.log_tail) == 2, "\n".join(node.log_tail[-20:])
            for node in reversed(nodes):  # SIGTERM on node 0 stops node 1 too
                assert node.stop(timeout_s=30) == 0, "\n".join(node.log_tail[-20:])
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)


@pytest.mark.long  # the hf engine's two nodes run in the suite; this one is sglang's stand-in over the same path
def test_sglang_over_two_nodes_meets_at_node_0(hosts_available, tiny_target, tiny_model, tmp_path):
    """The sglang engine across machines, against the FAKE sglang (tests/fake_sglang: sglang cannot be installed here):
    each node's ModelRunner gets --nnodes, --node-rank and dist_init_addr at node 0, as sglang's own flags place
    ranks, and the group meets there. What comes back equals the fake at one rank, which equals hf within 1e-6."""
    from reference import reference_eagle3
    from tp_reference import AUX, batches

    fake = {"PYTHONPATH": os.pathsep.join([str(Path(TESTS_DIR) / "fake_sglang"), WORKER_ENV["PYTHONPATH"]])}
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), prefix=hosts.command("head"))
            started.append(broker)
            args = ["--service", "nodes-sglang", "--engine", "sglang", "--aux-layer-ids", ",".join(map(str, AUX))]
            started += start_all(
                lambda: start_node(hosts, broker, tiny_target, 0, *args, env={**WORKER_ENV, **fake}),
                lambda: start_node(hosts, broker, tiny_target, 1, *args, env={**WORKER_ENV, **fake}),
            )
            names = ["plain-0", "plain-1"]
            out = tmp_path / "sglang.safetensors"
            rank = start_rank(hosts, broker, "nodes-sglang", "eagle3", names, out)
            started.append(rank)
            order, tensors = result_of(rank, out)
            assert order == names
            for name in names:
                want = reference_eagle3(tiny_model, batches()[name], AUX)
                for field in ("aux_hidden_states", "target_probs"):
                    gap = (received(tensors, name)[field].double() - want[field].double()).abs().max().item()
                    assert gap < 1e-5, f"{name} {field}: {gap:.3g} from hf"
            assert any("joined the worker at" in line for line in started[2].log_tail)
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)


# ---------------------------------------------------------------- a node lost mid-run
# make test-long: the cut link waits out the silence (its 15 s); a SIGKILL is over sooner. The suite loses a tensor-parallel
# follower on one host (test_tensor_parallel.py), through the same lost-engine steps.
@pytest.mark.long
@pytest.mark.parametrize("fault", ["link-down", "sigkill"])
def test_a_lost_node_ends_its_worker_and_the_run_completes_elsewhere(hosts_available, tiny_target, reference, tmp_path, fault):
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), extra=LIVENESS, prefix=hosts.command("head"))
            started.append(broker)
            args = ["--service", "nodes-run", "--name", "two-nodes"]
            spare_args = ["--service", "nodes-run", "--tensor-parallel", "2", "--name", "spare"]
            started += start_all(
                lambda: start_node(hosts, broker, tiny_target, 0, *args),
                lambda: start_node(hosts, broker, tiny_target, 1, *args),
                lambda: commands.start_worker(broker.ready["backend"], str(tiny_target), *spare_args, env=WORKER_ENV, prefix=hosts.command("head")),
            )
            node0 = started[1]
            out = tmp_path / "run.safetensors"
            rank = start_rank(hosts, broker, "nodes-run", "eagle3", RUN, out)
            started.append(rank)
            wait_for_line(rank, r"^batch 3$", timeout_s=120)
            struck = time.monotonic()
            if fault == "link-down":
                hosts.cut("node-1")  # for good
            else:
                for pid in pids_on(hosts, "node-1"):
                    subprocess.run(["kill", "-9", str(pid)], check=False)
            order, tensors = result_of(rank, out)
            assert order == RUN, "a batch missing, repeated or out of order"
            for name in RUN:
                assert_supervision_equal(Supervision(received(tensors, name)), expected(reference, "llama", "eagle3", name))
            assert node0.popen.wait(60) != 0, "node 0 ends when node 1 is lost"
            # Found by the watch (silence, a process gone) or, when the kill comes mid-forward, by the collective that
            # its peer's end broke first.
            wait_for_line(
                node0, r"rank 1 .*(silent for|on node 1)|tensor-parallel process rank 1|ranks ended call \d+ \(\w+\) differently", timeout_s=5
            )
            status_lines = broker.log_tail
            assert any("forgot worker two-nodes" in line for line in status_lines), "node 0 left the broker"
            # Nothing of the two-node worker is left on either host (node 1's processes end when node 0 falls silent).
            wait_until(lambda: not pids_on(hosts, "node-0") and not pids_on(hosts, "node-1"), timeout_s=60, what="no process on the two hosts")
            print(f"{fault}: the two hosts were empty {time.monotonic() - struck:.1f} s after the fault")
        finally:
            for process in started:
                process.stop(timeout_s=5)
            show(started)


# ---------------------------------------------------------------- nodes that do not go together
JOIN_S = 120


@pytest.mark.parametrize(
    "node1_extra, said",
    [
        (["--task", "dspark"], 'task "dspark" on node 1, "eagle3" on node 0'),
        pytest.param(["--target", "OTHER"], "target_config", marks=pytest.mark.long),
    ],
    ids=["another-task", "another-target"],
)
def test_a_node_with_another_plan_is_one_line_on_both(hosts_available, tiny_target, moe_target, node1_extra, said):
    extra = [str(moe_target) if item == "OTHER" else item for item in node1_extra]
    with Hosts(["head", "node-0", "node-1"]) as hosts:
        started: list[commands.Process] = []
        try:
            broker = commands.start_broker(hosts.address("head"), prefix=hosts.command("head"))
            started.append(broker)
            base = [sys.executable, "-m", "draftfeed", "launch", "worker", "--broker", broker.ready["backend"], "--http-port", "0", "--target"]
            lines = [
                [*hosts.command("node-0"), *base, str(tiny_target), *node_flags(hosts, 0, "--join-timeout", str(JOIN_S))],
                [*hosts.command("node-1"), *base, str(tiny_target), *node_flags(hosts, 1, "--join-timeout", str(JOIN_S)), *extra],
            ]
            began = time.monotonic()
            popens = [
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**WORKER_ENV, **_env()})
                for command in lines
            ]
            try:
                outputs = [popen.communicate(timeout=JOIN_S + 60) for popen in popens]
            finally:
                for popen in popens:
                    popen.kill()
            took = time.monotonic() - began
            for (_out, err), popen, node in zip(outputs, popens, (0, 1)):
                last = err.strip().splitlines()[-1] if err.strip() else ""
                assert popen.returncode != 0 and "Traceback" not in err, f"node {node}:\n{err[-2000:]}"
                assert said in last and "runs another plan than node 0" in last, f"node {node} said: {last}"
            # The plans are compared as the nodes join, not when the join timeout runs out. The lines above show which
            # ended them; this says the answer did not wait for the timeout (how soon it came depends on the machine's
            # load: process start-up is most of it).
            assert took < JOIN_S, f"the nodes took {took:.0f} s to say so, as long as the join timeout"
            print(f"the nodes said so after {took:.1f} s")
        finally:
            for process in started:
                process.stop(timeout_s=5)


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key in ("PATH", "HOME", "LANG")}


@pytest.mark.long
def test_a_missing_node_is_one_line_after_the_join_timeout(hosts_available, tiny_target):
    with Hosts(["head", "node-0"]) as hosts:
        broker = commands.start_broker(hosts.address("head"), prefix=hosts.command("head"))
        try:
            command = [*hosts.command("node-0"), sys.executable, "-m", "draftfeed", "launch", "worker", "--broker", broker.ready["backend"]]
            command += ["--http-port", "0", "--target", str(tiny_target), *node_flags(hosts, 0, "--join-timeout", "3")]
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**_env(), **WORKER_ENV})
            last = done.stderr.strip().splitlines()[-1]
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
            assert "node 1 of --nnodes 2 did not join at" in last and "--node-rank 1" in last, last
        finally:
            broker.stop()


# ---------------------------------------------------------------- mistakes, before anything loads
def worker_command(*args: str) -> subprocess.CompletedProcess:
    """``draftfeed launch worker`` at an address no broker listens on, to its end (forked from the suite's preloader)."""
    return preload.run_module("draftfeed", ["launch", "worker", "--broker", "tcp://127.0.0.1:9", *args], {**os.environ, **WORKER_ENV}, 120)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2", "--tensor-parallel", "2"], "--nnodes 2 needs --master-addr HOST:PORT"),
        (["--nnodes", "2", "--tensor-parallel", "3", "--master-addr", "10.0.0.5:29500"], "--tensor-parallel 3 does not split over --nnodes 2"),
        (["--nnodes", "2", "--tensor-parallel", "2", "--master-addr", "127.0.0.1:29500"], "the other nodes cannot reach a loopback address"),
        (["--nnodes", "2", "--node-rank", "2", "--tensor-parallel", "2", "--master-addr", "10.0.0.5:1"], "--node-rank 2: give this machine's place"),
        (["--master-addr", "10.0.0.5:29500"], "--master-addr goes with --nnodes 2 or more"),
        (
            ["--nnodes", "2", "--tensor-parallel", "2", "--master-addr", "10.0.0.5:29500", "--engine", "my.engine:Engine"],
            "an engine of your own runs on one machine",
        ),
        (["--pipeline-parallel", "2"], "--pipeline-parallel 2: the hf engine spreads a target by tensor parallelism"),
        (["--pipeline-parallel", "2", "--engine", "vllm"], "vLLM's extract_hidden_states capture refuses pipeline parallelism"),
        (["--pipeline-parallel", "2", "--engine", "sglang"], "the sglang engine drives sglang's ModelRunner at pp_size 1"),
        (["--expert-parallel"], "--expert-parallel shards the experts over the worker's processes"),
    ],
)
def test_node_and_parallel_mistakes_are_one_line(tiny_target, flags, message):
    done = worker_command("--target", str(tiny_target), *flags)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert message in done.stderr.strip().splitlines()[-1], done.stderr


def test_expert_parallel_on_a_dense_target_is_refused_naming_what_to_do(tiny_target):
    done = worker_command("--target", str(tiny_target), "--tensor-parallel", "2", "--expert-parallel")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "llama has no expert-parallel plan in transformers" in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_quantized_checkpoint_on_cpu_names_its_quantization_config(tmp_path):
    target = build_tiny_target(tmp_path / "fp8-llama")
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (target / "config.json").write_text(json.dumps(config))
    done = worker_command("--target", str(target))
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "is a quantized checkpoint (its quantization_config: quant_method fp8, fmt e4m3, weight_block_size [128, 128])" in last, last
    assert "--device cuda:N" in last


def test_the_node_plan_and_its_differences():
    plan = node_plan(2, 1, "10.0.0.5:29500", 4, 0)
    assert plan is not None and plan.per_node == 2 and list(plan.ranks()) == [2, 3] and plan.master == "10.0.0.5:29500"
    assert node_plan(1, 0, None, 4, 0) is None
    with pytest.raises(ValueError, match="--devices names 3 devices; across --nnodes 2 each node runs 2"):
        node_plan(2, 0, "10.0.0.5:1", 4, 3)
    ours = fingerprint("/a/model", "hf", "auto", {"task": "eagle3"}, 2, 2)
    assert describe_difference(ours, ours | {"target": "/b/model"}, "node 1", "node 0") is None  # the same model at another path
    difference = describe_difference(ours, ours | {"tensor_parallel": 4}, "node 1", "node 0")
    assert difference == "tensor_parallel 2 on node 1, 4 on node 0"
