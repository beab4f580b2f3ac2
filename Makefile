# horovod-safusion — the two commands a user needs:
#   make demo   install if needed, then train the digits CNN with Horovod and with SAFusion (2 workers),
#               as root on an emulated 100 Mbit/s link
#   make test   install if needed, then the whole test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NP     ?= 2

.PHONY: install demo test unit multiproc doctor bench-throughput bench-planners bench-peers bench-convergence bench-tta \
	bench-scale bench-memory bench-communicators bench-compressors gpu-check cluster-up cluster-down clean

install: $(STAMP)

$(STAMP): scripts/install.sh setup.py
	bash scripts/install.sh
	touch $@

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) examples/demo.py --np $(NP)

test: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest tests

# every benchmark's claim, command and last run: docs/benchmarks.md
doctor: $(STAMP)
	$(PY) -m horovod_safusion doctor

RATES ?=
bench-throughput: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) benchmarks/bench_throughput.py --np $(NP) \
		$(if $(RATES),--rates $(RATES))

LINKS ?= loopback 1gbit 200mbit
bench-peers: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) benchmarks/bench_peers.py --np $(NP) --links $(LINKS)

# ours, Horovod and DDP + PowerSGD at 2, 4 and 8 hosts of a cluster on one machine (root), 1 Gbit/s per host
bench-scale: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) benchmarks/bench_scale.py
	$(PY) benchmarks/bench_scale_out.py

# time to accuracy of every scheme at 2, 4 and 8 hosts of a cluster on one machine, 100 Mbit/s and 1 Gbit/s
# per host (root), one seed: an hour or more on a 2-core machine (docs/benchmarks.md)
bench-tta: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) benchmarks/bench_time_to_accuracy.py

bench-convergence: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" horovodrun -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) benchmarks/bench_convergence.py

bench-memory: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) benchmarks/bench_memory.py --np $(NP)

bench-communicators: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" horovodrun -np 3 -H localhost:3 --gloo \
		$(PY) benchmarks/bench_communicators.py

bench-compressors: $(STAMP)
	$(PY) benchmarks/bench_compressors.py

bench-planners: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" horovodrun -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) benchmarks/bench_planners.py

# a cluster on one machine (root): HOSTS network namespaces with their own RATE links and sshd
HOSTS ?= 4
RATE  ?= 1gbit
# on a machine with a CUDA GPU (no install, no Horovod needed): tests/gpu, then the kernels' benchmark
gpu-check:
	bash benchmarks/gpu_check.sh

cluster-up: $(STAMP)
	bash scripts/cluster.sh up $(HOSTS) $(RATE)

cluster-down:
	bash scripts/cluster.sh down

unit: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest tests/unit

multiproc: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest tests/multiproc

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
