"""Weight sync: bucket planning (pure)."""

from pipelinerl_fsdp.transport.weights import layer_buckets


def test_buckets_keep_layers_whole_and_respect_the_limit():
    names = [("model.embed_tokens.weight", 100)]
    for i in range(4):
        names += [(f"model.layers.{i}.self_attn.q_proj.weight", 30), (f"model.layers.{i}.mlp.up_proj.weight", 40)]
    names += [("model.norm.weight", 5), ("lm_head.weight", 100)]
    buckets = layer_buckets(names, element_size=1, bucket_bytes=150)
    assert sorted(i for b in buckets for i in b) == list(range(len(names)))
    for b in buckets:
        layers = {names[i][0].split(".")[2] for i in b if names[i][0].startswith("model.layers.")}
        for layer in layers:  # every parameter of a layer is in the same bucket
            assert all(i in b for i, (n, _) in enumerate(names) if n.startswith(f"model.layers.{layer}."))
        assert sum(names[i][1] for i in b) <= 150
    assert len(buckets) >= 4


def test_each_buffer_slot_is_as_large_as_the_largest_bucket_it_carries():
    from pipelinerl_fsdp.transport.weights import slot_sizes

    # an embedding bucket (100) then layer buckets (30, 40, 30) then the head (100): slots alternate 0, 1, 0, 1, 0
    assert slot_sizes([100, 30, 40, 30, 100]) == [100, 30]
    # buckets sent from the parameter itself need no slot
    assert slot_sizes([100, 30, 40, 30, 100], [False, True, True, True, False]) == [40, 30]
    assert slot_sizes([7]) == [7]


def test_the_plan_holds_a_7b_vocabulary_bucket_once_not_twice():
    from pipelinerl_fsdp.configure import load_config
    from pipelinerl_fsdp.models import flavour_args
    from pipelinerl_fsdp.plan_sizes import weight_sync_buffers

    cfg = load_config(["--config", "math", "--job.stage=plan"])
    args = flavour_args("qwen2.5-7b")
    send, receive, largest = weight_sync_buffers(
        args, cfg.inference.dtype, cfg.world.weight_bucket_mb, sent_as_is=False
    )
    vocab = args.vocab_size * args.hidden_size * 2  # bf16 embedding = head (untied), each its own bucket
    assert largest == vocab
    # slot 0 carries the embedding (first bucket); the head lands in one slot too: at most 2 x vocab, at least vocab
    # plus a layer bucket, and not the 2 x 2 x vocab of two slots each the size of the largest bucket times two
    assert vocab < send <= 2 * vocab and receive == send
