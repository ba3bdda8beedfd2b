# sloserve as users install it: a wheel built from this checkout, on a slim Python image.
#
#   docker build -t sloserve:cpu .                                            # CPU torch (default)
#   docker build -t sloserve:cuda --build-arg TORCH_INDEX=https://pypi.org/simple .   # CUDA torch
#   docker run --rm -p 8000:8000 -p 50051:50051 sloserve:cpu                   # the built-in model
#   docker run --rm --gpus all -v /models:/models -p 8000:8000 -p 50051:50051 sloserve:cuda \
#       serve --host 0.0.0.0 --model /models/Qwen2.5-0.5B-Instruct
#
# The CUDA variant is the same image with PyPI's torch wheel, which carries its CUDA libraries:
# the host needs only the NVIDIA driver and the container toolkit (`--gpus all`).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY setup.py setup.cfg pyproject.toml MANIFEST.in README.md ./
COPY hotpath/ hotpath/
COPY protos/ protos/
COPY server/ server/
COPY cli/ cli/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --create-home --uid 1000 sloserve
USER sloserve
# gRPC (health probes on it too), the OpenAI-compatible HTTP API, Prometheus metrics
EXPOSE 50051 8000 9464
# every flag can also be set as SLOSERVE_SERVE_<FLAG> (e.g. SLOSERVE_SERVE_MODEL=/models/x)
ENTRYPOINT ["sloserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", "--metrics-port", "9464"]
