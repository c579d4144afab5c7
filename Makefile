# The two set-up commands of the README. Each installs what it needs into ./.venv first.
.PHONY: demo test bench

demo:
	scripts/setup.sh core
	.venv/bin/kvstrata demo

test:
	scripts/setup.sh test
	.venv/bin/python -m pytest

bench:
	scripts/setup.sh test
	.venv/bin/kvstrata bench store
