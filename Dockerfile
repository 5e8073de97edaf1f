# linstream: serves the shipped default model on port 8000 (weights are in the image).
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# jemalloc instead of glibc's malloc: it hands the decode step's freed buffers back to the OS,
# where glibc's arenas keep them (benchmarks/robustness/soak.py --allocator; docs/reliability.md#soak)
# g++: the compiled decode step (inductor, AOTInductor) and our matmul kernel are built at the
# first start, then loaded from the compile cache (TORCHINDUCTOR_CACHE_DIR, on the volume below)
RUN apt-get update && apt-get install -y --no-install-recommends libjemalloc2 g++ && rm -rf /var/lib/apt/lists/*
ENV LD_PRELOAD=libjemalloc.so.2
# torch first, so the project's `torch>=2.4` is already met. TORCH_VARIANT picks the build: cpu
# (the default: no CUDA libraries, a far smaller image) or a CUDA one such as cu126; it is fetched
# from PyTorch's wheel index, whose base URL TORCH_INDEX names (its variants are its subfolders).
# With TORCH_INDEX empty, pip's default index serves its default (CUDA-enabled) build instead.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=""
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX/$TORCH_VARIANT"} torch==2.13.0
COPY pyproject.toml README.md ./
COPY model ./model
COPY server ./server
COPY clients ./clients
COPY linstream ./linstream
RUN pip install . && mkdir -p /data && chown nobody /data
# sessions and snapshots persist here; mount a volume to keep them across containers
ENV LINSTREAM_STORE=disk:/data/store TORCHINDUCTOR_CACHE_DIR=/data/compile
VOLUME /data
EXPOSE 8000
USER nobody
CMD ["linstream", "serve", "--host", "0.0.0.0", "--port", "8000"]
