# One image for every FlexLB process: `flexlb gateway`, `flexlb worker` (a real Triton server: the
# nvidia-pytriton wheel bundles tritonserver) and `flexlb up`. docker-compose.yml builds it once and
# runs each service with its own command. Build alone: docker build -t flexlb:local .
FROM python:3.11-slim-bookworm

# The official image's libpython is shared (/usr/local/lib), which PyTriton's Python-backend stub
# needs; curl serves the health checks. glibc 2.36 here meets the wheel's manylinux floor.
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/flexlb

# Dependencies first, from pyproject alone, so a source edit does not re-download Triton (~500 MB).
COPY pyproject.toml README.md constraints.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY app ./app
COPY workers ./workers
RUN pip install --no-deps .

# Triton writes its PyTriton workspace under the temp dir; a plain user is enough for everything.
RUN useradd --create-home --uid 10001 flexlb
USER flexlb

# gateway: 8000 (HTTP). worker: 8000 (Triton HTTP), 8001 (gRPC), 8002 (Triton metrics).
EXPOSE 8000 8001 8002
ENTRYPOINT ["flexlb"]
CMD ["--help"]
