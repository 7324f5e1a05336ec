#!/usr/bin/env bash
# A private Docker engine and a registry-free stand-in base image, for building and running the
# project's Dockerfile in CI (tests/test_container_build.py drives it; docs/container.md).
#
#   bash .ci/docker.sh install                 # Debian's docker.io and debootstrap (apt)
#   bash .ci/docker.sh up STATE [SOCKET_GID]   # start dockerd, make the stand-in base image
#   bash .ci/docker.sh down STATE              # stop the dockerd that 'up' started, by its pid
#
# up: dockerd from the docker.io package (/usr/sbin/dockerd, client /usr/bin/docker) with
# --iptables=false and no bridge (containers run with network none or host), listening on the
# unix socket STATE/docker.sock only (group SOCKET_GID, mode 660, when given), its pid in
# STATE/dockerd.pid. Its data root (DETKIT_DOCKER_DATA_ROOT, default /var/lib/detkit-ci-docker)
# is kept between runs as the cache of the stand-in image and of the build; a lock on it lets one
# engine use it at a time. The stand-in base is Debian bookworm (debootstrap, minbase) with
# python3 and a venv at /opt/venv holding what the NGC base brings for detkit: torch, triton and
# numpy at their pins in requirements-ci.txt. Everything the Dockerfile's pip step installs (the
# pure-Python dependencies and the models extra, with what they pull in, at the same pins) is
# carried as wheels in /opt/detkit-wheels, which /etc/pip.conf makes pip's only source (no index),
# so the Dockerfile's build installs them for real without a network. The wheels are those this
# machine's pip downloads ($PYTHON -m pip download). The image is `docker import`ed as
# detkit-standin:<key>, the key hashing this script and requirements-ci.txt.
# Writes STATE/env (DOCKER_HOST=..., DETKIT_STANDIN_IMAGE=...) and prints one 'time <step>: N s'
# line per step.
#
# Exit status: 0 done; 3 no engine can run here (not root, no apt to install it): the reason is
# the last line, prefixed 'SKIP:'; anything else is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly DOCKER=/usr/bin/docker DOCKERD=/usr/sbin/dockerd
readonly SUITE=bookworm
# What the NGC base brings (installed in the stand-in's venv), and what the Dockerfile's pip step
# installs (carried as wheels): pyproject.toml's dependencies and its models extra, split the way the
# Dockerfile splits them (tests/test_container_static.py checks the three lists agree). Pins: requirements-ci.txt.
readonly BASE_PACKAGES=(torch triton numpy)
readonly IMAGE_PACKAGES=(click tabulate psutil nvtx nvidia-ml-py matplotlib transformers)
# pip builds detkit in an isolated environment that needs setuptools (pyproject: >=69).
readonly SETUPTOOLS_PIN=setuptools==80.9.0
DATA_ROOT=${DETKIT_DOCKER_DATA_ROOT:-/var/lib/detkit-ci-docker}
MIRROR=${DETKIT_DEBIAN_MIRROR:-http://deb.debian.org/debian}

say() { printf 'ci docker: %s\n' "$*"; }
die() { printf 'ci docker: ERROR: %s\n' "$*" >&2; exit 1; }
skip() { printf 'SKIP: %s\n' "$*"; exit 3; }

step_start=0
step() { step_start=$SECONDS; say "$*"; }
step_done() { printf 'time %s: %d s\n' "$1" $((SECONDS - step_start)); }

install() {
    [[ $(id -u) == 0 ]] || skip "installing docker.io needs root (uid $(id -u))"
    if [[ -x $DOCKERD && -x $DOCKER ]] && command -v debootstrap >/dev/null; then
        return 0
    fi
    command -v apt-get >/dev/null || skip "docker.io and debootstrap are missing and there is no apt-get to install them"
    step "apt-get install docker.io debootstrap"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    # policy-rc.d-style machines refuse to start the packaged service; the engine is started by 'up'.
    apt-get install -y -q --no-install-recommends docker.io debootstrap >/dev/null
    step_done install
}

standin_key() {
    cat .ci/docker.sh requirements-ci.txt | sha256sum | cut -c1-16
}

pins_of() {  # the requirements-ci.txt lines of the packages named, one per line
    local name line found
    for name in "$@"; do
        found=
        while read -r line; do
            [[ ${line%%==*} == "$name" ]] && found=$line
        done <requirements-ci.txt
        [[ -n $found ]] || die "requirements-ci.txt has no '$name==<version>' pin"
        printf '%s\n' "$found"
    done
}

build_standin() {  # TAG WORK
    local tag=$1 work=$2 python=${PYTHON:-}
    if [[ -z $python ]]; then
        python=python3
        [[ -x .venv/bin/python ]] && python=.venv/bin/python
    fi
    local rootfs=$work/rootfs wheels=$work/rootfs/opt/detkit-wheels
    mkdir -p "$work"
    step "debootstrap $SUITE (minbase + python3, python3-venv) from $MIRROR"
    debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$rootfs" "$MIRROR" \
        >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
    step_done debootstrap
    step "pip download of the base's and the image's pins of requirements-ci.txt ($python)"
    local base=$work/base-wheels
    mkdir -p "$wheels" "$base"
    pins_of "${BASE_PACKAGES[@]}" >"$work/base.txt"
    pins_of "${IMAGE_PACKAGES[@]}" >"$work/image.txt"
    "$python" -m pip download -q --only-binary=:all: -d "$base" -r "$work/base.txt" >"$work/pip.log" 2>&1 ||
        { grep -v "is ignored: it is" "$work/pip.log" | tail -n 30 >&2; die "pip download failed"; }
    [[ -n $(ls "$base"/torch-*.whl 2>/dev/null) ]] || die "pip download left no torch wheel in $base"
    # The image's packages and everything they pull in, held to every pin of requirements-ci.txt (the
    # constraints of the Dockerfile's pip step), and setuptools for the isolated build of detkit.
    "$python" -m pip download -q --only-binary=:all: -d "$wheels" -c requirements-ci.txt -r "$work/image.txt" \
        "$SETUPTOOLS_PIN" >>"$work/pip.log" 2>&1 ||
        { grep -v "is ignored: it is" "$work/pip.log" | tail -n 30 >&2; die "pip download failed"; }
    step_done wheels
    step "venv /opt/venv in the stand-in (the base's torch, triton, numpy), offline from the downloaded wheels"
    mv "$base" "$rootfs/opt/detkit-base-wheels"
    cp "$work/base.txt" "$rootfs/opt/detkit-base-wheels/pins.txt"
    printf '[global]\nno-index = true\nfind-links = /opt/detkit-wheels\n' >"$rootfs/etc/pip.conf"
    # A clean environment: this machine's pip settings (find-links, index, constraints) stay out.
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
        chroot "$rootfs" /bin/sh -c 'python3 -m venv /opt/venv &&
            /opt/venv/bin/pip install -q --no-cache-dir --find-links /opt/detkit-base-wheels \
                -r /opt/detkit-base-wheels/pins.txt &&
            /opt/venv/bin/python -c "import torch, triton; print(\"stand-in: torch\", torch.__version__, \"triton\", triton.__version__)"'
    rm -rf "$rootfs/opt/detkit-base-wheels"
    # The base's own packages are installed; the Dockerfile's pip step finds the rest here.
    for name in "${BASE_PACKAGES[@]}"; do
        find "$wheels" -name "${name}-*.whl" -delete
    done
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    step_done venv
    step "docker import as $tag"
    tar -C "$rootfs" --numeric-owner -c . | "$DOCKER" import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'LABEL io.detkit.standin="debootstrap '"$SUITE"' minbase + /opt/venv with torch, triton, numpy at the pins of requirements-ci.txt, the wheels of the rest in /opt/detkit-wheels; no CUDA"' \
        --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
    step_done import
}

up() {
    local state=$1 socket_gid=${2:-}
    [[ $(id -u) == 0 ]] || skip "dockerd needs root (uid $(id -u))"
    install
    mkdir -p "$state" "$DATA_ROOT"
    state=$(cd "$state" && pwd)
    local sock=$state/docker.sock
    [[ ! -e $state/dockerd.pid ]] || die "$state/dockerd.pid exists: run 'down $state' first"
    # One engine per data root; the lock is inherited by dockerd and released when it exits.
    exec 9>"$DATA_ROOT.lock"
    flock -w 1200 9 || die "another engine holds $DATA_ROOT.lock for more than 20 minutes"
    step "dockerd (data root $DATA_ROOT, socket $sock)"
    "$DOCKERD" --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
        --host "unix://$sock" --data-root "$DATA_ROOT" --exec-root "$state/exec" \
        --pidfile "$state/dockerd.pid.daemon" </dev/null >"$state/dockerd.log" 2>&1 &
    echo $! >"$state/dockerd.pid"
    exec 9>&-
    local i
    for ((i = 0; i < 120; i++)); do
        kill -0 "$(cat "$state/dockerd.pid")" 2>/dev/null ||
            { tail -n 30 "$state/dockerd.log" >&2; die "dockerd exited during start-up"; }
        [[ -S $sock ]] && DOCKER_HOST=unix://$sock "$DOCKER" version >/dev/null 2>&1 && break
        sleep 0.5
    done
    ((i < 120)) || { tail -n 30 "$state/dockerd.log" >&2; die "dockerd did not answer on $sock within 60 s"; }
    if [[ -n $socket_gid ]]; then
        chgrp "$socket_gid" "$sock"
        chmod 660 "$sock"
    fi
    step_done dockerd
    export DOCKER_HOST=unix://$sock DOCKER_BUILDKIT=1
    local tag key
    key=$(standin_key)
    tag=detkit-standin:$key
    if "$DOCKER" image inspect "$tag" >/dev/null 2>&1; then
        say "stand-in base $tag is cached in $DATA_ROOT"
    else
        local work
        work=$(mktemp -d "$state/standin.XXXXXX")
        build_standin "$tag" "$work"
        step "remove the stand-in's work folder"
        # Never delete through a mount that debootstrap may have left (proc, sys) in the rootfs.
        if grep -q " $work/" /proc/mounts; then
            say "mounts remain under $work; leaving it in place"
        else
            rm -rf "$work"
        fi
        step_done cleanup
    fi
    step "prune older stand-ins, dangling images and build cache"
    # Keep the cache bounded: older stand-ins, dangling images, build cache beyond 4 GB.
    "$DOCKER" images --format '{{.Repository}}:{{.Tag}}' detkit-standin | grep -vx "$tag" |
        xargs -r "$DOCKER" rmi -f >/dev/null 2>&1 || true
    "$DOCKER" image prune -f >/dev/null 2>&1 || true
    "$DOCKER" builder prune -f --keep-storage 4gb >/dev/null 2>&1 || true
    step_done prune
    printf 'DOCKER_HOST=%s\nDETKIT_STANDIN_IMAGE=%s\n' "$DOCKER_HOST" "$tag" >"$state/env"
    say "up: DOCKER_HOST=$DOCKER_HOST, stand-in base $tag"
}

down() {
    local state=$1 pid i
    [[ -f $state/dockerd.pid ]] || { say "down: no dockerd.pid in $state (nothing started)"; return 0; }
    pid=$(cat "$state/dockerd.pid")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for ((i = 0; i < 60; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "dockerd $pid ignored SIGTERM for 30 s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$state/dockerd.pid" "$state/docker.sock"
    say "down: dockerd $pid stopped"
}

case ${1:-} in
    install) install ;;
    up) [[ $# -ge 2 ]] || die "usage: $0 up STATE [SOCKET_GID]"; up "$2" "${3:-}" ;;
    down) [[ $# -eq 2 ]] || die "usage: $0 down STATE"; down "$2" ;;
    *) die "usage: $0 install | up STATE [SOCKET_GID] | down STATE" ;;
esac
