# Everything runs from a local virtual environment that these targets create.
VENV    ?= .venv
PY      := $(VENV)/bin/python
SBPC    := $(VENV)/bin/sbpc
STAMP   := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	@mkdir -p out
	$(SBPC) check examples/gpt.py --mesh 1 --steps 3
	$(SBPC) check examples/hf_gpt2.py --mesh 1 --steps 3
	$(SBPC) compile examples/gpt.py --mesh 1 -o out/gpt.plan.json
	$(SBPC) run out/gpt.plan.json --steps 5 --save out/gpt.weights.safetensors
	$(SBPC) inspect out/gpt.plan.json | grep -m 6 -E 'sbpc.attention|addmm'

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/compile_bench.py
	$(PY) bench/run_vs_eager.py

clean:
	rm -rf $(VENV) out .pytest_cache
