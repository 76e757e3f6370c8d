# Everything runs from a local virtual environment that these targets create.
VENV    ?= .venv
PY      := $(VENV)/bin/python
SBPC    := $(VENV)/bin/sbpc
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-sweep bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	@mkdir -p out
	$(SBPC) check examples/gpt.py --mesh 2x2x2 --microbatches 4 --config examples/gpt.megatron.toml
	$(SBPC) compile examples/gpt.py --mesh 2x2x2 --microbatches 4 --config examples/gpt.megatron.toml -o out/gpt.2x2x2.json --trace out/gpt.2x2x2.sim.json
	$(SBPC) inspect out/gpt.2x2x2.json --schedule
	$(SBPC) run out/gpt.2x2x2.json --data stdlib --steps 30 --log-interval 5 --trace out/gpt.2x2x2.trace.json
	$(SBPC) check examples/hf_gpt2.py --mesh 2x2 --config examples/hf_gpt2.megatron.toml --steps 2
	$(SBPC) compile examples/gpt.py --mesh 1x2 --config examples/gpt.megatron.toml --set hidden=1024 --set heads=8 --set vocab=8192 --set seq=128 -o out/gpt.tp2.json
	$(SBPC) inspect out/gpt.tp2.json --collectives | grep -E 'fwd|bwd|^//'
	$(SBPC) explain out/gpt.tp2.json h.0.attn.c_attn.weight

# One pytest worker per core (pytest-xdist); a test file stays on one worker, so its module
# fixtures (the fuzz corpus, the compiled plans) are built once. Then the tests that assert a
# time bound (marker `timing`), alone: a second worker on the cores inflates even CPU time.
test: setup
	$(PY) -m pytest -q -n auto --dist loadfile
	$(PY) -m pytest -q -m timing

# The whole op-database sweep (every OpInfo sample, every signature): deselected from `make test` for time.
test-sweep: setup
	$(PY) -m pytest -q -m sweep tests/test_opdb.py

# Every side-by-side bench, ending with one `ratio=` line per script (bench/run_all.sh).
bench: setup
	PYTHON=$(PY) sh bench/run_all.sh

clean:
	rm -rf $(VENV) out .pytest_cache
