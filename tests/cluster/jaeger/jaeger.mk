# Jaeger for the integration tier (tests/integration/test_traces.py; docs/tracing.md): the
# all-in-one `jaeger` command of github.com/jaegertracing/jaeger, built from its module into the
# cluster's binary cache like the control plane's (tests/cluster/cluster.mk). Included by the
# top-level Makefile; a file of its own so that changing it never rebuilds the control plane.
# Cold: about 7 CPU-minutes (4 min on an idle 2-core machine, module download 30 s); warm: nothing.

JAEGER_DIR := tests/cluster/jaeger
JAEGER_BIN := .cache/cluster/bin/jaeger
JAEGER_VERSION := v1.75.0
JAEGER_LDFLAGS := -s -w -X github.com/jaegertracing/jaeger/internal/version.latestVersion=$(JAEGER_VERSION)

.PHONY: jaeger
jaeger: $(JAEGER_BIN)

# go.mod pins what is built; refuse to build if it names another version than the one above.
# Written beside its final name and renamed, like the control plane's binaries.
$(JAEGER_BIN): $(JAEGER_DIR)/jaeger.mk $(JAEGER_DIR)/go.mod $(JAEGER_DIR)/go.sum
	@grep -Eq '^\s*github.com/jaegertracing/jaeger $(JAEGER_VERSION)( |$$)' $(JAEGER_DIR)/go.mod || \
		{ echo "jaeger.mk pins $(JAEGER_VERSION) but $(JAEGER_DIR)/go.mod does not"; exit 1; }
	@mkdir -p $(@D)
	cd $(JAEGER_DIR) && CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags '$(JAEGER_LDFLAGS)' \
		-o $(CURDIR)/$@.tmp github.com/jaegertracing/jaeger/cmd/jaeger
	@mv $@.tmp $@
