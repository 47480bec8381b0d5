"""The KV cache's decode read: a contiguous run of slots is a view of the cache (no copy), any other set is
gathered; both return the same keys, values and mask."""

import pytest
import torch

from pipelinerl_fsdp.inference.kv_cache import KVCache
from pipelinerl_fsdp.models import flavour_args

ARGS = flavour_args("debug", vocab_size=40)


def filled_cache(lengths: list[int]) -> KVCache:
    cache = KVCache(ARGS, num_slots=len(lengths), max_len=16)
    g = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.lengths[:] = torch.tensor(lengths)
    return cache


def step(cache: KVCache, slots: list[int], gather: bool = False) -> tuple[torch.Tensor, ...]:
    """One decode step of layer 0 for `slots` (new keys/values from a fixed seed); `gather` forces the copy."""
    n, kv, hd = len(slots), ARGS.num_key_value_heads, ARGS.head_dim
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(n, kv, 1, hd, generator=g), torch.randn(n, kv, 1, hd, generator=g)
    cache.begin_decode(torch.tensor(slots))
    if gather:
        cache._span = None
    out = cache.attend_keys(0, k, v)
    cache.end_decode()
    return out


@pytest.mark.parametrize("slots, view", [([1, 2, 3], True), ([0], True), ([0, 2, 3], False), ([3, 2], False)])
def test_decode_reads_a_contiguous_run_in_place(slots, view):
    lengths = [5, 3, 7, 2]
    a = filled_cache(lengths)
    k, v, mask = step(a, slots)
    assert (k.untyped_storage().data_ptr() == a.k.untyped_storage().data_ptr()) == view
    # the same values as the gather, the new token written at each slot's length, masked past it
    kk, vv, mm = step(filled_cache(lengths), slots, gather=True)
    torch.testing.assert_close(k, kk)
    torch.testing.assert_close(v, vv)
    assert torch.equal(mask, mm)
    assert mask[:, 0, 0].sum(-1).tolist() == [lengths[s] + 1 for s in slots]
    assert a.lengths.tolist() == [n + (i in slots) for i, n in enumerate(lengths)]


def test_an_extension_over_a_parked_cache_gives_the_full_forwards_logits():
    """A sequence prefilled, parked, restored into another slot and extended by several tokens in one forward:
    the logits of the new tokens equal one forward over the whole sequence (as the next turn of an episode sees
    them), and the slot's length counts the new tokens."""
    from pipelinerl_fsdp.models import build_model

    model = build_model(ARGS, seed=0).eval()
    seq = torch.randint(0, ARGS.vocab_size, (1, 13), generator=torch.Generator().manual_seed(2))
    cache = KVCache(ARGS, num_slots=3, max_len=16)
    with torch.no_grad():
        full = model(seq)[0]
        _, pos = cache.begin_prefill([1], [8])
        model(seq[:, :8], pos, cache=cache)
        cache.end_prefill()
        k, v = cache.park(1)
        cache.free(1)
        cache.restore(2, k, v)
        pos = cache.begin_extend(2, 5)
        assert pos.tolist() == [[8, 9, 10, 11, 12]]
        out = model(seq[:, 8:], pos, cache=cache)[0]
        cache.end_decode()
    torch.testing.assert_close(out, full[8:], atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [0, 0, 13] and not cache.decoding
    with pytest.raises(ValueError, match="does not fit"):
        cache.begin_extend(2, 4)
