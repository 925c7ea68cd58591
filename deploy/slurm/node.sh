#!/usr/bin/env bash
# What one node of a draftfeed job runs; srun starts it once per node (deploy/slurm/draftfeed.sbatch).
#
# Its role comes from DF_ROLE, which the sbatch script gives each job step, and from SLURM_NODEID, the node's
# index within that step:
#   DF_ROLE=serve  inference nodes. Node 0 of the step also runs the broker; every node runs DF_WORKERS_PER_NODE
#                  workers of DF_TARGET, worker i on GPU i (cuda:i) and serving /health and /metrics on
#                  DF_WORKER_HTTP_PORT + i. With DF_NODES_PER_WORKER=N above 1 (a target larger than one node), every
#                  N nodes of the step run one worker together over all their GPUs: --tensor-parallel
#                  N x DF_GPUS_PER_NODE --nnodes N, the first node of each group its node 0 (docs/engines.md).
#   DF_ROLE=train  training nodes. Waits until the broker has a ready worker of DF_SERVICE (`draftfeed status
#                  --service --wait`), then runs torchrun with DF_RANKS_PER_NODE ranks of DF_TRAIN_SCRIPT; node 0
#                  of the step is torchrun's rendezvous host (DF_TRAIN_MASTER, exported by the sbatch script).
#
# Variables (the sbatch script exports them; defaults in brackets):
#   DF_BROKER_HOST (required)  the host that runs the broker: node 0 of the serve step
#   DF_TARGET (serve)          the target model: a folder every inference node can read, or a hub id
#   DF_SERVICE (required)      the service name workers register and ranks ask for
#   DF_PYTHON [python]         the Python of the environment draftfeed is installed in
#   DF_FRONTEND_PORT [5555], DF_BACKEND_PORT [5556]   the broker's rank and worker ports
#   DF_BROKER_HTTP_PORT [8555], DF_WORKER_HTTP_PORT [8556]   /health and /metrics (0 turns them off)
#   DF_WORKERS_PER_NODE [1], DF_DEVICE [cuda]   workers per inference node; cuda puts worker i on cuda:i, cpu on the CPU
#   DF_NODES_PER_WORKER [1], DF_GPUS_PER_NODE [8], DF_SERVE_HOSTS (the serve step's hosts, comma-separated, in
#                              SLURM_NODEID order), DF_WORKER_MASTER_PORT [29600]   one worker over several nodes
#   DF_BROKER_ARGS, DF_WORKER_ARGS   more flags for `draftfeed launch broker` / `launch worker`, split on spaces,
#                              e.g. "--config /shared/worker.toml" or "--dtype bfloat16 --supervision hidden"
#   DF_TRAIN_SCRIPT (train), DF_TRAIN_ARGS   the training script torchrun runs, and its arguments
#   DF_TRAIN_NODES [1], DF_RANKS_PER_NODE [1], DF_TRAIN_MASTER (train), DF_MASTER_PORT [29500]   torchrun's layout
#   DF_WAIT_FOR_WORKERS [1800]   seconds the training nodes wait for a first ready worker (a big model loads slowly)
#   DF_BROKER_TIMEOUT [120]      seconds to wait for the broker to answer at all
#
# Stopping: Slurm signals every process of a step (scancel, the time limit, srun forwarding a signal), so the
# broker and workers get SIGTERM themselves, drain and exit 0; this script only waits for them. It does not pass the
# signal on: a second SIGTERM makes them exit at once. Run by hand, stop it the same way: signal its process group.
set -euo pipefail

die() {
    echo "node.sh: $*" >&2
    exit 2
}

role=${DF_ROLE:?node.sh: set DF_ROLE to serve or train (the sbatch script does)}
node=${SLURM_NODEID:?node.sh: SLURM_NODEID is not set: run this through srun (deploy/slurm/draftfeed.sbatch)}
broker_host=${DF_BROKER_HOST:?node.sh: set DF_BROKER_HOST to the broker node (the sbatch script does)}
service=${DF_SERVICE:?node.sh: set DF_SERVICE}
python=${DF_PYTHON:-python}
frontend_port=${DF_FRONTEND_PORT:-5555}
backend_port=${DF_BACKEND_PORT:-5556}
host=${SLURMD_NODENAME:-$(hostname -s)}

children=()
on_signal() {
    echo "node.sh ($role, node $node): $1: waiting for the processes of this node to stop" >&2
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT

# Wait for every child; a wait cut short by a trapped signal is waited again. Exits with the first failure's code.
wait_children() {
    local status=0 pid rc
    for pid in "${children[@]}"; do
        while true; do
            rc=0
            wait "$pid" || rc=$?
            if ((rc > 128)) && kill -0 "$pid" 2>/dev/null; then
                continue # the signal interrupted wait, not the child
            fi
            break
        done
        if ((rc != 0)); then
            echo "node.sh ($role, node $node): process $pid exited with $rc" >&2
            ((status == 0)) && status=$rc
        fi
    done
    exit "$status"
}

serve() {
    local target=${DF_TARGET:?node.sh: set DF_TARGET to the target model}
    local workers=${DF_WORKERS_PER_NODE:-1} device=${DF_DEVICE:-cuda}
    local worker_http=${DF_WORKER_HTTP_PORT:-8556}
    local -a broker_args worker_args
    read -r -a broker_args <<<"${DF_BROKER_ARGS:-}"
    read -r -a worker_args <<<"${DF_WORKER_ARGS:-}"
    if ((node == 0)); then
        "$python" -m draftfeed launch broker \
            --frontend "tcp://*:$frontend_port" --backend "tcp://*:$backend_port" \
            --http-port "${DF_BROKER_HTTP_PORT:-8555}" --name "broker-${SLURM_JOB_ID:-0}" \
            "${broker_args[@]}" &
        children+=($!)
    fi
    # Workers wait up to --register-timeout (60 s) for the broker, so they need not wait for its ready line.
    local per_worker=${DF_NODES_PER_WORKER:-1}
    if ((per_worker > 1)); then
        serve_spanning "$target" "$per_worker" "${worker_args[@]}"
        return
    fi
    local index dev port
    for ((index = 0; index < workers; index++)); do
        case $device in
        cuda) dev="cuda:$index" ;;
        *) dev=$device ;;
        esac
        port=$worker_http
        ((port != 0)) && port=$((worker_http + index))
        "$python" -m draftfeed launch worker \
            --broker "tcp://$broker_host:$backend_port" --target "$target" --service "$service" \
            --device "$dev" --name "$host-$index" --http-port "$port" \
            "${worker_args[@]}" &
        children+=($!)
    done
    wait_children
}

# One worker over DF_NODES_PER_WORKER nodes: this node's place in its group, the group's first node its node 0.
serve_spanning() {
    local target=$1 per_worker=$2
    shift 2
    local -a hosts
    IFS=, read -r -a hosts <<<"${DF_SERVE_HOSTS:?node.sh: set DF_SERVE_HOSTS to the hosts of the serve step (the sbatch script does)}"
    local group=$((node / per_worker)) rank=$((node % per_worker))
    local first=${hosts[$((group * per_worker))]:?node.sh: DF_SERVE_HOSTS names fewer hosts than node $node needs}
    local gpus=${DF_GPUS_PER_NODE:-8} port=${DF_WORKER_HTTP_PORT:-8556}
    "$python" -m draftfeed launch worker \
        --broker "tcp://$broker_host:$backend_port" --target "$target" --service "$service" --device "${DF_DEVICE:-cuda}" \
        --tensor-parallel $((per_worker * gpus)) --nnodes "$per_worker" --node-rank "$rank" \
        --master-addr "$first:${DF_WORKER_MASTER_PORT:-29600}" --name "$first-group$group" --http-port "$port" \
        "$@" &
    children+=($!)
    wait_children
}

train() {
    local script=${DF_TRAIN_SCRIPT:?node.sh: set DF_TRAIN_SCRIPT to the training script}
    local master=${DF_TRAIN_MASTER:?node.sh: set DF_TRAIN_MASTER to the first training node}
    local -a train_args
    read -r -a train_args <<<"${DF_TRAIN_ARGS:-}"
    # Every rank would wait for the workers by itself too; this says so once, in the job's log, with the status.
    "$python" -m draftfeed status --broker "tcp://$broker_host:$frontend_port" --service "$service" \
        --wait "${DF_WAIT_FOR_WORKERS:-1800}" --timeout "${DF_BROKER_TIMEOUT:-120}"
    # torchrun is this task's process from here on: it handles Slurm's SIGTERM by stopping its ranks.
    exec "$python" -m torch.distributed.run \
        --nnodes "${DF_TRAIN_NODES:-1}" --node_rank "$node" --nproc_per_node "${DF_RANKS_PER_NODE:-1}" \
        --master_addr "$master" --master_port "${DF_MASTER_PORT:-29500}" \
        "$script" "${train_args[@]}"
}

case $role in
serve) serve ;;
train) train ;;
*) die "DF_ROLE=$role: expected serve or train" ;;
esac
