"""The deployment recipes of docs/deploy.md, run or checked as far as a machine without a cluster allows.

Slurm (deploy/slurm): there is no Slurm here, so no real srun or scontrol.
- ``test_slurm_nodes_on_localhost`` runs the recipe's per-node script, node.sh, directly, once as the serving step's
  node 0 (broker and one worker on a tiny target) and once as the training step's node 0 (``draftfeed status --wait``,
  then torchrun with 2 gloo ranks of train_draft.py), with the Slurm variables srun would set (SLURM_NODEID, ...)
  and those the sbatch script exports (DF_*) set by hand. The ranks' supervision is compared bit for bit with the
  contract computed in-process, and the serving node is stopped as Slurm stops a step: SIGTERM to every process of it.
- ``test_sbatch_layout`` runs the sbatch script itself with stand-ins named FakeSrun and FakeScontrol on PATH: they
  record how the script splits the nodes and what it exports, and the fake serving step waits for the SIGTERM the
  script must send it once training is over.

Kubernetes (deploy/kubernetes): no cluster either. ``check_manifests`` reads the manifests with PyYAML and checks them
against the CLI itself: every ``draftfeed launch ROLE`` container's args, env and TOML config (from its ConfigMap)
go through the real config loader and argparse parser of that role; the probes and the scrape annotation use the
``--http-port`` in force; the broker's Service exposes its ``--frontend`` and ``--backend`` ports; the workers'
``--broker`` names that Service and its backend port. ``test_manifest_mistakes_are_caught`` breaks copies of them
one way at a time and expects each mistake named.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest
import tomllib
import torch
import yaml
from conftest import WORKER_ENV
from reference import difference, reference_eagle3
from support.metrics import metric

from draftfeed.launch import cli
from draftfeed.launch.demo import synthetic_batches
from draftfeed.net import free_port
from draftfeed.processes.ready import READY_PREFIX
from draftfeed.schemas.protocol import DEFAULT_BROKER_HTTP_PORT, DEFAULT_WORKER_HTTP_PORT

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "deploy" / "slurm"
KUBERNETES = ROOT / "deploy" / "kubernetes"

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------------- Slurm


class NodeScript:
    """``bash deploy/slurm/node.sh`` in a session of its own, its output collected line by line."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.ended = False
        self._changed = threading.Condition()
        self.popen = subprocess.Popen(
            ["bash", str(SLURM / "node.sh")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, predicate, what: str, timeout_s: float) -> str:
        """The first line ``predicate`` accepts; fails with the log if none comes within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.ended:
                    raise AssertionError(f"no {what} {'before node.sh ended' if self.ended else f'within {timeout_s:.0f} s'}:\n{self.log()}")
                self._changed.wait(remaining)

    def ready(self, role: str, timeout_s: float = 90.0) -> dict:
        line = self.wait_for(
            lambda text: text.startswith(READY_PREFIX) and json.loads(text[len(READY_PREFIX) :])["role"] == role, f"{role} ready line", timeout_s
        )
        return json.loads(line[len(READY_PREFIX) :])

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node.sh still running after {timeout_s:.0f} s:\n{self.log()}") from None

    def signal_step(self, sig: int) -> None:
        """What Slurm does to a step (scancel, the time limit, srun passing a signal on): signal every process of it."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Cleanup: SIGTERM to the node's processes, SIGKILL to what is left after 10 s."""
        if self.popen.poll() is None:
            self.signal_step(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.signal_step(signal.SIGKILL)  # whatever it left behind in its session
        if self.popen.poll() is None:
            self.popen.wait(10)

    def log(self) -> str:
        with self._changed:
            return "\n".join(self.lines[-60:])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.long  # the sbatch recipe's two nodes, as processes on this machine: make test-long
def test_slurm_nodes_on_localhost(tiny_target, tiny_model, tmp_path):
    steps, batch_size, seq_len, draft_vocab, saved = 3, 2, 32, 256, 2
    frontend, backend, broker_http, worker_http, master = (free_port() for _ in range(5))
    summary = tmp_path / "summary"
    # What the sbatch script exports (DF_*) and srun sets (SLURM_*), by hand; a single host plays every node.
    job = {
        **os.environ,
        **WORKER_ENV,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURMD_NODENAME": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "DF_PYTHON": sys.executable,
        "DF_BROKER_HOST": "127.0.0.1",
        "DF_SERVICE": "tiny-llama-eagle3",
        "DF_FRONTEND_PORT": str(frontend),
        "DF_BACKEND_PORT": str(backend),
        "DF_BROKER_HTTP_PORT": str(broker_http),
        "DF_WORKER_HTTP_PORT": str(worker_http),
        "DF_TARGET": str(tiny_target),
        "DF_DEVICE": "cpu",
        "DF_WORKERS_PER_NODE": "1",
        "DF_TRAIN_SCRIPT": str(SLURM / "train_draft.py"),
        "DF_TRAIN_ARGS": f"--steps {steps} --batch-size {batch_size} --seq-len {seq_len} --draft-vocab {draft_vocab} "
        f"--summary-dir {summary} --save-batches {saved}",
        "DF_TRAIN_NODES": "1",
        "DF_RANKS_PER_NODE": "2",
        "DF_TRAIN_MASTER": "127.0.0.1",
        "DF_MASTER_PORT": str(master),
        "DF_WAIT_FOR_WORKERS": "60",
        "DF_BROKER_TIMEOUT": "30",
    }
    serving = training = None
    try:
        serving = NodeScript({**job, "DF_ROLE": "serve", "SLURM_NODEID": "0"})
        broker = serving.ready("broker")
        worker = serving.ready("worker")
        assert broker["frontend"].endswith(f":{frontend}") and broker["backend"].endswith(f":{backend}")
        assert (broker["http_port"], worker["http_port"]) == (broker_http, worker_http)
        assert worker["worker"] == "localhost-0" and worker["service"] == "tiny-llama-eagle3"
        assert get(f"http://127.0.0.1:{broker_http}/health") == (200, json.dumps({"status": "ready"}))
        assert get(f"http://127.0.0.1:{worker_http}/health") == (200, json.dumps({"status": "ready", "tensor_parallel": 1, "devices": ["cpu"]}))

        training = NodeScript({**job, "DF_ROLE": "train", "SLURM_NODEID": "0"})
        assert training.wait(90) == 0, training.log()
        assert "localhost-0" in training.log()  # the status table `draftfeed status --wait` printed first

        aux_layer_ids = None
        for rank in range(2):
            report = json.loads((summary / f"rank{rank}.json").read_text())
            assert report["world_size"] == 2 and report["service"] == "tiny-llama-eagle3"
            assert report["steps"] == list(range(steps)), "supervision out of the dataloader's order"
            info = report["model_info"]
            assert (info["num_hidden_layers"], info["hidden_size"], info["vocab_size"]) == (8, 64, 1000)
            aux_layer_ids = info["aux_layer_ids"]
            # The rank's own shard, regenerated here; its supervision against the contract computed in-process.
            expected_batches = list(synthetic_batches(steps, batch_size, seq_len, 1000, seed=rank))[:saved]
            selected = torch.arange(draft_vocab) * (1000 // draft_vocab)
            mask = torch.zeros(1000, dtype=torch.bool)
            mask[selected] = True
            records = torch.load(summary / f"rank{rank}-batches.pt")
            assert len(records) == saved
            for record, expected in zip(records, expected_batches):
                for key in ("input_ids", "attention_mask", "loss_mask"):
                    assert torch.equal(record["batch"][key], expected[key]), f"rank {rank} trained on another shard"
                reference = reference_eagle3(tiny_model, record["batch"], aux_layer_ids, selected, mask)
                got = record["supervision"]
                assert set(got) == set(reference), f"fields {sorted(got)}, expected {sorted(reference)}"
                problems = [p for name in reference if (p := difference(name, got[name], reference[name])) is not None]
                assert not problems, f"rank {rank}: " + "; ".join(problems)
        assert aux_layer_ids == [1, 3, 4]

        # Both ranks' batches went through the one worker, as its metrics count them.
        _, page = get(f"http://127.0.0.1:{worker_http}/metrics")
        assert metric(page, "draftfeed_worker_requests_total", worker="localhost-0", outcome="served") == 2 * steps, page
        assert metric(page, "draftfeed_worker_registered", worker="localhost-0") == 1, page

        serving.signal_step(signal.SIGTERM)
        assert serving.wait(30) == 0, serving.log()
        assert "SIGTERM: waiting for the processes of this node to stop" in serving.log()
    finally:
        for node in (training, serving):
            if node is not None:
                node.kill()


FAKE_SCONTROL = '''#!{python}
"""FakeScontrol: `scontrol show hostnames LIST` prints $FAKE_HOSTS one per line (there is no Slurm here)."""
import os, sys
assert sys.argv[1:3] == ["show", "hostnames"] and sys.argv[3] == os.environ["SLURM_JOB_NODELIST"], sys.argv
print("\\n".join(os.environ["FAKE_HOSTS"].split()))
'''

FAKE_SRUN = '''#!{python}
"""FakeSrun: records its arguments and the DF_* environment in $FAKE_LOG/<role>.json. The serving step then waits
for SIGTERM (which the sbatch script must send once training is over); the training step first waits until the
serving step is recorded, then exits with $FAKE_TRAIN_RC."""
import json, os, signal, sys, time
args = sys.argv[1:]
role = "serve" if "--export=ALL,DF_ROLE=serve" in args else "train"
log = os.environ["FAKE_LOG"]
if role == "serve":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
record = {{"args": args, "env": {{k: v for k, v in os.environ.items() if k.startswith("DF_")}}}}
with open(f"{{log}}/{{role}}.tmp", "w") as out:
    json.dump(record, out)
os.rename(f"{{log}}/{{role}}.tmp", f"{{log}}/{{role}}.json")
if role == "serve":
    got = signal.sigtimedwait([signal.SIGTERM], 30)
    with open(f"{{log}}/serve-stopped.json", "w") as out:
        json.dump({{"signal": got.si_signo if got else None}}, out)
    sys.exit(0)
deadline = time.monotonic() + 30
while not os.path.exists(f"{{log}}/serve.json") and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(int(os.environ.get("FAKE_TRAIN_RC", "0")))
'''


def run_sbatch(tmp_path: Path, hosts: list[str], **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    fake_bin, log = tmp_path / "bin", tmp_path / "log"
    fake_bin.mkdir()
    log.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (fake_bin / name).write_text(text.format(python=sys.executable))
        (fake_bin / name).chmod(0o755)
    variables = {
        "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_CPUS_PER_TASK": "64",
        "FAKE_HOSTS": " ".join(hosts),
        "FAKE_LOG": str(log),
        **env,
    }
    job = subprocess.Popen(
        ["bash", str(SLURM / "draftfeed.sbatch")],
        env=variables,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        stdout, stderr = job.communicate(timeout=60)
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # a fake step the script left running, and the script itself on a timeout
        except ProcessLookupError:
            pass
        job.wait(10)
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr), log


def option(args: list[str], name: str) -> str:
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {args}"
    return values[0]


@pytest.mark.parametrize("hosts, serve_nodes", [(["gpu01", "gpu02", "gpu03"], "1"), (["gpu01", "gpu02", "gpu03", "gpu04"], "2")])
def test_sbatch_layout(tmp_path, hosts, serve_nodes):
    result, log = run_sbatch(tmp_path, hosts, DF_SERVE_NODES=serve_nodes, FAKE_TRAIN_RC="3")
    assert result.returncode == 3, f"the job should end with training's exit code:\n{result.stdout}{result.stderr}"
    serve, train = (json.loads((log / f"{role}.json").read_text()) for role in ("serve", "train"))
    count = int(serve_nodes)
    for step, nodes in ((serve, hosts[:count]), (train, hosts[count:])):
        assert step["args"][-1] == str(SLURM / "node.sh")
        assert option(step["args"], "--nodelist") == ",".join(nodes)
        assert option(step["args"], "--nodes") == str(len(nodes))
        assert option(step["args"], "--ntasks-per-node") == "1"
        assert option(step["args"], "--cpus-per-task") == "64"
        assert step["env"]["DF_BROKER_HOST"] == hosts[0]
    assert option(serve["args"], "--export") == "ALL,DF_ROLE=serve" and option(train["args"], "--export") == "ALL,DF_ROLE=train"
    assert train["env"]["DF_TRAIN_MASTER"] == hosts[count] and train["env"]["DF_TRAIN_NODES"] == str(len(hosts) - count)
    assert train["env"]["DF_TRAIN_SCRIPT"] == str(SLURM / "train_draft.py")
    assert json.loads((log / "serve-stopped.json").read_text()) == {"signal": signal.SIGTERM}, "the serving step was not stopped"


def test_sbatch_refuses_a_layout_without_training_nodes(tmp_path):
    result, log = run_sbatch(tmp_path, ["gpu01", "gpu02"], DF_SERVE_NODES="2")
    assert result.returncode == 2
    assert "DF_SERVE_NODES=2 of 2 nodes: leave at least one node for training" in result.stderr
    assert not list(log.iterdir()), "nothing should have been started"


@pytest.mark.parametrize("script", ["node.sh", "draftfeed.sbatch"])
def test_shell_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "set -euo pipefail" in (SLURM / script).read_text()


def test_node_script_names_what_is_missing(tmp_path):
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    for env, message in [
        ({}, "set DF_ROLE to serve or train"),
        ({"DF_ROLE": "serve"}, "SLURM_NODEID is not set: run this through srun"),
        ({"DF_ROLE": "train", "SLURM_NODEID": "0", "DF_BROKER_HOST": "h", "DF_SERVICE": "s"}, "set DF_TRAIN_SCRIPT"),
        ({"DF_ROLE": "serve", "SLURM_NODEID": "0", "DF_BROKER_HOST": "h", "DF_SERVICE": "s"}, "set DF_TARGET"),
        ({"DF_ROLE": "cook", "SLURM_NODEID": "0", "DF_BROKER_HOST": "h", "DF_SERVICE": "s"}, "DF_ROLE=cook: expected serve or train"),
    ]:
        result = subprocess.run(["bash", str(SLURM / "node.sh")], env={**base, **env}, capture_output=True, text=True, timeout=30)
        assert result.returncode != 0 and message in result.stderr, (env, result.stderr)


# ---------------------------------------------------------------------------------------------------- Kubernetes

WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "Pod"}
DEFAULT_HTTP = {"broker": DEFAULT_BROKER_HTTP_PORT, "worker": DEFAULT_WORKER_HTTP_PORT}


def load_manifests(folder: Path = KUBERNETES) -> list[dict]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def pod_spec(doc: dict) -> tuple[dict, dict]:
    """The pod template's metadata and spec of a workload (a Pod is its own)."""
    if doc["kind"] == "Pod":
        return doc.get("metadata", {}), doc["spec"]
    template = doc["spec"]["jobTemplate"]["spec"]["template"] if doc["kind"] == "CronJob" else doc["spec"]["template"]
    return template.get("metadata", {}), template["spec"]


def launch_role(container: dict) -> tuple[str, list[str]] | None:
    """The role and the arguments after it of a container that runs ``draftfeed launch ROLE`` (or ``python -m
    draftfeed launch ROLE``, ``python -m draftfeed.launch ROLE``), else None."""
    line = [*container.get("command", []), *container.get("args", [])]
    if not line:
        return None
    line[0] = Path(line[0]).name
    for prefix in (["draftfeed", "launch"], ["python", "-m", "draftfeed", "launch"], ["python", "-m", "draftfeed.launch"]):
        if line[: len(prefix)] == prefix:
            rest = line[len(prefix) :]
            return (rest[0], rest[1:]) if rest else ("", [])
    return None


def config_file(path: str, container: dict, spec: dict, configmaps: dict[str, dict]) -> str | None:
    """The text of the file at ``path`` inside the container when a ConfigMap volume provides it, else None."""
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        base = mount["mountPath"].rstrip("/") + "/"
        volume = volumes.get(mount["name"], {})
        if "configMap" not in volume:
            continue
        data = configmaps.get(volume["configMap"]["name"], {})
        if "subPath" in mount and mount["mountPath"] == path:
            return data.get(mount["subPath"])
        if path.startswith(base) and "subPath" not in mount:
            name = path[len(base) :]
            items = volume["configMap"].get("items")
            keys = {item["path"]: item["key"] for item in items} if items else {key: key for key in data}
            return data.get(keys[name]) if name in keys else None
    return None


def with_local_configs(
    argv: list[str], container: dict, spec: dict, configmaps: dict[str, dict], folder: Path
) -> tuple[list[str], dict[str, str], str | None]:
    """``argv`` with each ``--config PATH`` pointing at a local copy of the ConfigMap file mounted at PATH, the copies'
    paths with the PATH each stands for, and why there is no such file (or None)."""
    argv, copies = list(argv), {}
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            slot, path = index + 1, argv[index + 1]
        elif arg.startswith("--config="):
            slot, path = index, arg.split("=", 1)[1]
        else:
            continue
        text = config_file(path, container, spec, configmaps)
        if text is None:
            return argv, copies, f"--config {path} is not a file of any ConfigMap mounted in the container"
        folder.mkdir(parents=True, exist_ok=True)
        local = folder / f"{index}-{Path(path).name}"
        local.write_text(text)
        argv[slot] = str(local) if slot != index else f"--config={local}"
        copies[str(local)] = path
    return argv, copies, None


def parse_launch(role: str, argv: list[str], environ: dict[str, str]):
    """``draftfeed launch ROLE ARGV --print-config`` run as in the container (with its environment only): the settings
    in force, as a namespace of the flags' names (``http_port``; None for one not set), or the one-line error the
    command prints."""
    out, errors = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, environ, clear=True), redirect_stdout(out), redirect_stderr(errors):
        try:
            code = cli.main(["launch", role, *argv, "--print-config"])
        except SystemExit as exc:  # argparse's errors
            code = exc.code
    if code != 0:
        said = errors.getvalue().strip().splitlines()
        return None, said[-1] if said else f"exit status {code}"
    text = out.getvalue()
    settings = {name: None for name in re.findall(r"^# (\S+) = \(not set\)$", text, re.MULTILINE)} | tomllib.loads(text)
    return argparse.Namespace(**{name.replace("-", "_"): value for name, value in settings.items()}), None


def port_of(endpoint: str) -> int | None:
    match = re.match(r"^tcp://(.+):(\d+)$", endpoint)
    return int(match.group(2)) if match else None


def resolve_port(port: int | str, container: dict) -> int | None:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    return named.get(port)


def placeholder(variable: dict) -> str:
    """What a variable from valueFrom holds here: a StatefulSet pod's index is 0 (its first pod), anything else a
    placeholder whose presence alone counts (the pod's name, a Secret)."""
    path = variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
    return "0" if "apps.kubernetes.io/pod-index" in path else f"<{variable['name']}>"


def check_manifests(docs: list[dict]) -> list[str]:
    """Every way the manifests disagree with the CLI, one line each (empty when they agree)."""
    problems: list[str] = []
    configmaps = {doc["metadata"]["name"]: doc.get("data", {}) for doc in docs if doc.get("kind") == "ConfigMap"}
    services = [doc for doc in docs if doc.get("kind") == "Service"]
    brokers: list[tuple[str, dict, dict, object]] = []  # (where, pod labels, container, args)
    workers: list[tuple[str, object]] = []
    launches, refused = 0, set()
    with tempfile.TemporaryDirectory(prefix="draftfeed-manifests-") as scratch:
        for doc in docs:
            if doc.get("kind") not in WORKLOADS:
                continue
            meta, spec = pod_spec(doc)
            for container in spec.get("containers", []):
                found = launch_role(container)
                if found is None:
                    continue
                launches += 1
                role, argv = found
                where = f"{doc['kind']} {doc['metadata']['name']}, container {container['name']}"
                argv, copies, problem = with_local_configs(argv, container, spec, configmaps, Path(scratch) / str(launches))
                if problem is not None:
                    problems.append(f"{where}: {problem}")
                    continue
                # A variable from valueFrom (the pod's name, a Secret) is a placeholder here: only its presence counts.
                environ = {e["name"]: e.get("value", placeholder(e)) for e in container.get("env", [])}
                args, error = parse_launch(role, argv, environ)
                if error is not None:
                    for local, path in copies.items():  # name the file as the container sees it
                        error = error.replace(local, path)
                    problems.append(f"{where}: draftfeed launch {role} refuses its settings: {error}")
                    refused.add(role)
                    continue
                problems += check_http(where, role, args, meta, container)
                if role == "broker":
                    brokers.append((where, meta.get("labels", {}), container, args))
                else:
                    workers.append((where, args))
        # A broker whose settings are refused has no ports to check the workers against: its problem is said above.
        problems += check_services(brokers, [] if "broker" in refused else workers, services)
    if launches == 0:
        problems.append("no container runs `draftfeed launch broker` or `draftfeed launch worker`")
    return problems


def check_http(where: str, role: str, args, meta: dict, container: dict) -> list[str]:
    """Probes on /health and the scrape annotation at the --http-port in force; liveness held back while loading."""
    problems = []
    http = DEFAULT_HTTP[role] if args.http_port is None else args.http_port
    if http == 0:
        return [f"{where}: --http-port 0 turns /health off, but the probes need it"]
    if http not in [p["containerPort"] for p in container.get("ports", [])]:
        problems.append(f"{where}: no containerPort {http} (the --http-port in force)")
    needed = ["readinessProbe", "livenessProbe"] + (["startupProbe"] if role == "worker" else [])
    for name in needed:
        probe = container.get(name)
        if probe is None:
            problems.append(f"{where}: no {name} (a {role} needs {', '.join(needed)} on /health)")
            continue
        get_ = probe.get("httpGet", {})
        if get_.get("path") != "/health":
            problems.append(f"{where}: {name} asks {get_.get('path')!r}, not /health")
        port = resolve_port(get_.get("port"), container)
        if port != http:
            problems.append(f"{where}: {name} probes port {get_.get('port')!r} ({port}), but --http-port in force is {http}")
    annotations = meta.get("annotations", {})
    if annotations.get("prometheus.io/scrape") == "true":
        if annotations.get("prometheus.io/port") != str(http):
            problems.append(f"{where}: prometheus.io/port is {annotations.get('prometheus.io/port')!r}, but /metrics is on {http}")
        if annotations.get("prometheus.io/path", "/metrics") != "/metrics":
            problems.append(f"{where}: prometheus.io/path is {annotations['prometheus.io/path']!r}, not /metrics")
    return problems


def check_services(brokers: list, workers: list, services: list[dict]) -> list[str]:
    """The broker's Service exposes its frontend and backend; each worker's --broker is that Service's backend."""
    problems = []
    backends: dict[str, set[int]] = {}  # Service name -> its ports that reach a broker's backend
    for where, labels, container, args in brokers:
        mine = [s for s in services if s["spec"].get("selector") and all(labels.get(k) == v for k, v in s["spec"]["selector"].items())]
        if not mine:
            problems.append(f"{where}: no Service selects the broker's pods (labels {labels})")
        for which in ("frontend", "backend"):
            bound = port_of(getattr(args, which))
            if bound is None:
                problems.append(f"{where}: --{which} {getattr(args, which)} has no fixed port for a Service")
                continue
            if bound not in [p["containerPort"] for p in container.get("ports", [])]:
                problems.append(f"{where}: no containerPort {bound} for --{which}")
            for service in mine:
                name = service["metadata"]["name"]
                reach = [p["port"] for p in service["spec"].get("ports", []) if resolve_port(p.get("targetPort", p["port"]), container) == bound]
                if not reach:
                    problems.append(f"Service {name}: no port reaches the broker's --{which} port {bound}")
                if which == "backend":
                    backends.setdefault(name, set()).update(reach)
    for where, args in workers:
        match = re.match(r"^tcp://([^:]+):(\d+)$", args.broker)
        host, port = (match.group(1), int(match.group(2))) if match else (args.broker, None)
        service = host.split(".")[0]
        if service not in backends:
            problems.append(f"{where}: --broker {args.broker} names {service!r}, not the broker's Service ({', '.join(sorted(backends)) or 'none'})")
        elif port not in backends[service]:
            problems.append(
                f"{where}: --broker {args.broker}: port {port} of Service {service} does not reach the broker's backend (ports {sorted(backends[service])})"
            )
    return problems


def test_manifests_agree_with_the_cli():
    docs = load_manifests()
    assert {doc["kind"] for doc in docs} >= {"ConfigMap", "Deployment", "Service"}
    assert check_manifests(docs) == []


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(path.name for path in KUBERNETES.glob("*.yaml") if path.name != "kustomization.yaml")


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == name)


def container_of(docs: list[dict], name: str) -> dict:
    return pod_spec(find(docs, "Deployment", name))[1]["containers"][0]


def _misspelled_flag(docs):
    container_of(docs, "draftfeed-broker")["args"] += ["--heartbeat-intervall", "2"]


def _unknown_toml_key(docs):
    find(docs, "ConfigMap", "draftfeed-config")["data"]["worker.toml"] += "capacty = 4\n"


def _wrong_toml_type(docs):
    find(docs, "ConfigMap", "draftfeed-config")["data"]["worker.toml"] += 'capacity = "four"\n'


def _readiness_port(docs):
    container_of(docs, "draftfeed-worker")["readinessProbe"]["httpGet"]["port"] = 8557


def _http_port_moved(docs):
    data = find(docs, "ConfigMap", "draftfeed-config")["data"]
    data["broker.toml"] = data["broker.toml"].replace("http-port = 8555", "http-port = 9000")


def _no_startup_probe(docs):
    del container_of(docs, "draftfeed-worker")["startupProbe"]


def _worker_to_wrong_service(docs):
    data = find(docs, "ConfigMap", "draftfeed-config")["data"]
    data["worker.toml"] = data["worker.toml"].replace("tcp://draftfeed-broker:5556", "tcp://draftfeed-brokr:5556")


def _worker_to_frontend(docs):
    data = find(docs, "ConfigMap", "draftfeed-config")["data"]
    data["worker.toml"] = data["worker.toml"].replace("tcp://draftfeed-broker:5556", "tcp://draftfeed-broker:5555")


def _service_port(docs):
    ports = find(docs, "Service", "draftfeed-broker")["spec"]["ports"]
    next(p for p in ports if p["name"] == "workers")["targetPort"] = 5557


def _config_not_mounted(docs):
    args = container_of(docs, "draftfeed-worker")["args"]
    args[args.index("--config") + 1] = "/etc/draftfeed/workers.toml"


def _env_flag_wrong(docs):
    container_of(docs, "draftfeed-worker")["env"].append({"name": "DRAFTFEED_DTYPE", "value": "bf16"})


@pytest.mark.parametrize(
    "mistake, message",
    [
        (_misspelled_flag, "Deployment draftfeed-broker, container broker: draftfeed launch broker refuses its settings: "),
        (_unknown_toml_key, "unknown key 'capacty'"),
        (_wrong_toml_type, "--capacity takes an integer, got 'four'"),
        (_readiness_port, "readinessProbe probes port 8557 (8557), but --http-port in force is 8556"),
        (_http_port_moved, "livenessProbe probes port 'http' (8555), but --http-port in force is 9000"),
        (_no_startup_probe, "no startupProbe"),
        (_worker_to_wrong_service, "--broker tcp://draftfeed-brokr:5556 names 'draftfeed-brokr', not the broker's Service (draftfeed-broker)"),
        (_worker_to_frontend, "port 5555 of Service draftfeed-broker does not reach the broker's backend (ports [5556])"),
        (_service_port, "Service draftfeed-broker: no port reaches the broker's --backend port 5556"),
        (_config_not_mounted, "--config /etc/draftfeed/workers.toml is not a file of any ConfigMap mounted in the container"),
        (_env_flag_wrong, "DRAFTFEED_DTYPE: --dtype 'bf16' is not one of"),
    ],
)
def test_manifest_mistakes_are_caught(mistake, message):
    docs = copy.deepcopy(load_manifests())
    mistake(docs)
    problems = check_manifests(docs)
    assert any(message in problem for problem in problems), f"expected a problem with {message!r}, got {problems}"
    if mistake is _misspelled_flag:
        assert any("unrecognized arguments: --heartbeat-intervall 2" in problem for problem in problems), problems


def test_node_script_runs_one_worker_over_a_group_of_nodes(tmp_path):
    """DF_NODES_PER_WORKER=2: every two nodes of the serve step run one worker over all their GPUs, the first of the
    two its node 0 (the worker command checked as the node runs it, through a stand-in Python that records it)."""
    record = tmp_path / "argv.json"
    fake_python = tmp_path / "FakePython"
    fake_python.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + chr(10))\n")
    fake_python.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "DF_ROLE": "serve",
        "SLURM_NODEID": "3",
        "DF_BROKER_HOST": "gpu01",
        "DF_SERVICE": "kimi-k2-eagle3",
        "DF_TARGET": "/shared/models/Kimi-K2",
        "DF_PYTHON": str(fake_python),
        "DF_NODES_PER_WORKER": "2",
        "DF_SERVE_HOSTS": "gpu01,gpu02,gpu03,gpu04",
        "DF_WORKER_ARGS": "--dtype bfloat16",
    }
    result = subprocess.run(["bash", str(SLURM / "node.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    (argv,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert argv[:3] == ["-m", "draftfeed", "launch"] and argv[3] == "worker"
    flags = dict(zip(argv[4::2], argv[5::2]))
    assert flags["--tensor-parallel"] == "16" and flags["--nnodes"] == "2" and flags["--node-rank"] == "1"
    assert flags["--master-addr"] == "gpu03:29600" and flags["--broker"] == "tcp://gpu01:5556" and flags["--dtype"] == "bfloat16"
    from draftfeed.launch.cli import build_parser

    parsed = build_parser().parse_args(["launch", *argv[3:]])
    assert (parsed.nnodes, parsed.node_rank, parsed.master_addr, parsed.tensor_parallel) == (2, 1, "gpu03:29600", 16)
