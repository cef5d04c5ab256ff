// Command etcd wraps etcdmain so etcd can be built from the Go module proxy: the
// upstream main lives in a module that cannot be installed on its own.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
