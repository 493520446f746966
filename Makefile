# The README's two commands.  Everything they do lives in .ci/ so that CI
# runs exactly what a user runs.  `make demo NODES=2` runs the demo on two
# daemons (a job across nodes, over loopback TCP); ARGS go to shardport-demo
# (`make demo ARGS="--scale 4 --ranks 8"`, `ARGS=--help` lists them).
.PHONY: demo check

NODES ?= 1
ARGS ?=

demo:
	@.ci/deps.sh
	@.ci/build.sh build
	@NODES=$(NODES) .ci/demo.sh build $(ARGS)

check:
	@.ci/deps.sh
	@.ci/build.sh build
	@.ci/test.sh build
	@CC=clang .ci/build.sh build-fuzz -Dfuzz=true -Dtests=true
	@.ci/test.sh build-fuzz --suite fuzz
