// Command pause holds a pod sandbox's namespaces open: it sleeps until SIGTERM or SIGINT and
// then exits 0, like the upstream pause container. Built static (CGO_ENABLED=0) by
// hack/build-node.sh into the test node's sandbox image.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
