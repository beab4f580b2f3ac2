"""Run under ``horovodrun`` by ``test_install.py``: a copy of this file, from a directory outside
the repository, with the Python of a fresh environment into which ``pip install .`` put the
package. Trains a small classifier with ``horovod_safusion.DistributedOptimizer`` on data every
rank makes itself and writes ``rank{r}.json`` to ``sys.argv[1]``.
"""
import json
import os
import sys
import sysconfig
import time
import traceback
import zlib

t0 = time.perf_counter()
import torch  # noqa: E402
from torch import nn  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_safusion as saf  # noqa: E402

STEPS = 30
BATCH = 32

hvd.init()
record = {"rank": hvd.rank(), "size": hvd.size(), "cwd": os.getcwd(), "file": saf.__file__,
          "purelib": sysconfig.get_paths()["purelib"], "prefix": sys.prefix, "sys_path": sys.path,
          "import_s": time.perf_counter() - t0}
try:
    # the same data and the same initial model on every rank; each rank trains on its own share
    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = (x @ torch.randn(32, 4)).argmax(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    loss_fn = nn.CrossEntropyLoss()
    mine_x, mine_y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    opt = saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), density=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with torch.no_grad():
        record["loss_before"] = float(loss_fn(model(x), y))
    step_s = []
    for step in range(STEPS):
        t = time.perf_counter()
        at = (step * BATCH) % (len(mine_x) - BATCH)
        opt.zero_grad()
        loss_fn(model(mine_x[at:at + BATCH]), mine_y[at:at + BATCH]).backward()
        opt.step()
        step_s.append(time.perf_counter() - t)
    record["step_s"] = step_s
    with torch.no_grad():
        record["loss_after"] = float(loss_fn(model(x), y))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    record["checksums"] = hvd.allgather_object(zlib.crc32(flat.numpy().tobytes()))
    record["total_s"] = time.perf_counter() - t0
except Exception:  # noqa: BLE001 — the test shows it
    record["exception"] = traceback.format_exc()
with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.json"), "w") as f:
    json.dump(record, f)
