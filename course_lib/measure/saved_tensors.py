"""What autograd saves for the backward pass, counted: :class:`SavedTensorMeter` (saved-tensor hooks)
and :func:`measure_block`, the bytes one transformer block saves, the measurement that
:func:`course_lib.cost.activations.activation_bytes_per_layer` predicts (Korthikanti et al., *Reducing
Activation Recomputation in Large Transformer Models*, 2022, §4).

The model counts what the CPU kernels save. On another device ``F.scaled_dot_product_attention``
runs another kernel, which saves other statistics: ``cost.activations.sdpa_saved_statistics`` gives
them per device type, and ``cost.activations.sdpa_extra_bytes`` the difference the measurement then
shows. :func:`sdpa_kernel` picks the kernel a measurement runs.

Used by lectures 01 (:mod:`course_lib.measure.step_memory`), 02 (ZeRO's stages), 03 (the TP and SP
layouts, :mod:`course_lib.experiments.lecture03.layer_activation_bytes`) and 06 (recomputation).
Tested in tests/measure/test_activation_memory.py and tests/measure/test_device_measure.py.
"""

from __future__ import annotations

import contextlib

import torch

from course_lib.cost.activations import ATTENTION_KERNELS


class SavedTensorMeter:
    """Counts the bytes of distinct storages that autograd saves for backward while active.

        with SavedTensorMeter(exclude=model) as meter:
            y = model(x)
        meter.bytes

    Tensors are kept alive by the graph until backward, so a storage seen once cannot be freed and
    replaced by another saved tensor's during the forward pass: counting storages (by the storage
    object, ``_cdata``, which works on any device, meta included, where every address is 0) is
    counting tensors. Storages of ``exclude``'s parameters and buffers are left out (weights are not
    activations, and ``w.t()`` saved by a linear is a view of the weight), and so are the storages
    of ``constants`` (the RoPE tables passed to a block). Those are recognised by the storage object
    itself (``_cdata``), not by its address: ZeRO-3 frees a parameter's storage and re-allocates it
    at a new address for every gather.
    """

    def __init__(self, exclude: torch.nn.Module | None = None, constants: tuple = ()):
        tensors = list(exclude.parameters()) + list(exclude.buffers()) if exclude is not None else []
        tensors += list(constants)
        self._excluded = {t.untyped_storage()._cdata for t in tensors}
        self.storages: dict[int, int] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self._excluded and storage.nbytes() > 0:
            self.storages[storage._cdata] = storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def sdpa_kernel(attention: str):
    """A context that makes ``F.scaled_dot_product_attention`` run the named kernel."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as choose

    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION_KERNELS}")
    return choose(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()


def measure_block(
    block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: str = "flash"
) -> int:
    """Bytes of activations ``block(x, cos, sin)`` saves for backward on this rank (x counts: it is saved).

    Measured on ``x``'s device, where ``block``, ``cos`` and ``sin`` must be too: what SDPA saves
    depends on the device's kernel (:func:`~course_lib.cost.activations.sdpa_saved_statistics`).
    ``x`` is copied first: a slice of a larger tensor would be counted with its whole storage.
    """
    where = {t.device for t in (*block.parameters(), cos, sin)}
    if where != {x.device}:
        raise ValueError(f"x is on {x.device}, the block and the RoPE tables on {where}: put them on one device")
    x = x.detach().clone().requires_grad_(True)
    with sdpa_kernel(attention), SavedTensorMeter(exclude=block, constants=(cos, sin)) as meter:
        block(x, cos, sin)
    return meter.bytes
