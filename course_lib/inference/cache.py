"""The contiguous KV cache: one max-length slab per sequence, the layout before PagedAttention.

Decoding token t of a sequence needs the keys and values of tokens 0 .. t−1 in every attention layer.
Recomputing them costs O(t) work per layer per token (O(t²) over a generation); keeping them costs

    bytes per token = 2 · n_layers · n_kv_heads · head_dim · bytes_per_element      (GQA; MLA: rkv + dr)

(:meth:`course_lib.model.config.ModelConfig.kv_cache_bytes_per_token`). The simplest store reserves
``max_len`` tokens per sequence up front, as serving systems before vLLM did (Kwon et al. 2023,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", §3): a
sequence that stops early leaves the rest of its slab reserved and unused. :mod:`.paged` measures
that waste against block-wise allocation.

The model calls a cache through four methods (:meth:`course_lib.model.transformer.Transformer.hidden`):
``begin_step(t)`` reserves room for t new tokens per sequence and gives their positions,
``layer(i)`` is layer i's view whose ``update(k, v)`` stores the new K/V and returns all of them,
``end_step()`` counts the new tokens as cached. Every sequence of this cache advances in step, so
prompts of one batch have one length (the engine of :mod:`.engine` serves varied lengths).

A cache is built for one device, the model's (``device=``; the CPU by default): the positions it hands
the model index the RoPE tables and make the attention mask there, and a K/V from another device is
refused with the fix named, rather than computed with on the host or copied at every step.
"""

from __future__ import annotations

import torch

__all__ = ["ContiguousCache", "LayerView", "StepCache", "check_device"]


def check_device(cache, got: torch.device) -> None:
    """ValueError unless ``got`` (the model's device, or a new K's) is the one ``cache`` was built for
    (an index left out matches any: "cuda" is the current CUDA device)."""
    want = cache.device
    if want.type != got.type or (want.index is not None and got.index is not None and want.index != got.index):
        raise ValueError(
            f"{type(cache).__name__} was built for {want}, the model computes on {got}: build it with "
            "device=next(model.parameters()).device"
        )


class StepCache:
    """What every cache whose sequences advance in step shares: ``batch`` sequences of at most ``max_len``
    tokens, one length for all, the protocol's begin/layer/end. Subclasses store and read in ``_update``.
    ``device``: the model's device, where the positions are made and the K/V must come from."""

    def __init__(self, batch: int, max_len: int, device: torch.device | str = "cpu"):
        if batch < 1 or max_len < 1:
            raise ValueError(
                f"{type(self).__name__} needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}"
            )
        self.batch, self.max_len = batch, max_len
        self.device = torch.device(device)
        self.length = 0  # tokens cached per sequence
        self._new = 0  # tokens of the step in flight

    def __len__(self) -> int:
        return self.length

    def begin_step(self, t: int) -> torch.Tensor:
        if self.length + t > self.max_len:
            raise ValueError(
                f"the cache holds {self.length} tokens per sequence and max_len={self.max_len}; {t} more do "
                f"not fit. Build {type(self).__name__} with max_len >= prompt length + new tokens"
            )
        self._new = t
        return torch.arange(self.length, self.length + t, device=self.device).expand(self.batch, t)

    def layer(self, i: int) -> LayerView:
        return LayerView(self, i)

    def end_step(self) -> None:
        self.length += self._new
        self._new = 0

    def _check_update(self, i: int, k: torch.Tensor) -> None:
        check_device(self, k.device)
        if k.shape[0] != self.batch or k.shape[2] != self._new:
            raise ValueError(
                f"layer {i} got K of shape {tuple(k.shape)}; this cache holds batch={self.batch} sequences and "
                f"expects the {self._new} tokens announced by begin_step"
            )


class ContiguousCache(StepCache):
    """K/V of ``batch`` sequences, ``max_len`` tokens reserved per sequence in every layer.

    Storage is allocated by the first ``update`` of each layer (its head count and widths come from
    the tensors: K/V heads for GQA, latent and RoPE key for MLA) and never grows.
    """

    def __init__(self, batch: int, max_len: int, device: torch.device | str = "cpu"):
        super().__init__(batch, max_len, device)
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _update(self, i: int, k: torch.Tensor, v: torch.Tensor):
        self._check_update(i, k)
        if i not in self._layers:
            self._layers[i] = tuple(x.new_zeros(self.batch, x.shape[1], self.max_len, x.shape[3]) for x in (k, v))
        keys, values = self._layers[i]
        end = self.length + self._new
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        positions = torch.arange(self.length, end, device=k.device).expand(self.batch, self._new)
        return keys[:, :, :end], values[:, :, :end], positions  # views: nothing copied

    # ---------------------------------------------------------------- accounting
    def allocated_bytes(self) -> int:
        """Bytes reserved: every layer's slabs, max_len tokens per sequence."""
        return sum(x.numel() * x.element_size() for pair in self._layers.values() for x in pair)

    def used_bytes(self) -> int:
        """Bytes that hold cached tokens: ``length`` of the ``max_len`` reserved."""
        return self.allocated_bytes() * self.length // self.max_len


class LayerView:
    """Layer ``i``'s side of a cache: ``update(k, v) -> (all keys, all values, positions of the new tokens)``."""

    def __init__(self, cache, i: int):
        self.cache, self.i = cache, i

    def update(self, k: torch.Tensor, v: torch.Tensor):
        return self.cache._update(self.i, k, v)
