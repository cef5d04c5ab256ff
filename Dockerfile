# syntax=docker/dockerfile:1.7
# pdd images: `--target operator` (kopf operator, no torch) and `--target sidecar` (default: the
# prefill/decode sidecars and the router, with torch + NIXL). Both run as a non-root user from a
# virtual environment built in a separate stage, so no compiler or pip cache ships.
#
# The entry points are the commands the operator writes into pods and the manifests name:
#   python -m pdd_operator            (operator)
#   python -m pdd_sidecar serve       (prefill/decode, role from PDD_ROLE)
#   python -m pdd_sidecar router      (router)
#   pdd validate|plan|crd|generate    (CLI)
# tests/unit/test_packaging.py checks every one of them exists in the installed package, and
# that the runtime ENV below is what tests/e2e/podrunner.py gives the pods it runs locally.
#
# The base is pinned to an exact patch release; pin the digest too when building for a
# registry (--build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:...).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---------------------------------------------------------------- build stages
FROM ${PYTHON_IMAGE} AS build-base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdd
ENV PATH=/opt/pdd/bin:$PATH
WORKDIR /src
# Metadata first: dependency layers are reused while only the source changes.
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY sidecar/ sidecar/

FROM build-base AS build-operator
RUN pip install '.[operator]'

FROM build-base AS build-sidecar
RUN pip install '.[sidecar]'

# ---------------------------------------------------------------- runtime base
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 pdd \
    && useradd --uid 10001 --gid 10001 --home-dir /home/pdd --create-home \
       --shell /usr/sbin/nologin pdd
ENV PATH=/opt/pdd/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANG=C.UTF-8 \
    OMP_NUM_THREADS=1
WORKDIR /home/pdd
USER 10001:10001

# ---------------------------------------------------------------- operator
FROM runtime AS operator
COPY --from=build-operator --chown=0:0 /opt/pdd /opt/pdd
EXPOSE 8080 8081 9443
CMD ["python", "-m", "pdd_operator"]

# ---------------------------------------------------------------- sidecar (default target)
FROM runtime AS sidecar
COPY --from=build-sidecar --chown=0:0 /opt/pdd /opt/pdd
EXPOSE 8000 5600
CMD ["python", "-m", "pdd_sidecar", "serve"]
