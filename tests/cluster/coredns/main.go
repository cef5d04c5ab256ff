// Command coredns is the real node's cluster DNS: CoreDNS with only the plugins a Corefile
// for the local cluster uses. Importing each plugin (instead of CoreDNS's main, which links
// all of them, cloud DNS providers included) keeps the build to the kubernetes plugin and a
// few small ones. Its own module, like ../etcd: CoreDNS pins newer shared dependencies than
// the Kubernetes version the control plane is built from.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The plugins' order in a server block, as in CoreDNS's plugin.cfg.
func init() {
	dnsserver.Directives = []string{
		"bind", "ready", "health", "errors", "log", "cache", "kubernetes", "forward",
	}
}

func main() {
	coremain.Run()
}
