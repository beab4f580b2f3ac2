"""Synthetic profiles with linear costs, for the generator's worked examples and property tests."""
from horovod_safusion.fusion import CostCurve, Profile, TensorInfo


def synthetic_profile(sizes, ready, cp=(0.0, 0.0), cm=(0.0, 1e-9), segment_cost=0.0,
                      prefix=0.0, suffix=0.0, buffer_cost=0.0) -> Profile:
    """Tensors ``t0..`` of ``sizes`` bytes (float32) ready at ``ready`` seconds; compression
    ``cp[0] + cp[1]·bytes`` and communication ``cm[0] + cm[1]·bytes``; ``buffer_cost`` of fixed
    work per buffer; dense messages."""
    tensors = [TensorInfo(f"t{i}", n // 4, 4, "torch.float32@cpu") for i, n in enumerate(sizes)]
    big = 4 * sum(sizes) + 4
    return Profile(tensors=tensors, ready=list(ready), prefix=prefix, suffix=suffix,
                   compress=CostCurve([0, big], [cp[0], cp[0] + cp[1] * big]),
                   communicate=CostCurve([0, big], [cm[0], cm[0] + cm[1] * big]),
                   density=0.5, wire_bytes={t.name: 8 for t in tensors}, dense_comm=True,
                   segment_cost=segment_cost, buffer_cost=buffer_cost)
