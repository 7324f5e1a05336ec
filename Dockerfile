# detkit on a pinned NGC PyTorch image (CUDA 13, Hopper). Build through compose.yaml, which
# passes every argument below; docs/container.md explains the pins.
#
# Host requirements: an NVIDIA driver of the R580 branch or newer (CUDA 13 needs R580+), the
# NVIDIA Container Toolkit, and Hopper GPUs (sm_90) for the compiled kernels.
#
# BASE_IMAGE is the month tag; BASE_DIGEST the sha256 manifest digest of that tag, read from the
# registry (docs/container.md: `docker buildx imagetools inspect <tag>` or the NGC catalog).
# With a digest the pull is content-addressed (`tag@sha256:...`: the tag is then only a label).
# compose.yaml refuses to start without one, before any pull; here, without one the build stops
# (after the pull: a RUN needs the base), unless ALLOW_UNPINNED_BASE=1 is passed on purpose. Only
# the CI stand-in base, an imported image with no registry digest, is built so
# (.ci/compose.standin.yaml); the image then records that it was built unpinned.
#
# ALLOW_CPU_BASE=1 accepts a base whose torch has no CUDA (the CI stand-in base, built without a
# registry: docs/container.md). The torch/triton version checks stay on; the image records every
# relaxation flag in DETKIT_BUILD_CHECKS and the label io.detkit.build.checks (detkit env shows them).
# No `# syntax=` line: BuildKit's built-in frontend handles RUN --mount, and a syntax line would
# pull a frontend image from a registry.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.03-py3
ARG BASE_DIGEST=
FROM ${BASE_IMAGE}${BASE_DIGEST:+@${BASE_DIGEST}}

ARG BASE_IMAGE
ARG BASE_DIGEST
ARG ALLOW_UNPINNED_BASE=0
ARG ALLOW_CPU_BASE=0
# The reference this image is tagged with (compose.yaml's `image:`); a container cannot see its
# own digest, so reports read it from DETKIT_IMAGE.
ARG DETKIT_IMAGE=detkit:0.1.0
ARG DETKIT_GIT_COMMIT=
# The versions detkit is developed and tested with (the H200 reports: torch 2.11, triton 3.6, CUDA 13).
ARG MIN_TORCH=2.11
ARG MIN_TRITON=3.6
ARG CUDA_MAJOR=13

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Fail closed: refuse an unpinned base and a base whose stack is older than detkit's.
# NGC builds report versions such as 2.11.0a0+<sha>; only the release part is compared.
RUN for flag in "ALLOW_UNPINNED_BASE=${ALLOW_UNPINNED_BASE}" "ALLOW_CPU_BASE=${ALLOW_CPU_BASE}"; do \
        [[ "${flag#*=}" == [01] ]] || { echo "${flag}: supported values are 0 and 1" >&2; exit 1; }; \
    done \
 && if [[ -z "${BASE_DIGEST}" && "${ALLOW_UNPINNED_BASE}" != 1 ]]; then \
        echo "BASE_DIGEST is empty: pin ${BASE_IMAGE} by digest (docs/container.md)" \
             "or pass ALLOW_UNPINNED_BASE=1 deliberately" >&2; exit 1; \
    fi \
 && python -c "import re, sys, torch, triton; \
rel = lambda v: tuple(int(x) for x in re.match(r'(\d+)\.(\d+)', v).groups()); \
need = {'torch': (torch.__version__, '${MIN_TORCH}'), 'triton': (triton.__version__, '${MIN_TRITON}')}; \
bad = [f'{k} {v} < {m}' for k, (v, m) in need.items() if rel(v) < rel(m)]; \
cuda = torch.version.cuda or 'none'; \
cpu_ok = cuda == 'none' and '${ALLOW_CPU_BASE}' == '1'; \
bad += [] if cuda.split('.')[0] == '${CUDA_MAJOR}' or cpu_ok else [f'CUDA {cuda} is not CUDA ${CUDA_MAJOR}']; \
print(f'base: torch {torch.__version__}, triton {triton.__version__}, CUDA {cuda}' + (' (ALLOW_CPU_BASE=1)' if cpu_ok else '')); \
sys.exit('base image does not fit detkit: ' + '; '.join(bad) + ' (choose a newer BASE_IMAGE)' if bad else None)"

# detkit's dependencies at the pins of requirements-ci.txt, the project's one list of pins (bound
# in for this step only): the pure-Python ones of pyproject.toml and its `models` extra (transformers,
# which the model audit in the default suite `all` needs), every package they pull in held to its
# pin there. torch, triton and numpy stay the base image's own: their pins are left out, and the
# versions the base has are added as constraints, so pip fails rather than replace them.
# (.ci/docker.sh carries the wheels of the same list for the CI stand-in base.)
RUN --mount=type=bind,source=requirements-ci.txt,target=/tmp/requirements-ci.txt \
    grep -vE '^(torch|triton|numpy)==' /tmp/requirements-ci.txt >/tmp/detkit-constraints.txt \
 && pip list --format=freeze | grep -iE '^(torch|triton|numpy)==' >>/tmp/detkit-constraints.txt \
 && for name in click tabulate psutil nvtx nvidia-ml-py matplotlib transformers; do \
        grep -E "^${name}==" /tmp/requirements-ci.txt \
            || { echo "requirements-ci.txt has no '${name}==<version>' pin" >&2; exit 1; }; \
    done >/tmp/detkit-requirements.txt \
 && pip install --no-cache-dir -c /tmp/detkit-constraints.txt -r /tmp/detkit-requirements.txt \
 && rm /tmp/detkit-constraints.txt /tmp/detkit-requirements.txt \
 && python -c "import transformers; print('models extra: transformers', transformers.__version__)"

# detkit itself, without dependencies, so pip can never replace the image's torch/triton.
# The source is bind-mounted for the build only (.dockerignore keeps the context small).
RUN --mount=type=bind,source=.,target=/tmp/detkit-src,rw \
    pip install --no-cache-dir --no-deps /tmp/detkit-src \
 && detkit --help >/dev/null

RUN groupadd --gid 10001 detkit \
 && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash detkit \
 && install -d -o detkit -g detkit -m 0775 /results

LABEL org.opencontainers.image.title="detkit" \
      org.opencontainers.image.description="Deterministic Triton GEMMs and TP/CP reduction audits for Hopper" \
      org.opencontainers.image.ref.name="${DETKIT_IMAGE}" \
      org.opencontainers.image.revision="${DETKIT_GIT_COMMIT}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      io.detkit.image="${DETKIT_IMAGE}" \
      io.detkit.build.checks="ALLOW_UNPINNED_BASE=${ALLOW_UNPINNED_BASE} ALLOW_CPU_BASE=${ALLOW_CPU_BASE}" \
      io.detkit.requires.driver="R580 or newer (CUDA ${CUDA_MAJOR})" \
      io.detkit.requires.gpu="sm_90 (Hopper)"

# Caches go to /tmp so any UID (compose runs as the invoking user) can write them (transformers' too:
# the model audit builds its model from a config and never downloads).
ENV DETKIT_IMAGE="${DETKIT_IMAGE}" \
    DETKIT_BASE_IMAGE="${BASE_IMAGE}${BASE_DIGEST:+@${BASE_DIGEST}}" \
    DETKIT_GIT_COMMIT="${DETKIT_GIT_COMMIT}" \
    DETKIT_BUILD_CHECKS="ALLOW_UNPINNED_BASE=${ALLOW_UNPINNED_BASE} ALLOW_CPU_BASE=${ALLOW_CPU_BASE}" \
    NCCL_NVLS_ENABLE=0 \
    TRITON_CACHE_DIR=/tmp/detkit-cache/triton \
    MPLCONFIGDIR=/tmp/detkit-cache/matplotlib \
    HF_HOME=/tmp/detkit-cache/huggingface \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

USER 10001:10001
WORKDIR /results
CMD ["detkit", "env"]
