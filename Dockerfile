# syntax=docker/dockerfile:1.7
# pdd images: `--target operator` (kopf operator, no torch) and `--target sidecar` (default: the
# prefill/decode sidecars and the router, with torch + NIXL). Both run as a non-root user from a
# root-owned virtual environment; no compiler or pip cache ships.
#
# The entry points are the commands the operator writes into pods and the manifests name:
#   python -m pdd_operator            (operator)
#   python -m pdd_sidecar serve       (prefill/decode, role from PDD_ROLE)
#   python -m pdd_sidecar router      (router)
#   pdd validate|plan|crd|generate    (CLI)
# tests/unit/test_packaging.py checks every one of them exists in the installed package;
# tests/e2e/test_realnode.py runs them, and checks the runtime ENV below, in containers.
#
# The base is pinned to an exact patch release; pin the digest too when building for a
# registry (--build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:...).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---------------------------------------------------------------- runtime base
# One stage per target, installed in place as root, the user switched last: no stage holds a
# second copy of the virtual environment (torch and the CUDA libraries are gigabytes), the
# environment stays root-owned, and no compiler ships (every dependency installs as a wheel).
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 pdd \
    && useradd --uid 10001 --gid 10001 --home-dir /home/pdd --create-home \
       --shell /usr/sbin/nologin pdd \
    && python -m venv /opt/pdd
ENV PATH=/opt/pdd/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANG=C.UTF-8 \
    OMP_NUM_THREADS=1
WORKDIR /home/pdd

# ---------------------------------------------------------------- how each target installs
# 1. the dependencies, from pyproject.toml alone (empty source roots), so their layer is reused
#    while only the source or the docs change; 2. the package itself, without dependencies.
# pip's cache is a build cache mount, never a layer. The build arguments serve builds from a
# wheel folder bind-mounted at build time instead of the index (PIP_FIND_LINKS, PIP_NO_INDEX):
# hack/image.py (make image) builds that way.

# ---------------------------------------------------------------- operator
FROM runtime AS operator
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
COPY pyproject.toml /tmp/pdd-src/
RUN --mount=type=cache,id=pdd-pip,target=/root/.cache/pip \
    mkdir /tmp/pdd-src/operator /tmp/pdd-src/sidecar \
    && PIP_DISABLE_PIP_VERSION_CHECK=1 pip install '/tmp/pdd-src[operator]'
COPY operator/ /tmp/pdd-src/operator/
COPY sidecar/ /tmp/pdd-src/sidecar/
RUN --mount=type=cache,id=pdd-pip,target=/root/.cache/pip \
    PIP_DISABLE_PIP_VERSION_CHECK=1 pip install --no-deps --force-reinstall /tmp/pdd-src \
    && rm -rf /tmp/pdd-src
USER 10001:10001
EXPOSE 8080 8081 9443
CMD ["python", "-m", "pdd_operator"]

# ---------------------------------------------------------------- sidecar (default target)
FROM runtime AS sidecar
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
COPY pyproject.toml /tmp/pdd-src/
RUN --mount=type=cache,id=pdd-pip,target=/root/.cache/pip \
    mkdir /tmp/pdd-src/operator /tmp/pdd-src/sidecar \
    && PIP_DISABLE_PIP_VERSION_CHECK=1 pip install '/tmp/pdd-src[sidecar]'
COPY operator/ /tmp/pdd-src/operator/
COPY sidecar/ /tmp/pdd-src/sidecar/
RUN --mount=type=cache,id=pdd-pip,target=/root/.cache/pip \
    PIP_DISABLE_PIP_VERSION_CHECK=1 pip install --no-deps --force-reinstall /tmp/pdd-src \
    && rm -rf /tmp/pdd-src
USER 10001:10001
EXPOSE 8000 5600
CMD ["python", "-m", "pdd_sidecar", "serve"]
