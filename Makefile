# The README's two commands.  Everything they do lives in .ci/ so that CI
# runs exactly what a user runs.
.PHONY: demo check

demo:
	@.ci/deps.sh
	@.ci/build.sh build
	@.ci/demo.sh build

check:
	@.ci/deps.sh
	@.ci/build.sh build
	@.ci/test.sh build
	@CC=clang .ci/build.sh build-fuzz -Dfuzz=true -Dtests=true
	@.ci/test.sh build-fuzz --suite fuzz
