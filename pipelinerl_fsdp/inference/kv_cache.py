"""A slot-based KV cache for the pure-PyTorch decoder: sequences live in slots, join by prefill, leave by `free`.

Prefill runs several new sequences packed in one row (attention confined to each) and stores their keys and
values into their slots; a decode step appends one token to each active slot and attends over the slot's cache; an
extension appends several tokens to one slot (a multi-turn episode's next turn continuing a kept cache). A finished
sequence's cache can be copied out (`park`) and back into a slot later (`restore`).
"""

from __future__ import annotations

import torch

from pipelinerl_fsdp.models.args import ModelArgs


class KVCache:
    """Keys/values [layers, slots, kv_heads, max_len, head_dim] and the filled length of each slot."""

    def __init__(
        self,
        args: ModelArgs,
        num_slots: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (args.num_hidden_layers, num_slots, args.num_key_value_heads, max_len, args.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.max_len = max_len
        self.decoding = False
        self._slots: torch.Tensor | None = None
        self._span: slice | None = None  # the decode step's slots as a range, when they are one
        self._prefill_lengths: list[int] = []
        self._step = 1  # tokens a decode step appends per slot (more for an extension)

    # ---- prefill -----------------------------------------------------------------------------------------
    def begin_prefill(self, slots: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare to prefill `slots` (empty) with packed sequences of `lengths`; returns (slots, position_ids)."""
        if max(lengths) > self.max_len:
            raise ValueError(f"sequence of {max(lengths)} tokens does not fit the KV cache (max_len {self.max_len})")
        self.decoding = False
        self._slots = torch.tensor(slots, dtype=torch.long, device=self.lengths.device)
        self._prefill_lengths = list(lengths)
        pos = torch.cat([torch.arange(n, device=self.lengths.device) for n in lengths])[None]
        return self._slots, pos

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [1, kv_heads, total_len, head_dim] of the packed prefill row."""
        assert self._slots is not None
        start = 0
        for slot, n in zip(self._slots.tolist(), self._prefill_lengths):
            self.k[layer, slot, :, :n] = k[0, :, start : start + n]
            self.v[layer, slot, :, :n] = v[0, :, start : start + n]
            start += n

    def end_prefill(self) -> None:
        assert self._slots is not None
        self.lengths[self._slots] = torch.tensor(self._prefill_lengths, device=self.lengths.device)
        self._slots = None

    # ---- decode ------------------------------------------------------------------------------------------
    def begin_decode(self, slots: torch.Tensor) -> torch.Tensor:
        """Prepare one decode step for `slots`; returns position_ids [n, 1] of the new tokens."""
        if int(self.lengths[slots].max()) >= self.max_len:
            raise ValueError(f"KV cache full: a sequence reached max_len {self.max_len}")
        self.decoding = True
        self._slots, self._step = slots, 1
        # Slots in ascending order with no gap (the reference engine keeps its running sequences in the lowest
        # slots) are read as a view, not gathered: the gather copied every layer's K/V for every decoded token.
        lo, n = int(slots[0]), slots.numel()
        contiguous = n == 1 or bool((slots.diff() == 1).all())
        self._span = slice(lo, lo + n) if contiguous else None
        return self.lengths[slots][:, None]

    def begin_extend(self, slot: int, n: int) -> torch.Tensor:
        """Prepare to append `n` tokens to the filled `slot` in one forward (causal among themselves, attending to
        everything cached before them); returns their position_ids [1, n]."""
        start = int(self.lengths[slot])
        if start + n > self.max_len:
            raise ValueError(f"sequence of {start + n} tokens does not fit the KV cache (max_len {self.max_len})")
        self.decoding = True
        self._slots = torch.tensor([slot], dtype=torch.long, device=self.lengths.device)
        self._span, self._step = slice(slot, slot + 1), n
        return torch.arange(start, start + n, device=self.lengths.device)[None]

    def attend_keys(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append k, v [n, kv_heads, 1, head_dim] (an extension: [1, kv_heads, t, head_dim]) and return all
        keys/values of the slots plus their mask."""
        slots = self._slots
        assert slots is not None
        if self._step > 1:
            slot, start, t = int(slots[0]), int(self.lengths[slots[0]]), self._step
            self.k[layer, slot, :, start : start + t] = k[0]
            self.v[layer, slot, :, start : start + t] = v[0]
            width = start + t
            keys = torch.arange(width, device=k.device)
            mask = keys[None, :] <= keys[start:, None]  # token start+i sees the cache and the new tokens up to it
            rows = slice(slot, slot + 1)
            return self.k[layer, rows, :, :width], self.v[layer, rows, :, :width], mask[None, None]
        pos = self.lengths[slots]
        self.k[layer, slots, :, pos] = k[:, :, 0]
        self.v[layer, slots, :, pos] = v[:, :, 0]
        width = int(pos.max()) + 1
        mask = torch.arange(width, device=pos.device)[None, :] <= pos[:, None]
        rows = slots if self._span is None else self._span
        return self.k[layer, rows, :, :width], self.v[layer, rows, :, :width], mask[:, None, None, :]

    def end_decode(self) -> None:
        assert self._slots is not None
        self.lengths[self._slots] += self._step
        self.decoding = False
        self._slots = self._span = None
        self._step = 1

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Move the sequence in slot `src` to the empty slot `dst` (its filled keys/values and length); frees `src`."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0

    def park(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the keys and values `slot` holds ([layers, kv_heads, length, head_dim] each)."""
        n = int(self.lengths[slot])
        return self.k[:, slot, :, :n].clone(), self.v[:, slot, :, :n].clone()

    def restore(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill the empty `slot` with parked keys and values (`park`)."""
        n = k.shape[2]
        self.k[:, slot, :, :n] = k
        self.v[:, slot, :, :n] = v
        self.lengths[slot] = n
