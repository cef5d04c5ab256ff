// Command kube is a multi-call binary holding kube-apiserver, kube-controller-manager and
// kube-scheduler. One binary lets the three share compile and link work, which keeps the
// cold build of the local test control plane within CI's budget.
//
// Usage: kube apiserver|controller-manager|scheduler [flags]
// (a link named kube-apiserver, kube-controller-manager or kube-scheduler works too).
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	kcm "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var commands = map[string]func() *cobra.Command{
	"apiserver":          apiserver.NewAPIServerCommand,
	"controller-manager": kcm.NewControllerManagerCommand,
	"scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
}

func main() {
	name := strings.TrimPrefix(filepath.Base(os.Args[0]), "kube-")
	args := os.Args[1:]
	if _, ok := commands[name]; !ok {
		if len(args) == 0 {
			usage()
		}
		name, args = args[0], args[1:]
	}
	newCommand, ok := commands[name]
	if !ok {
		usage()
	}
	command := newCommand()
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: kube apiserver|controller-manager|scheduler [flags]")
	os.Exit(2)
}
