// The sandbox ("pause") image's program for the test node: no registry is reachable, so the
// image is built locally by hack/build-node.sh.
module keyshift.invalid/pause

go 1.24
