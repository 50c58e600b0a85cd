# Two commands start everything on a fresh machine with Python >= 3.11, pip and make:
#   make demo   set up .venv and run `moremoe demo` (into runs/demo, replacing the last one)
#   make test   set up .venv and run the whole test suite (over the cores: JOBS=1 for one
#               process)
# Both install the exact versions of requirements/lock-cpu.txt (scripts/install.sh locked).
# And what CI runs after them:
#   make test-cpus    the numerics-sensitive tests again as another CPU would run them: ATen's
#                     default and AVX2 kernels, one and two threads
#   make test-latest  the suite in a fresh .venv-latest with the newest versions pyproject.toml
#                     allows: what a user installing today gets
#   make test-lowest  the suite in a fresh .venv-lowest with every dependency at its lower bound
#   make lock         regenerate requirements/lock-cpu.txt from the newest allowed versions
#   make test-demo    the demo's conclusion on 3 seeds at 1 and 2 threads (13-21 minutes)
#   make test-gpu     on a machine with a CUDA GPU and torch installed (no .venv): every test
#                     marked gpu that needs one GPU: GPU_JOBS (4) processes share the GPU, then
#                     the gpu_serial tests alone (timings, tens of GB) in a second pytest run
#   make test-gpu-multi  the tests that need 2 or 4 GPUs (skipped with fewer), in one run; each
#                     launches processes, bounded, and kills them (tests/procs.py).
#   make test-gpu-kernels  every kernel test (tests/kernels, marked gpu or not) on the GPU:
#                     the interpreter's odd sizes and edge cases compiled for the device,
#                     over GPU_JOBS processes (compiling is most of it), then the gpu_serial
#                     ones alone; GPU_PYTHON picks the interpreter (default python3)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# the CPU suites spread their tests over the machine's cores, at most 4 processes
# (pytest-xdist, each test to the first free worker); JOBS=1 runs them in one process
JOBS ?= auto
XDIST = $(if $(filter 1,$(JOBS)),,-n $(JOBS) --maxprocesses 4 --dist worksteal)
LOCK := requirements/lock-cpu.txt

.PHONY: demo test test-cpus test-demo test-gpu test-gpu-multi test-gpu-kernels test-latest test-lowest lock setup clean
GPU_PYTHON ?= python3

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK) scripts/install.sh
	$(PYTHON) -m venv $(VENV)
	sh scripts/install.sh $(BIN)/python locked
	touch $@

# the demo's own folder: running it again replaces the last demo (--force)
demo: setup
	$(BIN)/moremoe demo --out runs/demo --force

test: setup
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

GPU_PYTEST = PYTHONPATH=src:tests $(GPU_PYTHON) -m pytest -v -p no:cacheprovider --durations=10
# the GPU tests spread over GPU_JOBS processes on the one GPU (their kernels compile on as
# many cores: on a fresh machine compiling is most of the time), file by file; then the
# tests marked gpu_serial (timings, tens of GB) one at a time; GPU_JOBS=0: all serially
GPU_JOBS ?= 4
GPU_XDIST = $(if $(filter 0,$(GPU_JOBS)),,-n $(GPU_JOBS) --dist loadfile)
test-gpu:
	$(GPU_PYTEST) -m "gpu and not multi_gpu and not gpu_serial" $(GPU_XDIST) $(PYTEST_ARGS) tests
	$(GPU_PYTEST) -m "gpu and not multi_gpu and gpu_serial" $(PYTEST_ARGS) tests

test-gpu-multi:
	$(GPU_PYTEST) -m multi_gpu $(PYTEST_ARGS) tests

test-gpu-kernels:
	$(GPU_PYTEST) -m "not multi_gpu and not gpu_serial" $(GPU_XDIST) $(PYTEST_ARGS) tests/kernels
	$(GPU_PYTEST) -m "not multi_gpu and gpu_serial" $(PYTEST_ARGS) tests/kernels

test-demo: setup
	$(BIN)/python -m pytest -q -m demo tests/test_demo_conclusion.py

NUMERICS = tests/kernels tests/ops tests/nn tests/model tests/hf tests/training/test_checkpoint.py \
           tests/training/test_lm_training.py tests/test_pipeline.py
# the same floats on other CPU kernels; timings there measure nothing a user runs
CPUS_MARKS = -m "not gpu and not demo and not timing"
test-cpus: setup
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(XDIST) $(CPUS_MARKS) $(NUMERICS)
	ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q $(XDIST) $(CPUS_MARKS) $(NUMERICS)

# a fresh environment each time: newest means newest on the day it runs
test-latest test-lowest: test-%:
	rm -rf $(VENV)-$*
	$(PYTHON) -m venv $(VENV)-$*
	sh scripts/install.sh $(VENV)-$*/bin/python $*
	$(VENV)-$*/bin/python -m pytest $(XDIST) $(PYTEST_ARGS)
	rm -rf $(VENV)-$*    # 2.9 GB; kept when the suite fails (make stops before this line)

lock:
	rm -rf $(VENV)-lock
	$(PYTHON) -m venv $(VENV)-lock
	sh scripts/install.sh $(VENV)-lock/bin/python latest test,text,eval
	sh scripts/write_lock.sh $(VENV)-lock/bin/python > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(VENV)-lock
	@echo "wrote $(LOCK): run make test with it before committing"

clean:
	rm -rf $(VENV) $(VENV)-latest $(VENV)-lowest $(VENV)-lock runs .pytest_cache
