"""Collective names per Horovod session: a new session (an elastic reset) renames every collective
the plugin submits, alike on every rank, and training goes on under the new names."""
import torch
import torch.nn.functional as F

import horovod_safusion as saf
from horovod_safusion import session
from digits import DigitsCNN, load_digits_split


def test_a_new_session_renames_the_plugins_collectives(hvd):
    before = session.number()
    try:
        assert session.collective("saf.ag.0") == ("saf.ag.0" if before == 0 else f"saf.ag.0~{before}")
        session.begin(before)  # the elastic sync passes rank 0's number: every rank gets the same
        assert session.number() == before + 1
        assert session.collective("saf.ag.0") == f"saf.ag.0~{before + 1}"
        assert session.collective("saf.ag.0") != session.collective("saf.ag.1")

        torch.manual_seed(0)
        m = DigitsCNN(width=4)
        opt = saf.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                       fusion="safusion-inter", communicator="spardl")
        x, y, _, _ = load_digits_split()
        for s in range(3):
            opt.zero_grad()
            F.cross_entropy(m(x[16 * s:16 * (s + 1)]), y[16 * s:16 * (s + 1)]).backward()
            opt.step()
        assert opt.last_stats.selected > 0
    finally:
        session._number = before
