"""Communicator registry: ``communicator=`` takes ``"auto"``, one of these names, or an instance."""
from .allgather import Allgather
from .allreduce import Allreduce
from .base import Communicator, Pending, available_communicators, make_communicator, register_communicator
from .exdyna import ExDynaCommunicator
from .spardl import SparDL
from .zen import Zen

__all__ = ["Allgather", "Allreduce", "Communicator", "ExDynaCommunicator", "Pending", "SparDL", "Zen", "available_communicators",
           "make_communicator", "register_communicator"]
