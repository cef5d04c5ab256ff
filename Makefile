# pdd — one entry point for set-up, tests, demo and benchmarks.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PYTEST := $(VPY) -m pytest
export PYTHONUNBUFFERED := 1
# NODE=real runs the e2e tier and the demo on the real node (kubelet, containerd, runc; the
# image of `make image`) instead of the pod runner: `make test-e2e NODE=real`, `make demo NODE=real`.
ON_REAL_NODE = $(filter real,$(NODE))
REAL_NODE_DEPS = $(if $(ON_REAL_NODE),cluster-build-node cluster-node-deps image)

.PHONY: sysdeps venv test test-vllm test-unit test-integration test-dataplane test-e2e lint demo bench crd cluster-up cluster-down

# The venv is rebuilt when pyproject.toml changes; the stamp lives inside the ignored .venv.
$(VENV)/.stamp: pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[operator,sidecar,test]'
	@touch $@

venv: $(VENV)/.stamp

lint: venv
	$(VENV)/bin/ruff check operator sidecar tests bench
	$(VENV)/bin/mypy operator/pdd_api operator/pdd_cli operator/pdd_operator sidecar/pdd_sidecar

# The pod runner (tests/e2e/podrunner.py) needs iproute2 and util-linux; install them if missing.
sysdeps:
	@command -v ip >/dev/null && command -v unshare >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq iproute2 util-linux; }

test-unit: venv
	$(PYTEST) tests/unit -q

test-dataplane: venv
	$(PYTEST) tests/dataplane -q -m dataplane

test-integration: venv cluster-build
	$(PYTEST) tests/integration -q -m integration

test-e2e: venv cluster-build sysdeps $(REAL_NODE_DEPS)
	$(if $(ON_REAL_NODE),PDD_E2E_NODE=real) $(PYTEST) tests/e2e -q -m e2e

# Every tier that exists; later tiers add themselves by having tests in their folder.
test: venv lint
	$(MAKE) test-unit
	@if ls tests/dataplane/test_*.py >/dev/null 2>&1; then $(MAKE) test-dataplane; fi
	@if ls tests/integration/test_*.py >/dev/null 2>&1; then $(MAKE) test-integration; fi
	@if ls tests/e2e/test_*.py >/dev/null 2>&1; then $(MAKE) test-e2e; fi

# Optional tier, not part of `make test`: vLLM's own CLI parser and NIXL rank mapping read what
# the operator renders for engine vllm. A venv of its own: vllm pins torch (several GB).
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm==0.33.0
$(VLLM_VENV)/.stamp:
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q '$(VLLM_SPEC)' 'pytest>=8'
	@touch $@

test-vllm: $(VLLM_VENV)/.stamp
	PDD_TEST_VLLM=1 PYTHONPATH=operator $(VLLM_VENV)/bin/python -m pytest tests/vllm_tier -q -p no:cacheprovider

# kustomize cannot reach outside manifests/, nor Helm outside its chart, so each keeps a copy
# (tests check them).
crd: venv
	$(VENV)/bin/pdd crd > crds/serving.pdd.dev_pddeployments.yaml
	cp crds/serving.pdd.dev_pddeployments.yaml manifests/base/crd.yaml
	cp crds/serving.pdd.dev_pddeployments.yaml charts/pdd/crds/

demo: venv cluster-build sysdeps $(REAL_NODE_DEPS)
	$(VPY) hack/demo.py $(if $(ON_REAL_NODE),--node real)

bench: venv
	@for b in bench/*.py; do echo "== $$b"; $(VPY) $$b || exit 1; done

# The images (Dockerfile targets sidecar and operator) built with buildah against a Debian
# bookworm base made with debootstrap (no Docker engine or registry needed), then imported into
# the real node's containerd when `make cluster-up NODE=real` runs. Caches in .cache/image.
# Needs root; docs/e2e.md has the figures.
.PHONY: image image-deps
IMAGE_PKGS := buildah debootstrap
image-deps:
	@missing=$$(for p in $(IMAGE_PKGS); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

image: image-deps
	$(PY) hack/image.py

# The images on the real node: entry points, a P TP1 -> D TP1 PDDeployment through the router
# Service, logs/exec, a liveness restart (marker realnode; never part of `make test`). Reuses a
# running `make cluster-up NODE=real`, else starts and stops its own. Then the e2e tier's
# scenarios on the real node (= `make test-e2e NODE=real`).
.PHONY: test-realnode-e2e
test-realnode-e2e: venv cluster-build-node cluster-node-deps image
	$(PYTEST) tests/e2e -q -m realnode
	PDD_E2E_NODE=real $(PYTEST) tests/e2e -q -m e2e

-include tests/cluster/cluster.mk
cluster-build:
