// Command pause is the whole content of the real node's local image (there is no registry
// to pull from): containerd's sandbox ("pause") image, and the container of the node's
// smoke tests. Static, standard library only, so the image is one file.
//
// Usage:
//
//	pause                 block until SIGTERM or SIGINT (the sandbox's job)
//	pause echo WORDS...   print the words and exit (for kubectl exec)
//	pause cat FILES...    print the files and exit
//	pause serve ADDR MSG  print MSG, then answer every HTTP request with MSG and the host name
//	pause get URL         print the body of an HTTP GET (for Service checks from a pod)
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	args := os.Args[1:]
	if len(args) == 0 {
		wait()
		return
	}
	switch args[0] {
	case "echo":
		fmt.Println(strings.Join(args[1:], " "))
	case "cat":
		for _, name := range args[1:] {
			data, err := os.ReadFile(name)
			if err != nil {
				fail(err)
			}
			os.Stdout.Write(data)
		}
	case "serve":
		if len(args) != 3 {
			usage()
		}
		serve(args[1], args[2])
	case "get":
		if len(args) != 2 {
			usage()
		}
		client := http.Client{Timeout: 10 * time.Second}
		resp, err := client.Get(args[1])
		if err != nil {
			fail(err)
		}
		defer resp.Body.Close()
		if _, err := io.Copy(os.Stdout, resp.Body); err != nil {
			fail(err)
		}
	default:
		usage()
	}
}

func wait() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	<-signals
}

func serve(addr, msg string) {
	host, _ := os.Hostname()
	fmt.Println(msg)
	http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "%s from %s\n", msg, host)
	})
	server := &http.Server{Addr: addr, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		wait()
		server.Close()
	}()
	if err := server.ListenAndServe(); err != nil && err != http.ErrServerClosed {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "pause:", err)
	os.Exit(1)
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: pause [echo WORDS...|cat FILES...|serve ADDR MSG|get URL]")
	os.Exit(2)
}
