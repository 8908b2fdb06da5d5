# `make test` and `make demo` do all the set-up: they create .venv when it is missing and
# install qkv (editable) with its test extras under constraints.txt.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.qkv-installed

.PHONY: test demo install clean sweep-hf docs gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The documentation site, offline, in strict mode (a broken link or reference fails), into site/.
DOCS_STAMP := $(VENV)/.qkv-docs-installed

$(DOCS_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The suite runs in a random order (pytest-randomly, in the test extras), so a test that leans on
# another's leftovers fails here rather than on someone's fresh clone. The seed is printed
# first; `make test SEED=<seed>` replays that order.
ifeq ($(origin SEED), undefined)
SEED := $(shell $(PYTHON) -c 'import random; print(random.randrange(2**32))')
endif

test: $(STAMP)
	@echo "Using --randomly-seed=$(SEED) (make test SEED=$(SEED) replays this order)"
	$(PY) -m pytest -q -p randomly --randomly-seed=$(SEED)

# The explain walkthrough, then about a minute of training `reverse` on CPU: it prints the
# exact-match accuracy and saves the cross-attention map (an anti-diagonal).
demo: $(STAMP)
	mkdir -p out/demo
	$(VENV)/bin/qkv explain --example seed004 --plot out/demo/attention_seed004.png
	rm -rf out/demo/reverse
	$(VENV)/bin/qkv train reverse --out out/demo/reverse
	@echo "cross-attention map: out/demo/reverse/cross_attention.png"

# Every architecture of the installed transformers built tiny, eager against
# attn_implementation="qkv": padding, weights, backward, generate (about 35 minutes on 2 cores;
# not part of `make test`; tests/test_hf_sweep.py runs a fixed subset).
sweep-hf: $(STAMP)
	$(PY) benchmarks/hf_sweep.py --out benchmarks/results/hf_sweep.json

# On a lent GPU machine (issue 39): the CUDA tests and the core files on CUDA, then the public
# API against Flex, cuDNN and flash into $(GPU_OUT)/gpu_api.json and deformable attention's
# Triton kernels against grid_sample into $(GPU_OUT)/gpu_deformable.json (about 9 minutes; the
# machine's own python and torch). `make gpu-check DRY=1` checks it here, without a GPU.
GPU_OUT ?= benchmarks/results
gpu-check:
	bash benchmarks/gpu_check.sh $(if $(DRY),--dry-run) $(GPU_OUT)

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache
