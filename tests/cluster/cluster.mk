# Local Kubernetes control plane for the integration and e2e tiers (tests/cluster/README.md).
# Included by the top-level Makefile; paths are relative to the repository root.

CLUSTER_DIR := tests/cluster
CLUSTER_BIN := .cache/cluster/bin
KUBE_VERSION := v1.33.13
KWOK_VERSION := v0.7.0
ETCD_VERSION := v3.6.16
LWS_VERSION := v0.7.0
CLUSTER_NODES ?= 4
CLUSTER_GPUS ?= 8
# Static binaries, no local paths or debug info: smaller and faster to link. No VCS stamp:
# the build must not depend on the state of the git checkout around it.
CLUSTER_GO := CGO_ENABLED=0 go build -trimpath -buildvcs=false
KUBE_VERSION_PKGS := k8s.io/component-base/version k8s.io/client-go/pkg/version
KUBE_MINOR := $(word 2,$(subst ., ,$(KUBE_VERSION)))
KUBE_LDFLAGS := -s -w $(foreach p,$(KUBE_VERSION_PKGS),-X $(p).gitVersion=$(KUBE_VERSION) \
	-X $(p).gitMajor=1 -X $(p).gitMinor=$(KUBE_MINOR) -X $(p).gitTreeState=clean)
KWOK_LDFLAGS := -s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$(KWOK_VERSION) \
	-X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$(KUBE_VERSION)
ETCD_LDFLAGS := -s -w
LWS_LDFLAGS := -s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$(LWS_VERSION)

# CLUSTER_LWS=1 (the default of `make cluster-up`) also runs the LeaderWorkerSet controller
# (multi-node instances, docs/lws.md): about 3 s more and 60 MiB. CLUSTER_LWS=0 leaves it out;
# test sessions start it only for the tests that need it (localcluster.ensure_lws).
CLUSTER_LWS ?= 1

# NODE=real adds a real node (kubelet, containerd, runc, CNI, kube-proxy, CoreDNS) next to the
# fake ones: `make cluster-up NODE=real`. It installs Debian packages and changes the host's
# network (bridge, iptables); the e2e tier and the demo start their own (docs/e2e.md).
NODE ?=
CLUSTER_REAL := $(filter real,$(NODE))
ifeq ($(origin NODE),command line)
ifeq ($(CLUSTER_REAL),)
$(error NODE=$(NODE) is not known: leave it out (fake nodes only) or say NODE=real)
endif
endif

.PHONY: cluster-build cluster-up cluster-down cluster-status cluster-build-node cluster-node-deps

cluster-build: $(CLUSTER_BIN)/kube $(CLUSTER_BIN)/kwok $(CLUSTER_BIN)/kwok-pod-stages.yaml \
	$(CLUSTER_BIN)/etcd $(CLUSTER_BIN)/lws

# The real node's binaries: kubelet and kube-proxy (one multi-call binary `node`, same module
# and version as `kube`), `pause`, the static program in the node's only local image, and
# CoreDNS (its own module, like etcd: it pins newer shared dependencies).
COREDNS_VERSION := v1.12.2
cluster-build-node: cluster-build $(CLUSTER_BIN)/node $(CLUSTER_BIN)/pause $(CLUSTER_BIN)/coredns

# containerd, runc, the CNI plugins, iptables, conntrack and iproute2 from Debian. Idempotent:
# installs only what is missing. containerd is not started as a service (the cluster starts its
# own).
CLUSTER_NODE_PKGS := containerd runc containernetworking-plugins iptables conntrack iproute2
cluster-node-deps:
	@missing=$$(for p in $(CLUSTER_NODE_PKGS); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# The versions above only feed ldflags; go.mod pins what is built. Refuse to build if they differ.
cluster-check-pins = grep -Eq '^(require)?\s*$(1) $(2)( |$$)' $(3) || \
	{ echo "cluster.mk pins $(1) $(2) but $(3) does not"; exit 1; }

# Each binary is written beside its final name and renamed, so an interrupted build never
# leaves a truncated binary that make would take as up to date.
$(CLUSTER_BIN)/kube: $(CLUSTER_DIR)/cluster.mk $(CLUSTER_DIR)/go.mod $(CLUSTER_DIR)/go.sum $(CLUSTER_DIR)/cmd/kube/main.go
	@$(call cluster-check-pins,k8s.io/kubernetes,$(KUBE_VERSION),$(CLUSTER_DIR)/go.mod)
	@mkdir -p $(@D)
	cd $(CLUSTER_DIR) && $(CLUSTER_GO) -ldflags '$(KUBE_LDFLAGS)' -o $(CURDIR)/$@.tmp ./cmd/kube
	@mv $@.tmp $@

$(CLUSTER_BIN)/node: $(CLUSTER_DIR)/cluster.mk $(CLUSTER_DIR)/go.mod $(CLUSTER_DIR)/go.sum $(CLUSTER_DIR)/cmd/node/main.go
	@$(call cluster-check-pins,k8s.io/kubernetes,$(KUBE_VERSION),$(CLUSTER_DIR)/go.mod)
	@mkdir -p $(@D)
	cd $(CLUSTER_DIR) && $(CLUSTER_GO) -ldflags '$(KUBE_LDFLAGS)' -o $(CURDIR)/$@.tmp ./cmd/node
	@mv $@.tmp $@

$(CLUSTER_BIN)/pause: $(CLUSTER_DIR)/cmd/pause/main.go
	@mkdir -p $(@D)
	cd $(CLUSTER_DIR) && $(CLUSTER_GO) -ldflags '-s -w' -o $(CURDIR)/$@.tmp ./cmd/pause
	@mv $@.tmp $@

$(CLUSTER_BIN)/coredns: $(CLUSTER_DIR)/cluster.mk $(CLUSTER_DIR)/coredns/go.mod $(CLUSTER_DIR)/coredns/go.sum $(CLUSTER_DIR)/coredns/main.go
	@$(call cluster-check-pins,github.com/coredns/coredns,$(COREDNS_VERSION),$(CLUSTER_DIR)/coredns/go.mod)
	@mkdir -p $(@D)
	cd $(CLUSTER_DIR)/coredns && $(CLUSTER_GO) -ldflags '-s -w' -o $(CURDIR)/$@.tmp .
	@mv $@.tmp $@

$(CLUSTER_BIN)/kwok: $(CLUSTER_DIR)/cluster.mk $(CLUSTER_DIR)/go.mod $(CLUSTER_DIR)/go.sum
	@$(call cluster-check-pins,sigs.k8s.io/kwok,$(KWOK_VERSION),$(CLUSTER_DIR)/go.mod)
	@mkdir -p $(@D)
	cd $(CLUSTER_DIR) && $(CLUSTER_GO) -ldflags '$(KWOK_LDFLAGS)' -o $(CURDIR)/$@.tmp sigs.k8s.io/kwok/cmd/kwok
	@mv $@.tmp $@

# kwok's own fast pod stages (Running at once, Jobs' pods Succeeded), from the module that built
# it; `localcluster.py` adds its own pod-delete stages beside them.
$(CLUSTER_BIN)/kwok-pod-stages.yaml: $(CLUSTER_DIR)/cluster.mk $(CLUSTER_DIR)/go.mod $(CLUSTER_DIR)/go.sum
	@mkdir -p $(@D)
	dir="$$(cd $(CLUSTER_DIR) && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage/pod/fast"; \
		{ cat "$$dir/pod-ready.yaml"; echo '---'; cat "$$dir/pod-complete.yaml"; } > $@.tmp
	@chmod 644 $@.tmp && mv $@.tmp $@

$(CLUSTER_BIN)/etcd: $(CLUSTER_DIR)/cluster.mk $(CLUSTER_DIR)/etcd/go.mod $(CLUSTER_DIR)/etcd/go.sum $(CLUSTER_DIR)/etcd/main.go
	@$(call cluster-check-pins,go.etcd.io/etcd/server/v3,$(ETCD_VERSION),$(CLUSTER_DIR)/etcd/go.mod)
	@mkdir -p $(@D)
	cd $(CLUSTER_DIR)/etcd && $(CLUSTER_GO) -ldflags '$(ETCD_LDFLAGS)' -o $(CURDIR)/$@.tmp .
	@mv $@.tmp $@

# The LeaderWorkerSet controller (multi-node instances, docs/lws.md): its own module, like etcd
# (LWS pins its own controller-runtime and client-go). Its CRD, 1.2 MB of YAML in the module,
# is copied next to the binary for `localcluster.py` (started by cluster-up unless CLUSTER_LWS=0).
$(CLUSTER_BIN)/lws: $(CLUSTER_DIR)/cluster.mk $(CLUSTER_DIR)/lws/go.mod $(CLUSTER_DIR)/lws/go.sum
	@$(call cluster-check-pins,sigs.k8s.io/lws,$(LWS_VERSION),$(CLUSTER_DIR)/lws/go.mod)
	@mkdir -p $(@D)
	cd $(CLUSTER_DIR)/lws && $(CLUSTER_GO) -ldflags '$(LWS_LDFLAGS)' -o $(CURDIR)/$@.tmp sigs.k8s.io/lws/cmd
	cp "$$(cd $(CLUSTER_DIR)/lws && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" $@-crd.yaml.tmp
	@chmod 644 $@-crd.yaml.tmp && mv $@-crd.yaml.tmp $@-crd.yaml
	@mv $@.tmp $@

# The venv brings `cryptography` for the certificates; the binaries come from cluster-build.
# A second cluster-up while one runs reports it and reuses it.
cluster-up: venv cluster-build $(if $(CLUSTER_REAL),cluster-build-node cluster-node-deps)
	$(VPY) $(CLUSTER_DIR)/localcluster.py up --nodes $(CLUSTER_NODES) --gpus $(CLUSTER_GPUS) \
		$(if $(CLUSTER_REAL),--real-node) $(if $(filter 1,$(CLUSTER_LWS)),--lws)

# The real node's own tests (marker realnode; `make test-integration` runs them too). They reuse a running
# `make cluster-up NODE=real` or start and stop their own cluster in .cache/cluster/realnode-test.
.PHONY: test-realnode
test-realnode: venv cluster-build-node cluster-node-deps
	$(PYTEST) tests/integration -q -m realnode

# Needs no venv: stopping must work even when the venv is broken.
cluster-down:
	$(PY) $(CLUSTER_DIR)/localcluster.py down

cluster-status:
	$(PY) $(CLUSTER_DIR)/localcluster.py status

# Helm, only for the chart's tests (tests/integration/test_helm_chart.py builds it through this
# target when it is missing): `go install` of the module at a pinned version, no cgo, into a
# scratch GOBIN of its own (two builds at once do not collide), then renamed like the binaries
# above. Several CPU-minutes on 2 cores.
HELM_VERSION := v3.18.6
# The Kubernetes version `helm template` and `helm lint` assume offline: the control plane's.
HELM_KUBE := -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$(KUBE_MINOR) \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$(KUBE_MINOR)
HELM_LDFLAGS := -s -w -X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) \
	-X helm.sh/helm/v3/internal/version.gitTreeState=clean $(HELM_KUBE)

.PHONY: helm
helm: $(CLUSTER_BIN)/helm

$(CLUSTER_BIN)/helm: $(CLUSTER_DIR)/cluster.mk
	@mkdir -p $(@D)
	tmp=$$(mktemp -d $(CURDIR)/$(@D)/.helm-XXXXXX) && \
	GOBIN=$$tmp CGO_ENABLED=0 go install -trimpath -buildvcs=false \
		-ldflags '$(HELM_LDFLAGS)' helm.sh/helm/v3/cmd/helm@$(HELM_VERSION) && \
	mv $$tmp/helm $@ && rmdir $$tmp
