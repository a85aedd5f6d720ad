# chatfleet: the engine, the gateway and the tools in one image.
#
#   CPU (default):  docker build -t chatfleet:0.1.0 .
#   GPU (CUDA torch wheels; the NVIDIA container runtime supplies the driver):
#     docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t chatfleet:0.1.0-cuda .
#
# The built-in models (BUILTIN_MODELS, default `tiny`) are built into the image, so
# `chatfleet engine --model tiny` needs no network and writes nothing at run time; other models
# come from a mounted folder (deploy/overlays/gpu). Runs as the unprivileged user 10001.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG BUILTIN_MODELS="tiny"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CHATFLEET_CACHE=/opt/chatfleet/cache \
    PATH=/opt/chatfleet/venv/bin:$PATH
RUN python -m venv /opt/chatfleet/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install "/src[k8s]"
RUN for name in ${BUILTIN_MODELS}; do \
        python -c "import sys; from chatfleet.engine.builtin_models.tiny import resolve_model; print(resolve_model(sys.argv[1]))" "$name"; \
    done

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --system --gid 10001 chatfleet \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin chatfleet
COPY --from=build /opt/chatfleet /opt/chatfleet
ENV PATH=/opt/chatfleet/venv/bin:$PATH \
    CHATFLEET_CACHE=/opt/chatfleet/cache \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 8080
ENTRYPOINT ["chatfleet"]
CMD ["engine", "--host", "0.0.0.0", "--port", "8000", "--model", "tiny"]
