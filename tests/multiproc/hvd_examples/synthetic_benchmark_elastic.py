r"""Horovod's elastic PyTorch synthetic benchmark
(examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py), in the same shape and with the
same flags, with one line that picks the distributed optimizer (``--optimizer horovod`` or
``--optimizer safusion``; the same arguments either way) and a fault to inject.

Differences from Horovod's script: a torchvision-shaped ResNet-18 from ``resnet.py`` with
``--width`` / ``--image-size``; one intra-op thread; a resumed iteration runs only the batches not
committed before the reset (Horovod's reruns the whole iteration, and its ``state.iter = x`` reruns a
finished one), so that the number of batches done is exact; and:

* ``--fail-rank R --fail-at-batch B [--fail-mode exit|raise]``: the worker that is rank R when
  batch B (counted from 0 over warm-up and benchmark, as committed state) starts fails once —
  ``exit`` ends the process (``os._exit(1)``: the survivors' collectives fail with
  ``HorovodInternalError``, the driver blacklists that host and may bring it back after
  ``--blacklist-cooldown-range``), ``raise`` raises ``HorovodInternalError`` in the worker (it
  restores its last commit and re-joins; the others' collectives fail and they do the same). A
  marker file in ``--work-dir`` makes it fail only once across resets and restarts. A dead process
  is only recovered from when another host is left: with one host (``localhost:2``) the driver
  blacklists it and stops the job, so name the machine twice (``localhost:1`` and ``127.0.0.1:1``).
* ``--safusion-kwargs JSON``: keyword options for ``horovod_safusion.DistributedOptimizer``.
* ``--wait-for-size N``: before each benchmark iteration, hold (calling ``state.check_host_updates()``)
  until N workers are in the job, so that a replacement worker joins deterministically.
* ``--json PATH``: each worker still running at the end writes its result (``{rank}`` in PATH is
  replaced by its final rank): rank, size, batches done, resets seen, whether the parameters are
  finite, their checksum, and the optimizer's total error-feedback residual if it has one.
* every worker prints to stderr why it resets (the exception) and the size after each reset;
  ``--dump-stacks-after S`` writes all threads' Python stacks to ``<work-dir>/stacks.<pid>.txt`` if
  the worker is still running after S seconds (for hangs).

    printf '#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n' > discover.sh; chmod +x discover.sh
    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script ./discover.sh \
        --blacklist-cooldown-range 1 2 --network-interface lo --gloo \
        python synthetic_benchmark_elastic.py --optimizer safusion --width 8 --image-size 32 \
        --batch-size 8 --fail-rank 1 --fail-at-batch 5 --wait-for-size 2 --work-dir "$(mktemp -d)"
"""
import argparse
import faulthandler
import functools
import json
import math
import os
import sys
import time
import timeit

import numpy as np
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

import resnet as models

# Benchmark settings
parser = argparse.ArgumentParser(description='PyTorch Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')

parser.add_argument('--model', type=str, default='resnet18', choices=['resnet18'],
                    help='model to benchmark')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size')

parser.add_argument('--num-warmup-batches', type=int, default=10,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=10,
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=10,
                    help='number of benchmark iterations')
parser.add_argument('--num-batches-per-commit', type=int, default=1,
                    help='number of batches per commit of the elastic state object')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')

# Not in Horovod's script: CPU-sized model and data, the optimizer switch, a fault, a result file.
parser.add_argument('--width', type=int, default=64,
                    help='channels of the first ResNet stage (torchvision: 64)')
parser.add_argument('--image-size', type=int, default=224,
                    help='height and width of the synthetic images')
parser.add_argument('--optimizer', choices=['horovod', 'safusion'], default='safusion',
                    help='hvd.DistributedOptimizer or horovod_safusion.DistributedOptimizer')
parser.add_argument('--safusion-kwargs', type=json.loads, default={},
                    help='horovod_safusion options as JSON, e.g. \'{"communicator": "spardl", "dense": false}\'')
parser.add_argument('--fail-rank', type=int, default=None,
                    help='the rank that fails once')
parser.add_argument('--fail-at-batch', type=int, default=0,
                    help='fail when this batch (0-based, warm-up included) starts')
parser.add_argument('--fail-mode', choices=['exit', 'raise'], default='exit',
                    help='exit: the process dies; raise: it raises HorovodInternalError')
parser.add_argument('--wait-for-size', type=int, default=0,
                    help='before each benchmark iteration, wait (up to --wait-timeout s) until this many '
                         'workers are in the job: the driver adds a blacklisted host back after its cooldown')
parser.add_argument('--wait-timeout', type=float, default=60.0,
                    help='seconds to wait for --wait-for-size workers before going on without them')
parser.add_argument('--work-dir', type=str, default='.',
                    help='where the fail-once marker lives')
parser.add_argument('--dump-stacks-after', type=float, default=0,
                    help='if still running after this many seconds, write every thread\'s Python stack to '
                         'stacks.<pid>.txt (for hangs)')
parser.add_argument('--json', type=str, default=None,
                    help='write this worker\'s result here ("{rank}" is replaced by the final rank)')

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

torch.set_num_threads(1)

if args.dump_stacks_after > 0:
    _stacks = open(os.path.join(args.work_dir, 'stacks.%d.txt' % os.getpid()), 'w')
    faulthandler.dump_traceback_later(args.dump_stacks_after, file=_stacks)

marker = os.path.join(args.work_dir, 'failed-once.marker')
started_after_failure = os.path.exists(marker)

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True

# Set up standard model.
model = getattr(models, args.model)(width=args.width)


def lr_scaler():
    return hvd.size()


if args.cuda:
    # Move model to GPU.
    model.cuda()

lr = 0.01
optimizer = optim.SGD(model.parameters(), lr=lr * lr_scaler())

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# The one line that differs: which DistributedOptimizer wraps the optimizer.
if args.optimizer == 'safusion':
    import horovod_safusion
    DistributedOptimizer = functools.partial(horovod_safusion.DistributedOptimizer, **args.safusion_kwargs)
else:
    DistributedOptimizer = hvd.DistributedOptimizer

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = DistributedOptimizer(optimizer,
                                 named_parameters=model.named_parameters(),
                                 compression=compression,
                                 op=hvd.Average)

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()

steps_run = [0]  # steps this process ran, rolled back ones included
losses = []
committed = [None]  # this worker's residuals at its last commit (horovod_safusion only)
residual_checks = []  # per reset: (restored == committed, still equal after sync, totals)


def residuals():
    if not hasattr(optimizer, 'residuals'):
        return None
    return {n: r.clone() for n, r in optimizer.residuals.state_dict().items()}


def same(a, b):
    return a is not None and b is not None and a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def total(res):
    return sum(float(r.double().sum()) for r in res.values()) if res else 0.0


def commit(state):
    state.commit()
    committed[0] = residuals()


def maybe_fail(state):
    if args.fail_rank is None or hvd.rank() != args.fail_rank or state.batches_done != args.fail_at_batch:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # failed once already
    os.write(fd, ('rank %d pid %d batch %d\n' % (hvd.rank(), os.getpid(), state.batches_done)).encode())
    os.close(fd)
    print('[rank %d] injected failure (%s) at batch %d' % (hvd.rank(), args.fail_mode, state.batches_done), flush=True)
    if args.fail_mode == 'exit':
        os._exit(1)
    raise HorovodInternalError('injected failure at batch %d' % state.batches_done)


def wait_for_workers(state):
    """Hold the job until --wait-for-size workers are in it: the host update interrupts this loop."""
    deadline = time.monotonic() + args.wait_timeout
    while hvd.size() < args.wait_for_size and time.monotonic() < deadline:
        time.sleep(0.5)
        state.check_host_updates()  # raises HostsUpdatedInterrupt once the driver has added workers
    if hvd.size() < args.wait_for_size:
        log('Going on with %d workers: none joined in %.0f s' % (hvd.size(), args.wait_timeout))


def benchmark_step(state):
    if residual_checks and residual_checks[-1]['after_sync'] is None:  # the first step after a reset
        residual_checks[-1]['after_sync'] = same(residuals(), committed[0])
    maybe_fail(state)
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()
    steps_run[0] += 1
    losses.append(loss.item())

    state.batches_done += 1
    state.batch += 1
    if state.batch == args.num_batches_per_commit:
        state.batch = 0
        commit(state)


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '', flush=True)


log('Model: %s (width %d, %dx%d images)' % (args.model, args.width, args.image_size, args.image_size))
log('Optimizer: %s' % args.optimizer)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))


@hvd.elastic.run
def run_benchmark(state):
    try:
        benchmark(state)
    except Exception as e:  # why this worker resets (or fails), on every rank
        print('[rank %d pid %d] %s at batch %d: %s' % (hvd.rank(), os.getpid(), type(e).__name__, state.batches_done,
                                                     str(e).strip().splitlines()[-1] if str(e).strip() else ''),
              file=sys.stderr, flush=True)
        raise


def benchmark(state):
    # Warm-up (after a reset, only the warm-up batches not committed yet)
    if not state.warm:
        log('Running warmup...')
        timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches - state.batches_done)
        state.warm = True
        commit(state)

    # Benchmark
    if state.iter == 0:
        log('Running benchmark...')
    for x in range(state.iter, args.num_iters):
        if args.wait_for_size:
            wait_for_workers(state)
        # after a reset, the batches of this iteration committed before it are not run again
        number = args.num_warmup_batches + (x + 1) * args.num_batches_per_iter - state.batches_done
        if number > 0:
            seconds = timeit.timeit(lambda: benchmark_step(state), number=number)
            img_sec = args.batch_size * number / seconds
            log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
            state.img_secs.append(img_sec)
        state.iter = x + 1
        commit(state)


resets = []  # (size after the reset) per reset this process went through


# adjust learning rate on reset
def on_state_reset():
    resets.append(hvd.size())
    if committed[0] is not None:  # a worker that restored its last commit (not a new one)
        now = residuals()
        residual_checks.append({'restored': same(now, committed[0]), 'after_sync': None,
                                'committed_total': total(committed[0]), 'restored_total': total(now)})
    log('Reset: %d %s(s) now' % (hvd.size(), device))
    print('[rank %d pid %d] reset: size %d, batch %d' % (hvd.rank(), os.getpid(), hvd.size(), state.batches_done),
          file=sys.stderr, flush=True)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr * lr_scaler()


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, img_secs=[], iter=0, batch=0, warm=False,
                               batches_done=0)
state.register_reset_callbacks([on_state_reset])
run_benchmark(state)

# Results
img_sec_mean = np.mean(state.img_secs)
img_sec_conf = 1.96 * np.std(state.img_secs)
log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
log('Total img/sec on %d %s(s): %.1f +-%.1f' %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))

if args.json:
    params = [p.detach().double().cpu() for p in model.parameters()]
    residual_total = None
    if hasattr(optimizer, 'residuals'):
        residual_total = sum(float(r.double().sum()) for r in optimizer.residuals.state_dict().values())
    result = {
        'rank': hvd.rank(), 'size': hvd.size(), 'pid': os.getpid(), 'optimizer': args.optimizer,
        'fp16_allreduce': args.fp16_allreduce, 'started_after_failure': started_after_failure,
        'batches_done': state.batches_done,
        'batches_expected': args.num_warmup_batches + args.num_iters * args.num_batches_per_iter,
        'iter': state.iter, 'steps_run': steps_run[0], 'resets': len(resets), 'sizes_after_reset': resets,
        'residual_checks': residual_checks,
        'param_checksum': float(sum(float(p.sum()) for p in params)),
        'params_finite': bool(all(bool(torch.isfinite(p).all()) for p in params)),
        'losses_finite': bool(all(math.isfinite(v) for v in losses)),
        'residual_total': residual_total,
        'last_density': optimizer.last_stats.density if hasattr(optimizer, 'last_stats') else None,
        'img_sec_mean': float(img_sec_mean) if state.img_secs else None,
    }
    path = args.json.replace('{rank}', str(hvd.rank())) if '{rank}' in args.json else '%s.rank%d.json' % (args.json, hvd.rank())
    with open(path, 'w') as f:
        json.dump(result, f, indent=1)
