// Command node is a multi-call binary holding the kubelet and kube-proxy of the local
// cluster's real node (`make cluster-up NODE=real`). It is a binary of its own, not part of
// `kube`, so the default control plane (fake nodes only) never pays for compiling the kubelet;
// the two node components share one link.
//
// Usage: node kubelet|proxy|cri-cleanup [flags] (a link named kubelet or kube-proxy works too).
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

var commands = map[string]func() *cobra.Command{
	"kubelet":     kubelet.NewKubeletCommand,
	"proxy":       proxy.NewProxyCommand,
	"cri-cleanup": newCRICleanupCommand,
}

// newCRICleanupCommand stops and removes every pod sandbox of a CRI runtime. Stopping a
// sandbox through CRI is what runs the CNI DEL (veth, IP lease, portmap and masquerade
// rules) and removes its network namespace; killing containerd and its shims would leave
// all of those behind. There is no crictl package on these machines, so the node binary
// carries the few calls `cluster-down` needs.
func newCRICleanupCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "cri-cleanup unix:///path/to/containerd.sock",
		Short: "stop and remove every pod sandbox of a CRI runtime",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			conn, err := grpc.NewClient(args[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return err
			}
			defer conn.Close()
			client := runtimeapi.NewRuntimeServiceClient(conn)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			resp, err := client.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
			if err != nil {
				return fmt.Errorf("listing pod sandboxes at %s: %w", args[0], err)
			}
			var failed []string
			for _, sandbox := range resp.Items {
				id := sandbox.Id
				if _, err := client.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
					failed = append(failed, fmt.Sprintf("stop %s: %v", id, err))
					continue
				}
				if _, err := client.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id}); err != nil {
					failed = append(failed, fmt.Sprintf("remove %s: %v", id, err))
				}
			}
			fmt.Printf("removed %d of %d pod sandboxes\n", len(resp.Items)-len(failed), len(resp.Items))
			if len(failed) > 0 {
				return fmt.Errorf("%s", strings.Join(failed, "; "))
			}
			return nil
		},
	}
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
	fmt.Fprintln(os.Stderr, "usage: node kubelet|proxy|cri-cleanup [flags]")
	os.Exit(2)
}
