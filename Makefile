# pdd — one entry point for set-up, tests, demo and benchmarks.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PYTEST := $(VPY) -m pytest
export PYTHONUNBUFFERED := 1
# The e2e tier and the demo run their pods as containers on a real node (kubelet, containerd,
# runc, CNI, kube-proxy, CoreDNS) from the images of `make image`: docs/e2e.md.
REAL_NODE_DEPS := cluster-build-node cluster-node-deps image

.PHONY: venv test test-vllm test-unit test-integration test-dataplane test-e2e lint demo bench crd cluster-up cluster-down

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

test-unit: venv
	$(PYTEST) tests/unit -q

test-dataplane: venv
	$(PYTEST) tests/dataplane -q -m dataplane

# With the real node's own tests (marker realnode: its kubelet, containers, Services, DNS and
# a clean `cluster-down`), in a cluster of their own beside the tier's shared one.
test-integration: venv cluster-build cluster-build-node cluster-node-deps jaeger
	$(PYTEST) tests/integration -q -m 'integration or realnode'

test-e2e: venv cluster-build $(REAL_NODE_DEPS)
	$(PYTEST) tests/e2e -q -m e2e

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
	$(VENV)/bin/pdd crd --kind PDDRoleScale > crds/serving.pdd.dev_pddrolescales.yaml
	cp crds/serving.pdd.dev_pddrolescales.yaml manifests/base/crd-pddrolescales.yaml
	cp crds/serving.pdd.dev_pddrolescales.yaml charts/pdd/crds/

demo: venv cluster-build $(REAL_NODE_DEPS)
	$(VPY) hack/demo.py

bench: venv
	@for b in bench/*.py; do echo "== $$b"; $(VPY) $$b || exit 1; done

# The images (Dockerfile targets sidecar and operator) built with buildah against a Debian
# bookworm base made with debootstrap (no Docker engine or registry needed), then imported into
# the real node's containerd when one runs (the e2e tier and the demo import them when the node
# lacks them). Caches in .cache/image.
# Needs root; docs/e2e.md has the figures.
.PHONY: image image-deps
IMAGE_PKGS := buildah debootstrap runc
image-deps:
	@missing=$$(for p in $(IMAGE_PKGS); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

image: image-deps
	$(PY) hack/image.py

-include tests/cluster/cluster.mk
-include tests/cluster/jaeger/jaeger.mk
cluster-build:
