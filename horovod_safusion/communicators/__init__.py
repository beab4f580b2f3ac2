"""Communicator registry: ``communicator=`` takes ``"auto"``, one of these names, or an instance."""
from .allgather import Allgather
from .allreduce import Allreduce
from .base import (Communicator, Outgoing, Pending, Reduction, Target, available_communicators, make_communicators,
                   register_communicator)
from .exdyna import ExDynaCommunicator
from .scalecom import ScaleCom
from .spardl import SparDL
from .zen import Zen

__all__ = ["Allgather", "Allreduce", "Communicator", "ExDynaCommunicator", "Outgoing", "Pending", "Reduction",
           "ScaleCom", "SparDL", "Target", "Zen", "available_communicators", "make_communicators",
           "register_communicator"]
