# stream on NVIDIA GPUs (CUDA 13): docker build -t stream:gpu . && docker run --gpus all -p 5556:5556 stream:gpu
# The README's install table: the `gpu` extra is for CUDA 13 (driver >= 580). onnxruntime-gpu also needs cuDNN 9,
# hence the cudnn flavour of the CUDA 13 runtime image. tests/test_deploy.py checks the extras and ports here.

# -- build: the package and its dependencies into a virtual environment -----------------------------------------
FROM nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04 AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/stream
ENV PATH=/opt/stream/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY stream ./stream
RUN pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir '.[gpu]'

# -- run: the CUDA 13 runtime, Python and the environment; no compiler, no sources --------------------------------
FROM nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin stream
COPY --from=build /opt/stream /opt/stream
COPY deploy/docker/stream.toml /etc/stream/stream.toml
ENV PATH=/opt/stream/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility,video
USER stream
WORKDIR /home/stream
# publish (ZeroMQ), control (`stream ctl`), HTTP (status page, /metrics, /healthz): deploy/docker/stream.toml
EXPOSE 5556 5557 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["stream"]
CMD ["run", "--config", "/etc/stream/stream.toml"]
