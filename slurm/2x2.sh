#!/usr/bin/env bash
#SBATCH --job-name=detkit-2x2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH --time=01:00:00
#
# detkit on 2 nodes x 2 GPUs: 4 ranks, rank = node * 2 + local_rank (TP pairs inside a node,
# CP pairs across nodes). Submit from the repository root:
#
#   sbatch slurm/2x2.sh                                   # bare: the submitting env's python
#   DETKIT_RUNTIME=pyxis DETKIT_CONTAINER_IMAGE=... sbatch slurm/2x2.sh
#   DETKIT_DRY_RUN=1 sbatch slurm/2x2.sh                  # print the plan, launch nothing
#
# The allocation is checked before anything is launched: anything but exactly 2 nodes x 2 tasks
# x 2 GPUs with block placement is refused with a message and exit status 1. Each rank sees all
# GPUs of its node and uses GPU local_rank (toolkit/launch.py). Knobs: docs/slurm.md.
set -euo pipefail

readonly EXPECT_NODES=2 EXPECT_TASKS_PER_NODE=2 EXPECT_GPUS_PER_NODE=2
readonly EXPECT_TASKS=$((EXPECT_NODES * EXPECT_TASKS_PER_NODE))
readonly ME="detkit 2x2"

die() { printf '%s: ERROR: %s\n' "$ME" "$*" >&2; exit 1; }
say() { printf '%s: %s\n' "$ME" "$*"; }

# ---- 1. the allocation: exactly 2 nodes x 2 tasks x 2 GPUs, block placement -------------------
[[ -n ${SLURM_JOB_ID:-} ]] ||
    die "not inside a Slurm allocation (SLURM_JOB_ID is unset): submit with 'sbatch slurm/2x2.sh'"

problems=()
nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-unset}}
[[ $nodes == "$EXPECT_NODES" ]] ||
    problems+=("SLURM_JOB_NUM_NODES=$nodes, need $EXPECT_NODES nodes")
[[ ${SLURM_NTASKS:-unset} == "$EXPECT_TASKS" ]] ||
    problems+=("SLURM_NTASKS=${SLURM_NTASKS:-unset}, need $EXPECT_TASKS tasks")
[[ ${SLURM_TASKS_PER_NODE:-unset} == "$EXPECT_TASKS_PER_NODE(x$EXPECT_NODES)" ]] ||
    problems+=("SLURM_TASKS_PER_NODE=${SLURM_TASKS_PER_NODE:-unset}, need $EXPECT_TASKS_PER_NODE(x$EXPECT_NODES)")
[[ -z ${SLURM_NTASKS_PER_NODE:-} || $SLURM_NTASKS_PER_NODE == "$EXPECT_TASKS_PER_NODE" ]] ||
    problems+=("SLURM_NTASKS_PER_NODE=$SLURM_NTASKS_PER_NODE, need $EXPECT_TASKS_PER_NODE")
[[ ${SLURM_GPUS_ON_NODE:-unset} == "$EXPECT_GPUS_PER_NODE" ]] ||
    problems+=("SLURM_GPUS_ON_NODE=${SLURM_GPUS_ON_NODE:-unset}, need $EXPECT_GPUS_PER_NODE GPUs per node")
# sbatch --distribution (or SLURM_DISTRIBUTION in the submitting shell) reaches the batch
# environment and srun; only block placement across nodes gives rank = node * 2 + local_rank.
distribution=${SLURM_DISTRIBUTION:-block}
[[ ${distribution%%:*} == block ]] ||
    problems+=("SLURM_DISTRIBUTION=$distribution, need block placement of tasks on nodes")
[[ -z ${SLURM_HET_SIZE:-} ]] ||
    problems+=("heterogeneous job (SLURM_HET_SIZE=$SLURM_HET_SIZE) is not supported")
if ((${#problems[@]})); then
    {
        printf '%s: refusing allocation of job %s: this script needs exactly %s nodes x %s tasks x %s GPUs per node with block placement (sbatch slurm/2x2.sh, without overriding --nodes/--ntasks*/--gpus*/--distribution):\n' \
            "$ME" "$SLURM_JOB_ID" "$EXPECT_NODES" "$EXPECT_TASKS_PER_NODE" "$EXPECT_GPUS_PER_NODE"
        printf '  - %s\n' "${problems[@]}"
        printf '%s: nothing was launched\n' "$ME"
    } >&2
    exit 1
fi

# ---- 2. knobs (every one an environment variable with a default; docs/slurm.md) --------------
submit_dir=${SLURM_SUBMIT_DIR:-$PWD}
DETKIT_RUNTIME=${DETKIT_RUNTIME:-bare}
DETKIT_DEVICE=${DETKIT_DEVICE:-cuda}
DETKIT_SUITE=${DETKIT_SUITE-tp-cp}           # empty: run only the rank check
DETKIT_AUDIT_ARGS=${DETKIT_AUDIT_ARGS:-}     # extra words for 'detkit audit' (split on spaces)
DETKIT_RESULTS_DIR=${DETKIT_RESULTS_DIR:-$submit_dir/results/slurm-$SLURM_JOB_ID}
DETKIT_PYTHON=${DETKIT_PYTHON:-python3}
DETKIT_CONTAINER_IMAGE=${DETKIT_CONTAINER_IMAGE:-}
DETKIT_CONTAINER_MOUNTS=${DETKIT_CONTAINER_MOUNTS:-}
DETKIT_DIST_TIMEOUT_S=${DETKIT_DIST_TIMEOUT_S:-300}
DETKIT_DRY_RUN=${DETKIT_DRY_RUN:-0}
DETKIT_MASTER_PORT=${DETKIT_MASTER_PORT:-$((15000 + SLURM_JOB_ID % 15000))}
NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}      # NVLink multicast stays off, as in every NCCL run in reports/
NCCL_DEBUG=${NCCL_DEBUG:-INFO}               # INIT/ENV lines land in the per-rank logs
[[ $DETKIT_RESULTS_DIR == /* ]] || DETKIT_RESULTS_DIR=$submit_dir/$DETKIT_RESULTS_DIR

case $DETKIT_RUNTIME in bare | pyxis | apptainer) ;;
    *) die "DETKIT_RUNTIME=$DETKIT_RUNTIME; supported: bare, pyxis, apptainer" ;;
esac
case $DETKIT_DEVICE in cuda | cpu) ;;
    *) die "DETKIT_DEVICE=$DETKIT_DEVICE; supported: cuda (NCCL), cpu (gloo + Triton interpreter)" ;;
esac
case $DETKIT_DRY_RUN in 0 | 1) ;; *) die "DETKIT_DRY_RUN=$DETKIT_DRY_RUN; supported: 0, 1" ;; esac
if ! [[ $DETKIT_MASTER_PORT =~ ^[0-9]+$ ]] || ((DETKIT_MASTER_PORT < 1024 || DETKIT_MASTER_PORT > 65535)); then
    die "DETKIT_MASTER_PORT=$DETKIT_MASTER_PORT; need an integer port in 1024..65535"
fi
if ! [[ $DETKIT_DIST_TIMEOUT_S =~ ^[0-9]+$ ]] || ((DETKIT_DIST_TIMEOUT_S == 0)); then
    die "DETKIT_DIST_TIMEOUT_S=$DETKIT_DIST_TIMEOUT_S; need a positive integer (seconds)"
fi
if [[ $DETKIT_RUNTIME == bare ]]; then
    [[ -z $DETKIT_CONTAINER_IMAGE ]] ||
        die "DETKIT_CONTAINER_IMAGE is set but DETKIT_RUNTIME=bare; set DETKIT_RUNTIME=pyxis or apptainer"
else
    [[ -n $DETKIT_CONTAINER_IMAGE ]] ||
        die "DETKIT_RUNTIME=$DETKIT_RUNTIME needs DETKIT_CONTAINER_IMAGE (the detkit image; docs/container.md)"
fi

mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is unset}")
((${#hosts[@]} == EXPECT_NODES)) ||
    die "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST expands to ${#hosts[@]} host(s), need $EXPECT_NODES"
MASTER_ADDR=${DETKIT_MASTER_ADDR:-${hosts[0]}}
MASTER_PORT=$DETKIT_MASTER_PORT

# The launcher must exist where the ranks run; checked here for what the batch node can see.
case $DETKIT_RUNTIME in
    bare)
        command -v "$DETKIT_PYTHON" >/dev/null ||
            die "DETKIT_PYTHON=$DETKIT_PYTHON not found; activate detkit's venv before sbatch or set DETKIT_PYTHON"
        "$DETKIT_PYTHON" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("detkit.toolkit.launch") is None)' 2>/dev/null ||
            die "'$DETKIT_PYTHON' cannot import detkit.toolkit.launch: pip install detkit into it, or submit from the repository root"
        if [[ -n $DETKIT_SUITE ]] && ! command -v detkit >/dev/null; then
            die "DETKIT_SUITE=$DETKIT_SUITE needs the 'detkit' command on PATH (pip install -e . in the venv), or set DETKIT_SUITE= to run only the rank check"
        fi
        ;;
    pyxis)
        # Not 'srun --help | grep -q': with pipefail, grep's early exit can fail the pipe.
        srun_help=$(srun --help 2>&1) || true
        [[ $srun_help == *--container-image* ]] ||
            die "DETKIT_RUNTIME=pyxis but this srun has no --container-image option (pyxis plugin not installed)"
        ;;
    apptainer)
        command -v apptainer >/dev/null || die "DETKIT_RUNTIME=apptainer but 'apptainer' is not on PATH"
        ;;
esac

export DETKIT_DEVICE DETKIT_SUITE DETKIT_AUDIT_ARGS DETKIT_RESULTS_DIR DETKIT_PYTHON \
    DETKIT_DIST_TIMEOUT_S MASTER_ADDR MASTER_PORT NCCL_NVLS_ENABLE NCCL_DEBUG
if [[ $DETKIT_DEVICE == cpu ]]; then
    # CPU mode (CI): gloo, Triton's interpreter, one thread per rank.
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

# ---- 3. the steps ------------------------------------------------------------------------------
# Per node (bare, on the host): hostname, GPUs and topology, each degrading to "not available".
# shellcheck disable=SC2016  # expanded by the bash of each task, not here
node_script='
set -euo pipefail
host=$(hostname)
probe() {  # TITLE CMD...: run CMD if present, else say why not
    local title=$1 rc=0; shift
    echo "--- $title"
    if ! command -v "$1" >/dev/null 2>&1; then echo "not available ($1 not found)"; return 0; fi
    "$@" 2>&1 || rc=$?
    ((rc == 0)) || echo "not available ($1 exited with status $rc)"
}
{
    echo "hostname: $host"
    echo "slurm_nodeid: $SLURM_NODEID"
    echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "CUDA_VISIBLE_DEVICES: ${CUDA_VISIBLE_DEVICES:-unset}"
    echo "SLURM_JOB_GPUS: ${SLURM_JOB_GPUS:-unset}"
    echo "SLURM_GPUS_ON_NODE: ${SLURM_GPUS_ON_NODE:-unset}"
    probe "nvidia-smi -L" nvidia-smi -L
    probe "nvidia-smi topo -m" nvidia-smi topo -m
    probe "nvidia-smi --query-gpu" nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv
} >"$DETKIT_RESULTS_DIR/nodes/$host.txt"
'

# Per rank: the rank check, then the audit suite if one is set. NCCL writes its topology to
# a per-rank file (rank 0 of each communicator writes), so every node's view is kept.
# shellcheck disable=SC2016  # expanded by the bash of each task, not here
rank_script='
set -euo pipefail
export NCCL_TOPO_DUMP_FILE=${NCCL_TOPO_DUMP_FILE:-$DETKIT_RESULTS_DIR/topo/nccl-topo-rank$SLURM_PROCID.xml}
echo "detkit rank $SLURM_PROCID: host $(hostname) node $SLURM_NODEID local $SLURM_LOCALID CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset} MASTER=$MASTER_ADDR:$MASTER_PORT"
"$DETKIT_PYTHON" -m detkit.toolkit.launch check --out "$DETKIT_RESULTS_DIR" --device "$DETKIT_DEVICE" \
    --timeout "$DETKIT_DIST_TIMEOUT_S" --expect-nodes "$1" --expect-tasks-per-node "$2"
if [[ -n $DETKIT_SUITE ]]; then
    read -r -a extra <<<"$DETKIT_AUDIT_ARGS"
    detkit audit --suite "$DETKIT_SUITE" --out "$DETKIT_RESULTS_DIR/audit" "${extra[@]}"
fi
'

logs=$DETKIT_RESULTS_DIR/logs
step=(srun --nodes="$EXPECT_NODES" --kill-on-bad-exit=1 --distribution=block)
node_step=("${step[@]}" --ntasks="$EXPECT_NODES" --ntasks-per-node=1
    --output="$logs/node-%n.log" bash -c "$node_script")

rank_step=("${step[@]}" --ntasks="$EXPECT_TASKS" --ntasks-per-node="$EXPECT_TASKS_PER_NODE"
    --output="$logs/rank-%t.log")
rank_cmd=(bash -c "$rank_script" detkit-rank "$EXPECT_NODES" "$EXPECT_TASKS_PER_NODE")
case $DETKIT_RUNTIME in
    bare) rank_step+=("${rank_cmd[@]}") ;;
    pyxis)
        mounts=$DETKIT_RESULTS_DIR:$DETKIT_RESULTS_DIR${DETKIT_CONTAINER_MOUNTS:+,$DETKIT_CONTAINER_MOUNTS}
        rank_step+=(--container-image="$DETKIT_CONTAINER_IMAGE" --container-mounts="$mounts"
            --container-workdir="$DETKIT_RESULTS_DIR" "${rank_cmd[@]}")
        ;;
    apptainer)
        binds=$DETKIT_RESULTS_DIR${DETKIT_CONTAINER_MOUNTS:+,$DETKIT_CONTAINER_MOUNTS}
        nv=(--nv)
        [[ $DETKIT_DEVICE == cuda ]] || nv=()
        rank_step+=(apptainer exec "${nv[@]}" --bind "$binds" --pwd "$DETKIT_RESULTS_DIR"
            "$DETKIT_CONTAINER_IMAGE" "${rank_cmd[@]}")
        ;;
esac

quote() { printf '%q ' "$@"; }
print_plan() {
    local i
    echo "detkit 2x2 plan for job $SLURM_JOB_ID ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    for ((i = 0; i < EXPECT_NODES; i++)); do
        echo "  node $i: ${hosts[i]} ranks $((i * EXPECT_TASKS_PER_NODE))..$(((i + 1) * EXPECT_TASKS_PER_NODE - 1)) (local ranks 0..$((EXPECT_TASKS_PER_NODE - 1)))"
    done
    echo "  rendezvous: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
    echo "  runtime=$DETKIT_RUNTIME device=$DETKIT_DEVICE suite=${DETKIT_SUITE:-<none: rank check only>}"
    echo "  image=${DETKIT_CONTAINER_IMAGE:-<none>} python=$DETKIT_PYTHON timeout=${DETKIT_DIST_TIMEOUT_S}s"
    echo "  NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE NCCL_DEBUG=$NCCL_DEBUG"
    echo "  results: $DETKIT_RESULTS_DIR"
    echo "  step 1 (one task per node): $(quote "${node_step[@]:0:${#node_step[@]}-1}")<node script>"
    echo "  step 2 (one task per GPU):  $(quote "${rank_step[@]}" | sed 's/bash -c .* detkit-rank/bash -c <rank script> detkit-rank/')"
}

if [[ $DETKIT_DRY_RUN == 1 ]]; then
    print_plan
    say "DRY RUN: nothing launched, nothing written"
    exit 0
fi

# ---- 4. run ------------------------------------------------------------------------------------
mkdir -p "$DETKIT_RESULTS_DIR"/{logs,nodes,ranks,topo}
print_plan | tee "$DETKIT_RESULTS_DIR/plan.txt"
env | grep -E '^(SLURM|DETKIT|NCCL|MASTER|CUDA|TRITON|OMP)_' | sort >"$DETKIT_RESULTS_DIR/job-env.txt"

show_failure() {  # STEP RC LOG_PREFIX
    local f
    printf '%s: %s failed with exit status %s; last lines of the per-task logs:\n' "$ME" "$1" "$2" >&2
    for f in "$logs/$3"-*.log; do
        [[ -f $f ]] || continue
        printf -- '----- %s\n' "$f" >&2
        tail -n 15 "$f" >&2
    done
    die "$1 failed (exit $2); logs in $logs"
}

rc=0
"${node_step[@]}" || rc=$?
((rc == 0)) || show_failure "node capture step" "$rc" node
rc=0
"${rank_step[@]}" || rc=$?
((rc == 0)) || show_failure "rank step" "$rc" rank

say "all $EXPECT_TASKS ranks passed; rank map: $DETKIT_RESULTS_DIR/rank_map.json"
say "per-rank logs: $logs/rank-R.log; per-node capture: $DETKIT_RESULTS_DIR/nodes/"
