# `make train`: set up, train the tiny model.  `make test`: set up, run the whole suite.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: train test bench clean

$(STAMP): requirements.txt requirements-test.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -r requirements-test.txt
	touch $(STAMP)

train: $(STAMP)
	$(VPY) train.py --config=configs/llama_tiny.py --workdir=runs/tiny $(ARGS)

test: $(STAMP)
	$(VPY) -m pytest -q tests $(ARGS)

bench: $(STAMP)
	$(VPY) tools/bench.py --config=configs/llama_tiny.py $(ARGS)

clean:
	rm -rf runs
