# batchserve image: the package in a virtual environment on top of a PyTorch base image.
#
#   docker build -t batchserve:0.1.0-cuda12.6 .
#   docker run --rm --gpus all -p 8000:8000 batchserve:0.1.0-cuda12.6
#
# BASE_IMAGE must hold Python 3.11+ with pip. The default is PyTorch's own CUDA runtime image,
# whose torch build matches the CUDA libraries beside it; that torch is used as it is, never
# reinstalled. For a base without torch (a plain Python image), pass TORCH_SPEC, and
# PIP_EXTRA_ARGS to say where pip finds it; the optional build context `wheels` is mounted at
# /wheels for a local wheelhouse (deploy/container_smoke.sh builds offline that way):
#
#   docker build --build-arg BASE_IMAGE=python:3.11-slim-bookworm \
#     --build-arg TORCH_SPEC=torch==2.13.0 \
#     --build-arg PIP_EXTRA_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu" .
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime

# Empty unless the build is given `--build-context wheels=DIR`, which replaces this stage.
FROM scratch AS wheels

FROM ${BASE_IMAGE} AS builder
ARG TORCH_SPEC=""
ARG PIP_EXTRA_ARGS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
# --system-site-packages: the venv sees the base image's torch (and its CUDA libraries).
# --without-pip: the base's own pip installs into the venv (`pip --python`), so the base need
# not ship ensurepip (Debian and Ubuntu split it out into python3-venv).
RUN python3 -m venv --system-site-packages --without-pip /opt/batchserve
# torch first, in its own layer: the slowest step, cached while the source changes.
# PIP_EXTRA_ARGS is meant to split into several flags.
RUN --mount=type=bind,from=wheels,target=/wheels \
    if [ -n "${TORCH_SPEC}" ]; then \
        python3 -m pip --python /opt/batchserve/bin/python install ${PIP_EXTRA_ARGS} "${TORCH_SPEC}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
RUN --mount=type=bind,from=wheels,target=/wheels \
    python3 -m pip wheel ${PIP_EXTRA_ARGS} --no-deps --wheel-dir /src/dist . \
    && python3 -m pip --python /opt/batchserve/bin/python install ${PIP_EXTRA_ARGS} /src/dist/*.whl \
    && if [ -z "${TORCH_SPEC}" ] && [ -n "$(find /opt/batchserve/lib -maxdepth 3 -name torch -type d)" ]; then \
        echo "pip installed a second torch over the base image's; pin the base's version" >&2; \
        exit 1; \
    fi \
    && /opt/batchserve/bin/python -c "import torch, service.server.single, service.server.frontend_process; print('torch', torch.__version__)"
# `batchserve package` leaves version folders private to their creator (mkdtemp's 0700):
# readable by everyone here, writable by no one but root.
COPY models/ /models/
RUN chmod -R u=rwX,go=rX /models

FROM ${BASE_IMAGE} AS runtime
# A fixed numeric user, so Kubernetes' runAsNonRoot can check it and volumes can be chowned
# to it; a passwd entry too, because torch.compile asks getpass.getuser() for its cache path.
RUN groupadd --system --gid 10001 batchserve \
    && useradd --system --no-log-init --uid 10001 --gid batchserve \
        --home-dir /home/batchserve --create-home --shell /usr/sbin/nologin batchserve \
    && install -d -o batchserve -g batchserve /tmp/batchserve-metrics
COPY --from=builder /opt/batchserve /opt/batchserve
# Owned by root and read-only to the server: the repository is configuration. Mount another
# repository over /models to serve other models with the same image.
COPY --from=builder /models /models
ENV PATH=/opt/batchserve/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    BATCHSERVE_HOST=0.0.0.0 \
    BATCHSERVE_PORT=8000 \
    BATCHSERVE_MODEL_REPOSITORY=/models \
    PROMETHEUS_MULTIPROC_DIR=/tmp/batchserve-metrics
USER 10001:10001
WORKDIR /home/batchserve
EXPOSE 8000
# Liveness only. One process answers /healthz while its model loads; with front ends and
# engines (BATCHSERVE_WORKERS above 1) the front ends answer once an engine is ready, so the
# start period allows for torch.compile and warm-up.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["/opt/batchserve/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('BATCHSERVE_PORT', '8000'), timeout=4)"]
# SIGTERM (the default, said here because shutdown relies on it) turns readiness off, drains
# the queue and exits 0; exec form so the server is PID 1 and receives it.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/batchserve/bin/batchserve"]
CMD ["serve"]
