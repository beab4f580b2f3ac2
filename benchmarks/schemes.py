"""Every benchmark's schemes: one label grammar, one meaning, built the same way everywhere.

A label names what a user would run::

    label      := peer | ours
    peer       := compute | horovod | horovod-fp16 | ddp | ddp-powersgd | ddp-powersgd-1bucket
    ours       := fusion ["@" density] ["/" compressor] {"+" technique} {":" key "=" value}

* A **peer** runs as its users run it: ``horovod`` is ``hvd.DistributedOptimizer`` (dense
  allreduce, Horovod's Tensor Fusion), ``horovod-fp16`` the same with ``Compression.fp16``,
  ``ddp`` PyTorch DDP with its default buckets, ``ddp-powersgd`` DDP with its PowerSGD hook
  (:func:`ddp_powersgd`; ``-1bucket``: one bucket, where Gloo needs it), ``compute`` no
  communication at all (the limit).
* **Ours** is ``horovod_safusion.DistributedOptimizer``. ``fusion`` is a fusion planner
  (``safusion``, the default, is not passed); ``density`` a number or ``auto``; ``compressor`` a
  registered compressor; each ``+technique`` one of :data:`TECHNIQUES` (``+dgc`` is
  ``+mc+clip+warmup``, DGC's techniques, masking on); each ``key=value`` one more keyword argument
  (numbers and ``true``/``false`` are converted; ``compression=fp16`` is Horovod's
  ``Compression.fp16``), and a key in capitals (``HOROVOD_CYCLE_TIME=5``)
  an environment variable of the job. Anything the label does not give is the library's default,
  unless the benchmark says otherwise — :func:`print_resolved` prints what each label resolved to.

So ``safusion@0.03+densestart:communicator=spardl`` is ``density=0.03``, a dense start over the
benchmark's warm-up steps, and ``communicator="spardl"``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

PEERS = ("compute", "horovod", "horovod-fp16", "ddp", "ddp-powersgd", "ddp-powersgd-1bucket")
TORCHRUN = ("compute", "ddp", "ddp-powersgd", "ddp-powersgd-1bucket")  # launched by torch.distributed.run
HOROVOD = ("horovod", "horovod-fp16")
TECHNIQUES = {"mc": "momentum correction", "nomask": "without momentum factor masking", "clip": "local clipping",
              "warmup": "density warm-up", "densestart": "dense for the warm-up's steps (PowerSGD's start)",
              "ef21": "EF21-SGDM error feedback",
              "classic": "classic error feedback under the SGD's momentum"}
DGC = frozenset({"mc", "clip", "warmup"})
ENV_KEY = re.compile(r"[A-Z][A-Z0-9_]*")  # a pair with such a key is an environment variable
INT_KEYS = ("profile_steps", "replan_every", "min_selected", "warmup_steps", "critical_regimes")
FLOAT_KEYS = ("local_clipping", "dense_share", "spread_density")


@dataclass(frozen=True)
class Scheme:
    """One parsed label.

    Attributes:
        label: the label as written (the scheme's key in every result).
        peer: the peer's name, or ``None`` for ours.
        options: our optimizer's keyword arguments the label gives directly.
        techniques: the label's ``+technique`` set (``+dgc`` expanded); resolved by :meth:`kwargs`.
        env: environment variables of the job.
    """

    label: str
    peer: str | None = None
    options: dict = field(default_factory=dict)
    techniques: frozenset = frozenset()
    env: dict = field(default_factory=dict)

    @property
    def ours(self) -> bool:
        return self.peer is None

    @property
    def torchrun(self) -> bool:
        """Whether its users launch it with ``torch.distributed.run`` (else ``horovodrun``)."""
        return self.peer in TORCHRUN

    def kwargs(self, warmup_steps: int = 0, clip: float | None = None, defaults: dict | None = None) -> dict:
        """Our optimizer's keyword arguments: the benchmark's ``defaults`` (what it sets for every
        scheme of ours), then the label's techniques — a warm-up or dense start over
        ``warmup_steps``, local clipping at ``clip`` (the task's global clip norm, if it has one) —
        then the label's own ``key=value`` options."""
        t = self.techniques
        out = dict(defaults or {})
        if t & {"warmup", "densestart"}:
            out["warmup_steps"] = warmup_steps
            if "densestart" in t:
                out["warmup_schedule"] = "dense"
        if "ef21" in t:
            out["error_feedback"] = "ef21-sgdm"
        if "mc" in t:
            out["momentum_correction"] = True
        if "mc" in t or "nomask" in t:
            out["momentum_masking"] = "nomask" not in t
        if "classic" in t and "mc" not in t:
            out["momentum_correction"] = False
        if "clip" in t and clip is not None:
            out["local_clipping"] = clip
        out.update(self.options)
        return out

    def clips_locally(self, kwargs: dict) -> bool:
        """Whether ``kwargs`` clip each worker's gradient (then the benchmark does not clip the
        aggregate after ``synchronize()``)."""
        return kwargs.get("local_clipping") is not None


class PerTask(str):
    """A value the benchmark fixes per task (a warm-up's steps, a clip norm), printed as is by
    :func:`describe` before the tasks are loaded."""

    def __repr__(self) -> str:
        return str(self)


def parse(label: str) -> Scheme:
    """``label`` → :class:`Scheme`; a clear ``SystemExit`` naming what is wrong and what is known."""
    body, *pairs = label.split(":")
    env = {}
    options: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"scheme {label!r}: {pair!r} is not key=value")
        if ENV_KEY.fullmatch(key):
            env[key] = value
        else:
            options[key] = _value(label, key, value)
    if body in PEERS:
        if options:
            raise SystemExit(f"scheme {label!r}: key=value options are for our optimizer, not for {body}")
        return Scheme(label, peer=body, env=env)
    body, *flags = body.split("+")
    techniques: set = set()
    for f in flags:
        if f != "dgc" and f not in TECHNIQUES:
            raise SystemExit(f"scheme {label!r}: unknown technique +{f}; known: +dgc, "
                             + ", ".join(f"+{t} ({d})" for t, d in TECHNIQUES.items()))
        techniques |= DGC if f == "dgc" else {f}
    head, slash, compressor = body.partition("/")
    fusion, at, density = head.partition("@")
    import horovod_safusion as saf  # here: a peer's job must not import the plugin
    known = {"fusion": saf.available_planners(), "compressor": saf.available_compressors()}
    given = {"fusion": fusion} if fusion != "safusion" else {}
    if at:
        given["density"] = _value(label, "density", density)
    if slash:
        given["compressor"] = compressor
    if fusion not in known["fusion"]:
        raise SystemExit(f"scheme {label!r}: {fusion!r} is neither a peer nor a fusion planner; peers: "
                         f"{', '.join(PEERS)}; planners: {', '.join(known['fusion'])}")
    for option, names in known.items():
        value = options.get(option, given.get(option))
        if isinstance(value, str) and value not in names:
            raise SystemExit(f"scheme {label!r}: {option} {value!r} is unknown; known: {', '.join(names)}")
    return Scheme(label, options={**given, **options}, techniques=frozenset(techniques), env=env)


def _value(label: str, key: str, value: str):
    """A ``key=value`` option's value: ints, floats, booleans, ``auto``, else the string;
    ``critical_regimes=none`` turns critical regimes off."""
    try:
        if key == "density":
            return value if value == "auto" else float(value)
        if key == "critical_regimes" and value in ("none", "auto"):
            return None if value == "none" else value
        if key in INT_KEYS:
            return int(value)
        if key in FLOAT_KEYS:
            return float(value)
    except ValueError:
        raise SystemExit(f"scheme {label!r}: {key}={value!r} is not a number") from None
    return {"true": True, "false": False}.get(value.lower(), value)


def describe(scheme: Scheme, kwargs: dict | None = None, note: str = "") -> str:
    """One line: the label and what it resolved to."""
    if scheme.peer is not None:
        what = {"compute": "no communication", "horovod": "hvd.DistributedOptimizer",
                "horovod-fp16": "hvd.DistributedOptimizer(compression=hvd.Compression.fp16)",
                "ddp": "DistributedDataParallel, default buckets",
                "ddp-powersgd": f"DDP + PowerSGD hook (rank {POWERSGD_RANK}), default buckets",
                "ddp-powersgd-1bucket": f"DDP + PowerSGD hook (rank {POWERSGD_RANK}), one bucket"}[scheme.peer]
    else:
        kw = scheme.kwargs() if kwargs is None else kwargs
        what = "horovod_safusion.DistributedOptimizer(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"
    env = "".join(f" [{k}={v}]" for k, v in scheme.env.items())
    return f"{scheme.label:<28} {what}{env}{note}"


def print_resolved(lines: list[str], title: str = "schemes, as resolved") -> None:
    """Print what every label resolved to (:func:`describe`'s lines) before a benchmark runs."""
    print(f"{title}:")
    for line in lines:
        print(f"  {line}")
    print(flush=True)


def horovod_optimizer(scheme: Scheme, sgd: torch.optim.Optimizer, model: torch.nn.Module):
    """A Horovod peer's optimizer, as its users build it (after broadcasting rank 0's weights)."""
    import horovod.torch as hvd

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hvd.Compression.fp16 if scheme.peer == "horovod-fp16" else hvd.Compression.none
    return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)


def our_optimizer(sgd: torch.optim.Optimizer, model: torch.nn.Module, kwargs: dict):
    """Our optimizer with ``kwargs`` (after broadcasting rank 0's weights, as with Horovod);
    ``compression="fp16"`` or ``"none"`` is Horovod's ``Compression`` of that name."""
    import horovod.torch as hvd
    import horovod_safusion as saf

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if isinstance(kwargs.get("compression"), str):
        kwargs = kwargs | {"compression": wire_compression(kwargs["compression"])}
    return saf.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **kwargs)


def wire_compression(name: str):
    """Horovod's ``Compression.<name>`` for a label's ``compression=<name>``."""
    import horovod.torch as hvd

    if name not in ("none", "fp16"):
        raise SystemExit(f"compression={name!r}: a label accepts compression=none or compression=fp16")
    return getattr(hvd.Compression, name)


#: PowerSGD's ``matrix_approximation_rank`` in every benchmark: its documentation's example value,
#: and the rank the papers compare against.
POWERSGD_RANK = 4


def ddp_powersgd(model: torch.nn.Module, start_iter: int, one_bucket: bool = False) -> torch.nn.Module:
    """``model`` in PyTorch DDP with its PowerSGD hook, as its users set it up: DDP's default
    buckets, rank :data:`POWERSGD_RANK`, dense for the first ``start_iter`` steps
    (``start_powerSGD_iter``). DDP broadcasts rank 0's weights. ``one_bucket``: one bucket holding
    the whole model, where Gloo needs it — the hook starts its second and third allreduce from
    completion callbacks, and with several buckets Gloo ranks can start them in different orders
    (seen as an abort, "op.preamble.length <= op.nbytes", in a job that also ran Horovod)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ddp = torch.nn.parallel.DistributedDataParallel(model, **({"bucket_cap_mb": int(mb) + 1} if one_bucket else {}))
    ddp.register_comm_hook(P.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                           start_powerSGD_iter=start_iter), P.powerSGD_hook)
    return ddp


def batch(step: int, rank: int, size: int, batch_size: int, n: int) -> slice:
    """This rank's slice of the data at ``step`` (ranks read disjoint consecutive batches)."""
    i = ((step * size + rank) * batch_size) % (n - batch_size)
    return slice(i, i + batch_size)
