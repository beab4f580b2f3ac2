"""A gradient's path through the controller, in stages (SAFusion §3.1 Steps 1–3, §4 "Controller module").

* :mod:`.mode` — the step's :class:`~.mode.StepMode`, decided once at its first gradient: dense or
  sparse, its density, the loss-scale ratio of the residuals.
* :mod:`.fill` — a gradient into its buffer: local clipping, momentum correction, the residual.
* :mod:`.select` — one selection per buffer, on the host or on the device (chosen once per plan).
* :mod:`.send` — one collective per buffer: the job's communicator, or Horovod's allreduce.
* :mod:`.half` — a critical step's buffer as float16, its rounding error kept in the residual.
* :mod:`.flags` — what every rank must agree on: the step's flags (non-finite gradients, arrived
  gradients, joining parameters).
* :mod:`.loss_scale` — the loss scale the residuals are kept at.
* :mod:`.collect` — decoding into ``p.grad``, the residuals put back, the step's statistics.
* :mod:`.record` — what one buffer's step produces, stage by stage: the records one stage returns
  and the next takes (the buffer keeps only what lives across steps).

:class:`~horovod_safusion.controller.Controller` holds the plan and runs the stages in order.
"""
