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
