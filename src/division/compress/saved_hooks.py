"""The torch.compile route: compression of whatever a compiled graph saves for backward, through saved-tensor
hooks.

In eager mode a method installs autograd functions per layer (``compress.install``); Dynamo cannot trace
those (they hold Python objects between forward and backward), so a compiled model would break its graph at
every layer. Here the model stays plain and is compiled whole; AOTAutograd turns its forward and backward
into one autograd function whose saved tensors pass through the hooks below when the compiled forward runs.
Each saved activation map (floating point, 4-D, at least ``min_map_elems`` elements per map: convolution
weights and per-channel statistics are left alone, as are parameters) is encoded by the method's own codec
choice for a convolution input, plus one bit per element saying whether it is > 0: a compiled ReLU's
backward takes its mask from the saved output (``out <= 0``), which codes alone would get wrong near zero.
Everything else is held as autograd holds it.

Known limit (PyTorch issue 148222): autograd unpacks every saved tensor of a compiled graph when its backward
starts, so the decoded maps coexist during that backward. The bytes held between forward and backward, the
ones reported, are the compressed ones; the backward's transient is not reduced. Placing each decode next to
its use needs the codecs as custom operators traced into the graph (PyTorch PR 150032), not done yet.
"""
import contextlib
from typing import Callable, Dict, List, Optional

import torch

from division.codecs.base import Packed, storage_key
from division.codecs.exact import BitMask
from division.memory import SaveRecord, TensorIds


class SavedTensorCodec:
    """Pack/unpack hooks that encode a compiled graph's saved activation maps with ``choose(x) -> Packed``.

    A storage saved twice in one forward is encoded once. ``records`` describe the last forward (as a
    policy's records do); tensors left alone go to ``passthrough`` (the accounting's recorder when one is
    active)."""

    def __init__(self, choose: Callable[[torch.Tensor], Packed], exclude=frozenset(), min_map_elems: int = 64):
        if min_map_elems < 1:
            raise ValueError(f"min_map_elems={min_map_elems} is invalid; it must be >= 1")
        self.choose = choose
        self.exclude = frozenset(exclude)
        self.min_map_elems = min_map_elems
        self.ids = TensorIds()
        self.records: List[SaveRecord] = []
        self._encoded: Dict[tuple, tuple] = {}
        self.passthrough: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def eligible(self, t: torch.Tensor) -> bool:
        return (t.layout == torch.strided and t.is_floating_point() and t.dim() == 4
                and t.shape[2] * t.shape[3] >= self.min_map_elems and not isinstance(t, torch.nn.Parameter)
                and storage_key(t) not in self.exclude)

    def pack(self, t: torch.Tensor):
        if not self.eligible(t):
            return self.passthrough(t) if self.passthrough is not None else t.detach()
        storage = self.ids(t)
        key = storage + (t.storage_offset(), tuple(t.shape), tuple(t.stride()))  # views of one buffer differ
        if key not in self._encoded:
            channels_last = t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
            x = t.detach().contiguous()
            sign = BitMask.positive(x)  # which elements are > 0, exactly: the codes alone may cross zero
            packed = self.choose(x)
            self._encoded[key] = (packed, sign, t.dtype, channels_last)
            held = list({storage_key(h): h.untyped_storage().nbytes() for h in packed.tensors() + sign.tensors()
                         if h is not None}.items())
            self.records.append(SaveRecord("(compiled graph)", "saved map", type(packed).__name__, tuple(t.shape),
                                           t.untyped_storage().nbytes(), held, fp_key=storage,
                                           backend=getattr(packed, "backend", "")))
        return self._encoded[key]

    @staticmethod
    def unpack(saved):
        if not isinstance(saved, tuple):
            return saved
        packed, sign, dtype, channels_last = saved
        x = packed.decode().to(dtype)
        positive = sign.decode().view(x.shape)
        x = torch.where(positive, x.clamp_min(torch.finfo(dtype).tiny), x.clamp_max(0))
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x

    @contextlib.contextmanager
    def context(self):
        """One forward: fresh records, the hooks on for the duration."""
        self.records, self._encoded = [], {}
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self
        self._encoded = {}  # the packed copies live on in autograd's graph, not here
