#!/usr/bin/env bash
# Install the Slurm daemons, client and munge from Debian for the real-cluster test
# (tests/test_slurm.py, brought up by .ci/slurm/cluster.sh). Idempotent: when every binary the
# cluster needs is already on PATH it does nothing (no apt-get update), so reruns are instant.
set -euo pipefail

need=(slurmctld slurmd sbatch srun scontrol munged mungekey unshare nsenter mknod)
missing=()
for bin in "${need[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
done
if ((${#missing[@]} == 0)); then
    echo "slurm/install: already installed ($(slurmd -V))"
    exit 0
fi
echo "slurm/install: missing ${missing[*]}; installing from Debian"

if [[ $(id -u) -ne 0 ]]; then
    echo "slurm/install: must run as root (apt-get install); missing: ${missing[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# util-linux provides unshare/nsenter, coreutils mknod; both are essential on Debian but are
# listed so a slim image fails here rather than in cluster.sh.
apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge util-linux coreutils >/dev/null

# The packages enable and may start the system munge/slurm services where systemd runs; the test
# cluster uses its own private daemons and never touches those.
for bin in "${need[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || { echo "slurm/install: $bin still missing after install" >&2; exit 1; }
done
echo "slurm/install: done ($(slurmd -V))"
