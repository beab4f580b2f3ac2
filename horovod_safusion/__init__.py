"""horovod-safusion: sparsification-ahead tensor fusion (SAFusion, HPDC'25) as a Horovod plugin.

Swap one line of a Horovod script::

    optimizer = horovod_safusion.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                      compressor="dgc", density=0.01)
"""
try:
    from .communicators import Communicator, available_communicators, register_communicator
    from .compressors import Compressor, available_compressors, register_compressor
    from .controller import StepStats
    from .fusion import Planner, available_planners, register_planner
    from .optimizer import DistributedOptimizer, SAFusionOptimizer
    from . import cycle, elastic
    from .compressors import loading
    from .plan import FusionPlan, TensorInfo
    from .timeline import TimelineRecorder

    elastic.register(SAFusionOptimizer)  # hvd.elastic.TorchState handles this package's optimizers
    # Horovod's cycle time for a few buffers per step, unless one was chosen
    cycle.set_on_import = cycle.set_default()
    # the selection kernels loaded while the script sets itself up, in a worker of a launched job
    loading.load_on_import()
except (ImportError, ValueError) as error:
    # Horovod, torch or Numba missing or broken, or the kernels' loading switch neither 0 nor 1:
    # the doctor command says which
    from . import doctor
    doctor.fallback(error)  # returns unless this process runs that command
    raise

__version__ = "0.1.0"

__all__ = ["Communicator", "Compressor", "DistributedOptimizer", "FusionPlan", "Planner", "SAFusionOptimizer", "StepStats",
           "TensorInfo", "TimelineRecorder", "available_communicators", "available_compressors", "available_planners",
           "register_communicator", "register_compressor", "register_planner"]
