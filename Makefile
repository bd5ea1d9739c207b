# The two README commands: `make train` (the main job) and `make test` (the suite CI runs).
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 4
ITERS ?= 8
ifdef STEPS   # the old name: ITERS is run_megatron.sh's and run_deepspeed.sh's (Megatron's --train-iters)
$(warning make: STEPS is deprecated; use ITERS=$(STEPS))
ITERS := $(STEPS)
endif

.PHONY: setup train test clean

setup: $(VENV)/.installed

# Re-run when pyproject.toml, constraints.txt or the script are newer than the last install (it says so).
$(VENV)/.installed: pyproject.toml constraints.txt scripts/setup.sh
	@if [ -e $@ ]; then echo "make: $? changed since the last install into $(VENV): re-running setup"; fi
	bash scripts/setup.sh $(VENV)

# DSP on NPROC gloo processes, then the same run on one process, losses side by side.
train: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m dsp_plugin.launch.train_dsp --steps $(ITERS) --out out/dsp.json
	OMP_NUM_THREADS=1 $(PY) -m dsp_plugin.launch.train_dsp --steps $(ITERS) --compare out/dsp.json

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=25

clean:
	rm -rf out .pytest_cache
