# microbatch image: one image for every role (serve, gateway, worker).
#   docker build -t microbatch .                              CPU torch (default)
#   docker build --build-arg TORCH_VARIANT=cu126 -t microbatch:cuda .   CUDA torch
#   docker build --build-arg TORCH_VARIANT=cu126 --build-arg EXTRAS=onnx,vllm -t microbatch:vllm .
#                                        and vLLM's engine (`engine vllm`, docs/api.md)
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_VARIANT=cpu
ARG EXTRAS=onnx
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app
# torch first, from its own index, so the CPU build is used unless a CUDA variant is asked for
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY common ./common
COPY gateway ./gateway
COPY worker ./worker
# the onnx extra too, so every `backend` (torch, onnx, auto) can start in the image
RUN pip install ".[${EXTRAS}]"

RUN useradd --create-home --uid 10001 microbatch
USER microbatch
EXPOSE 8000
ENTRYPOINT ["microbatch"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
