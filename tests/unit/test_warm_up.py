"""The install's kernel warm-up (``compressors.segmented.warm_up``, ``kernels.host.warm_up``) covers
every compiled kernel signature that a compressor's selection uses on the host, so that a job on a
fresh install does not compile during training (seconds per missing signature, paid by each
worker at its first sparse step or in the profile's compression sweep).

It runs in a fresh interpreter: signatures that earlier tests compiled in this process would hide
a missing one. So do the checks of when the kernels load: at the construction of a sparse
optimizer, and at the package's import in a worker of a launched job."""
import json
import os
import subprocess
import sys

import pytest

from horovod_safusion import launcher

PROBE = """
import json, numba, numpy as np, torch
from horovod_safusion import sweeps
from horovod_safusion.compressors import available_compressors, make_compressor, segmented
from horovod_safusion.kernels import host

def signatures():
    return {f"{m.__name__}.{name}": sorted(map(str, f.signatures)) for m in (segmented, host)
            for name, f in vars(m).items() if isinstance(f, numba.core.registry.CPUDispatcher)}

segmented.warm_up()
host.warm_up()
before = signatures()
# segments small, exact and sampled (DGC samples segments above 16 times its sample's size)
segments = (40, 3000, 70000)
for dtype in (torch.float32, torch.float64):
    source = torch.randn(sum(segments), dtype=dtype, generator=torch.Generator().manual_seed(0))
    for name in set(available_compressors()) - {"none"}:
        for density in (0.001, 0.03, 0.3):
            sweeps.time_compression(make_compressor(name, density), source, segments, steps=12)
after = signatures()
print(json.dumps({k: sorted(set(v) - set(before.get(k, []))) for k, v in after.items()
                  if set(v) - set(before.get(k, []))}))
"""


def test_warm_up_covers_every_selection_signature():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, 
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert out.returncode == 0, out.stderr
    compiled_in_use = json.loads(out.stdout.strip().splitlines()[-1])
    assert compiled_in_use == {}, f"signatures the warm-up left to the first job: {compiled_in_use}"


#: ends every loading probe: waits for the loading thread, prints the loaded signatures per kernel
LOADED = """
import json, numba
from horovod_safusion.compressors import loading, segmented
from horovod_safusion.kernels import host

loading.wait()
print(json.dumps({f"{m.__name__.rsplit('.', 1)[-1]}.{name}": sorted(map(str, f.signatures)) for m in (segmented, host)
                  for name, f in vars(m).items() if isinstance(f, numba.core.registry.CPUDispatcher)}))
"""

CONSTRUCTED = """
import sys, torch, horovod.torch as hvd
import horovod_safusion as saf

hvd.init()
model = torch.nn.Linear(8, 4)
saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                         compressor=sys.argv[1])
"""


def loaded_after(code: str, *args: str, **env: str) -> dict:
    """The kernels' signatures loaded once ``code`` ran in a fresh interpreter, under ``env`` and no
    launcher's worker count beside it."""
    environ = {k: v for k, v in os.environ.items() if k not in launcher.WORLD_SIZE}
    out = subprocess.run([sys.executable, "-c", code + LOADED, *args], capture_output=True, text=True,
                         env=dict(environ, OMP_NUM_THREADS="1", **env), timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_sparse_optimizer_loads_its_kernels_before_its_first_selection():
    # DistributedOptimizer starts loading the host kernels of its parameters' dtype (float32) at
    # construction, on a thread of its own: the first selection does not load them on the training
    # thread (compressors.loading); a dense one loads none
    loaded = loaded_after(CONSTRUCTED, "dgc")
    for kernel in ("segmented._select", "segmented._kth_largest_at", "host._fill"):
        assert any("float32" in s for s in loaded[kernel]), (kernel, loaded[kernel])
    assert loaded["segmented._select_top"] and loaded["host._by_segment"]
    # not the float64 ones: no kernel loaded for float64 data (its first argument)
    assert not any(s.startswith(("(Array(float64", "(Array(uint64")) for sigs in loaded.values() for s in sigs)
    assert not any(loaded_after(CONSTRUCTED, "none").values())


@pytest.mark.parametrize("env, loads", [
    ({"HOROVOD_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "8"}, True),
    ({"HOROVOD_SIZE": "1"}, False),
    ({}, False),
    ({"HOROVOD_SIZE": "2", "HOROVOD_SAFUSION_LOAD_ON_IMPORT": "0"}, False),
    ({"HOROVOD_SIZE": "2", "HOROVOD_SAFUSION_LOAD_ON_IMPORT": "1"}, True),
], ids=["horovodrun, 2 workers", "mpirun, 8 workers", "one worker", "no launcher", "turned off", "turned on"])
def test_a_worker_of_a_launched_job_loads_the_float32_kernels_when_it_imports_the_package(env, loads):
    # compressors.loading.load_on_import: the loading runs while the script sets itself up, before
    # any optimizer exists; a process started on its own (a test, a tool) loads nothing, nor does a
    # worker whose user turned it off (a job forced dense, which then holds no kernel at all)
    loaded = loaded_after("import horovod_safusion", **env)
    assert any(any("float32" in s for s in sigs) for sigs in loaded.values()) is loads, loaded
    assert not any(s.startswith(("(Array(float64", "(Array(uint64")) for sigs in loaded.values() for s in sigs)


def test_a_worker_of_a_job_forced_dense_that_turned_the_loading_off_holds_no_kernel():
    # the import leaves the loading to the construction, and dense=True loads nothing there
    code = CONSTRUCTED.replace("compressor=sys.argv[1]", "dense=True")
    assert not any(loaded_after(code, HOROVOD_SIZE="2", HOROVOD_SAFUSION_LOAD_ON_IMPORT="0").values())
    assert any(loaded_after(code, HOROVOD_SIZE="2").values())


@pytest.mark.parametrize("value", ["no", "true", ""])
def test_another_value_of_the_switch_is_an_error_that_names_it_and_the_accepted_ones(value):
    from horovod_safusion.compressors import loading
    with pytest.raises(ValueError, match=f"HOROVOD_SAFUSION_LOAD_ON_IMPORT must be one of '0', '1'; got {value!r}"):
        loading.load_on_import({"HOROVOD_SIZE": "2", "HOROVOD_SAFUSION_LOAD_ON_IMPORT": value})
