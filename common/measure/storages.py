"""From tensors to the storages that hold their bytes: the plain tensors behind DTensor and
other wrapper subclasses, a storage's identity, and the bytes of the distinct storages behind
some tensors (views share their storage). Used by the memory tracer (common/measure/memory.py)
and the step collector (common/measure/step_gc.py)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _plain_tensors(obj):
    """The plain tensors behind obj, looking inside DTensor and other wrapper subclasses."""
    for t in tree_leaves(obj):
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            yield from _plain_tensors([getattr(t, a) for a in attrs])
        else:
            yield t


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind ``tensors`` (meta tensors hold none, nor do
    the fake tensors torch.compile leaves behind, whose sizes may be symbolic)."""
    from torch._subclasses.fake_tensor import FakeTensor
    storages = {}
    for t in _plain_tensors(tensors):
        if t.is_meta or isinstance(t, FakeTensor):
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        storages[st._cdata] = st.nbytes()
    return sum(storages.values())
