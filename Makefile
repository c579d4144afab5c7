# The two set-up commands of the README. Each installs what it needs into ./.venv first.
# MODEL: a model folder for the demo (default: a tiny random-weight model built on the spot).
MODEL ?=
CONFIG ?= configs/default.yaml
# The tiny model, keyed by its builder's hash (the tests build and reuse the same folder).
TINY := .cache/models/tiny-$(shell sha1sum examples/make_tiny_model.py | cut -c1-12)

.PHONY: demo test bench

demo:
	scripts/setup.sh demo
	@if [ -z "$(MODEL)" ]; then .venv/bin/python examples/make_tiny_model.py $(TINY) --preset tiny; fi
	.venv/bin/kvstrata demo --model $(or $(MODEL),$(TINY)) --config $(CONFIG) $(if $(MODEL),,--dtype float32)

# The wheel's own check (scripts/check_wheel.sh: built, installed alone, its commands run) first.
test:
	scripts/setup.sh test
	scripts/check_wheel.sh
	.venv/bin/python -m pytest -n 2 --durations=20

bench:
	scripts/setup.sh test
	.venv/bin/kvstrata bench store
