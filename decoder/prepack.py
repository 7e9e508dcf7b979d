"""`prepack`: a CPU model's linear layers with their weights laid out once for oneDNN.

On the project's CPU (AMD EPYC, torch 2.13's MKL), float32 nn.Linear on 2 rows costs about twice 1 row, so a
1-node tree's forward costs 1.7-2x a one-token step on 100M-0.5B models. oneDNN's prepacked linear
(torch.utils.mkldnn.MkldnnLinear) does not: on a CosyVoice 2-shaped 0.5B model (2 threads, 250 tokens cached)
a one-token step took 77 ms instead of 110, and 1 / 8 / 64 tree nodes 1.21 / 1.53 / 4.26x it instead of
1.94 / 2.56 / 4.44x (`python -m echospec.tools.benchmarks.cost_curves --variants mkldnn`).
"""

from __future__ import annotations

import warnings

import torch


def prepack(model):
    """Replace, in place, every nn.Linear of `model` except its output embeddings (the LM head, which
    policies read as a table) by a oneDNN-prepacked one in the model's dtype; returns `model`. CPU inference
    only: the prepacked weights do not train, and CUDA has no use for them."""
    if model.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError("prepack is for models on a CPU with oneDNN (torch.backends.mkldnn)")
    with warnings.catch_warnings():  # torch 2.13 marks the TorchScript decorators MkldnnLinear uses as deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.utils import mkldnn
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child is not head:
                setattr(module, name, mkldnn.MkldnnLinear(child, child.weight.dtype))
    return model
