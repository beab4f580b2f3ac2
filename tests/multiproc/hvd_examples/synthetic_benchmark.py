r"""Horovod's PyTorch synthetic benchmark (examples/pytorch/pytorch_synthetic_benchmark.py), in the
same shape and with the same flags, with one line that picks the distributed optimizer:
``--optimizer horovod`` wraps it in ``hvd.DistributedOptimizer``, ``--optimizer safusion`` in
``horovod_safusion.DistributedOptimizer``, called with the same arguments. Everything else is
identical between the two.

Differences from Horovod's script, all for a CPU-only test machine: a torchvision-shaped ResNet-18
defined in ``resnet.py`` (torchvision cannot be imported here) with ``--width`` and
``--image-size``; ``hvd.SyncBatchNorm`` only on CUDA (Horovod's works only on GPUs);
one intra-op thread; ``--json PATH`` writes each rank's result (``{rank}`` in PATH is replaced,
otherwise ``.rank<N>.json`` is appended) so that a test can assert on it; ``--dump-stacks-after S``
writes all threads' Python stacks to ``stacks.<pid>.txt`` beside it if a worker still runs after S
seconds (for hangs).

    horovodrun -np 2 -H localhost:2 --gloo python synthetic_benchmark.py --optimizer safusion \
        --width 8 --image-size 32 --batch-size 8 --num-warmup-batches 2 --num-iters 3 --json out.json
"""
import argparse
import faulthandler
import json
import math
import os
import timeit

import numpy as np
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
import horovod.torch as hvd

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

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')

# Not in Horovod's script: CPU-sized model and data, the optimizer switch, a result file.
parser.add_argument('--width', type=int, default=64,
                    help='channels of the first ResNet stage (torchvision: 64)')
parser.add_argument('--image-size', type=int, default=224,
                    help='height and width of the synthetic images')
parser.add_argument('--optimizer', choices=['horovod', 'safusion'], default='safusion',
                    help='hvd.DistributedOptimizer or horovod_safusion.DistributedOptimizer')
parser.add_argument('--dump-stacks-after', type=float, default=0,
                    help='if still running after this many seconds, write every thread\'s Python stack to '
                         'stacks.<pid>.txt (for hangs)')
parser.add_argument('--json', type=str, default=None,
                    help='write this rank\'s result here ("{rank}" is replaced by the rank)')

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

torch.set_num_threads(1)

if args.dump_stacks_after > 0:
    _stacks = open(os.path.join(os.path.dirname(os.path.abspath(args.json)) if args.json else '.', 'stacks.%d.txt' % os.getpid()), 'w')
    faulthandler.dump_traceback_later(args.dump_stacks_after, file=_stacks)

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True

# Set up standard model (Horovod's SyncBatchNorm runs on GPUs only).
model = getattr(models, args.model)(width=args.width, norm_layer=hvd.SyncBatchNorm if args.cuda else None)

lr_scaler = hvd.size()

if args.cuda:
    # Move model to GPU.
    model.cuda()

optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# The one line that differs: which DistributedOptimizer wraps the optimizer.
if args.optimizer == 'safusion':
    import horovod_safusion
    DistributedOptimizer = horovod_safusion.DistributedOptimizer
else:
    DistributedOptimizer = hvd.DistributedOptimizer

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = DistributedOptimizer(optimizer,
                                 named_parameters=model.named_parameters(),
                                 compression=compression,
                                 op=hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()

losses = []


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '', flush=True)


log('Model: %s (width %d, %dx%d images)' % (args.model, args.width, args.image_size, args.image_size))
log('Optimizer: %s' % args.optimizer)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))

# Warm-up
log('Running warmup...')
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log('Running benchmark...')
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
log('Total img/sec on %d %s(s): %.1f +-%.1f' %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))

if args.json:
    params = [p.detach().double().cpu() for p in model.parameters()]
    result = {
        'rank': hvd.rank(), 'size': hvd.size(), 'optimizer': args.optimizer,
        'fp16_allreduce': args.fp16_allreduce,
        'steps': len(losses), 'first_loss': losses[0] if losses else None, 'last_loss': losses[-1] if losses else None,
        'param_checksum': float(sum(float(p.sum()) for p in params)),
        'param_abs_checksum': float(sum(float(p.abs().sum()) for p in params)),
        'params_finite': bool(all(bool(torch.isfinite(p).all()) for p in params)),
        'losses_finite': bool(all(math.isfinite(v) for v in losses)),
        'img_sec_mean': float(img_sec_mean), 'img_sec_conf': float(img_sec_conf), 'img_secs': [float(v) for v in img_secs],
    }
    path = args.json.replace('{rank}', str(hvd.rank())) if '{rank}' in args.json else '%s.rank%d.json' % (args.json, hvd.rank())
    with open(path, 'w') as f:
        json.dump(result, f, indent=1)
