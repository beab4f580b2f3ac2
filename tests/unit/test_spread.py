"""Density by tensor (``spread_density``, ``horovod_safusion.spread``): the floors that selection
segments carry, how a buffer selected whole takes them, how the profile prices them, which
densities the option resolves to, and the word model's tensors selected at their own densities
through the real optimizer in a one-worker Horovod job (the ranks' votes are
``test_robustness``'s)."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import horovod_safusion as saf
from horovod_safusion.buffer import FusionBuffer
from horovod_safusion.compressors import make_compressor
from horovod_safusion.density import SPREAD
from horovod_safusion.segment import Segments
from horovod_safusion.spread import CONCENTRATED, concentration
from corpus import stdlib_corpus
from models import LSTMLanguageModel
from synthetic import synthetic_profile


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=8),
       floors=st.lists(st.sampled_from([0.0, 0.05, 0.1, 1.0]), min_size=8, max_size=8),
       density=st.sampled_from([0.001, 0.03, 0.1, 0.5]))
def test_a_segment_selects_at_the_larger_of_the_density_and_its_floor(sizes, floors, density):
    floors = tuple(floors[:len(sizes)])
    plain = Segments(tuple(f"t{i}" for i in range(len(sizes))), tuple(sizes))
    floored = dataclasses.replace(plain, floors=floors)
    d = np.maximum(density, floors)
    assert np.array_equal(floored.density_array(density), d)
    assert floored.k_array(density).tolist() == [max(1, round(n * x)) for n, x in zip(sizes, d.tolist())]
    assert np.array_equal(plain.k_array(density), np.maximum(np.round(np.array(sizes) * density), 1))
    assert plain.k_array(density).tolist() == [max(1, round(n * density)) for n in sizes]
    assert hash(floored) != hash(plain) or floors == (0.0,) * len(sizes)  # compressors cache by segments


def test_a_buffer_takes_floors_per_tensor_or_as_the_mean_density_of_its_whole_selection():
    params = [torch.zeros(100), torch.zeros(300)]
    ahead = FusionBuffer(0, ["a", "b"], params, "ahead")
    ahead.set_floors({"b": 0.1}, 0.03)
    assert ahead.selection is ahead.segments and ahead.segments.floors == (0.0, 0.1)
    assert ahead.selection.k_array(0.03).tolist() == [3, 30]
    behind = FusionBuffer(0, ["a", "b"], params, "behind")
    behind.set_floors({"b": 0.1}, 0.03)
    assert behind.segments.floors == (0.0, 0.1) and behind.selection.k_array(0.03).tolist() == [33]
    behind.set_floors({}, 0.03)
    assert behind.selection.floors == () and behind.segments.floors == ()


def test_the_profile_prices_spread_tensors_at_their_floors():
    profile = dataclasses.replace(synthetic_profile([4000, 8000, 2000], [0.0, 1.0, 2.0]), dense_comm=False,
                                  density=0.01)  # 1,000, 2,000 and 500 float32 elements, sparse
    names = profile.names
    priced = dataclasses.replace(profile, floors={names[1]: 0.1})
    assert profile.selected(names) == 10 + 20 + 5
    assert priced.selected(names) == 10 + 200 + 5
    assert priced.selected(names, "behind") == 215
    assert priced.message_bytes(names) == 215 * max(priced.wire_bytes[n] for n in names)


def optimizer(**kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    return saf.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), **kwargs)


@pytest.mark.parametrize("kwargs,floor", [
    ({}, SPREAD), ({"density": "auto"}, SPREAD), ({"density": 0.03}, None), ({"density": 0.01}, None),
    ({"compressor": make_compressor("topk", 0.03)}, None), ({"density": 0.01, "spread_density": 0.2}, 0.2),
    ({"spread_density": 0.05}, 0.05), ({"fusion": "horovod"}, None), ({"compressor": "none"}, None)])
def test_the_floor_is_the_default_where_the_density_is_and_none_where_it_was_given(hvd, kwargs, floor):
    assert optimizer(**kwargs).controller.spread_floor == floor


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, True, "0.1", float("nan")])
def test_a_bad_spread_density_is_a_clear_error(hvd, bad):
    with pytest.raises(ValueError, match=r"spread_density must be a number with 0 < spread_density <= 1, or "
                                         rf"None \(the default\), got {bad!r}"):
        optimizer(spread_density=bad)


def test_the_word_models_spread_tensors_select_at_the_floor_from_the_second_step(hvd):
    """The examples' LSTM word model under the defaults (top-k, every tensor sparsified): at the
    first step every tensor sends 3 %; from the second, the recurrent weights (spread) send 10 %
    and the embedding and the decoder (concentrated) 3 %, and the decisions travel in the
    checkpoint."""
    ids, itos = stdlib_corpus(vocab=1000, max_chars=300_000)

    def build():
        torch.manual_seed(0)
        model = LSTMLanguageModel(len(itos), embed=32, hidden=32, layers=1, dropout=0.0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        return model, saf.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compressor="topk",
                                               min_selected=0, dense_share=0, dense=False, critical_regimes=None)

    model, opt = build()
    names = dict(model.named_parameters())
    windows = ids[:3 * 16 * 21].view(3, 16, 21)
    for step, batch in enumerate(windows):
        opt.zero_grad()
        F.cross_entropy(model(batch[:, :-1]).reshape(-1, len(itos)), batch[:, 1:].reshape(-1)).backward()
        if step == 0:
            spread = {n: concentration(p.grad) < CONCENTRATED for n, p in names.items()}
        opt.step()
        for n, p in names.items():
            density = SPREAD if step and spread[n] else 0.03
            assert int((p.grad != 0).sum()) == max(1, round(density * p.numel())), (step, n)
    assert opt.controller.spread.decided == spread
    assert spread["lstm.weight_ih_l0"] and not spread["encoder.weight"] and not spread["decoder.weight"]
    _, resumed = build()
    resumed.load_state_dict(opt.state_dict())
    assert resumed.controller.spread.decided == spread
    assert resumed.controller.floors() == {n: SPREAD for n, s in spread.items() if s}
