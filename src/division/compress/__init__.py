"""The saving policy: custom autograd functions that keep compressed copies of what backward needs.

``install(model, policy)`` points the forward of every covered module (Conv2d, BatchNorm2d, SyncBatchNorm,
Linear, ReLU, MaxPool2d, Dropout, average pools, LayerNorm, GELU) at a function that, in training steps
only, runs the exact forward and hands the tensor backward needs to ``policy.save``. Parameters, buffers and the state_dict are untouched;
eval mode and ``torch.no_grad()`` run the module's own forward. Modules whose class overrides ``forward``
(timm's fused or "same"-padding variants, for example) keep their own autograd and are reported uncovered.

One ``SavePolicy`` decides, per tensor, which codec keeps it, and keeps a tensor saved by two layers once.
"""
from division.codecs.quant import storage_key, unique_nbytes
from division.compress.policy import LAYER_KINDS, SavePolicy, Saved, check_layer_kinds, full_copy
from division.compress.routing import install, remove
from division.memory import SaveRecord, TensorIds

__all__ = ["SavePolicy", "Saved", "SaveRecord", "TensorIds", "install", "remove", "LAYER_KINDS",
           "check_layer_kinds", "full_copy", "storage_key", "unique_nbytes"]
