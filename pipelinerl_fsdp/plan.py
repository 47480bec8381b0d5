"""`--job.stage=plan`: the job's layout and memory per GPU, computed from the config before anything starts.

    python run_train.py --config math --job.stage=plan [--plan.nodes=16 --plan.gpus_per_node=8 ...]

No torchrun, no GPU, no weights: the model's shape comes from `model.path`'s config.json, or from `model.flavour`
when that folder is not there. Ranks are laid out as the job lays them out (trainers on the low ranks, one process
per GPU, each engine's `tensor_parallel_size` GPUs after its node's trainer GPUs). The estimates, per GPU:

trainer (FSDP2 over all trainer ranks): fp32 parameter, gradient and AdamW shards (16 bytes per parameter / N),
  the KL reference model's shard when `rl.kl_coef` > 0; the gathered blocks (the current one and the prefetched
  next, in the parameter dtype, plus the current block's full gradient in the reduce dtype); the root (embeddings,
  head) gathered for the whole step (fp32 with the fp32 head); unsharded fp32 gradients when
  `trainer.defer_grad_sync`; activations of one micro-batch of `trainer.micro_batch_tokens` tokens: per block
  and token, the tensors autograd keeps for our decoder block with flash-style attention (no score matrix),
  counted from the code as 7H + 2KV + heads + 4I + 2 head_dim + 2 elements (H hidden, I MLP, KV the key/value
  width; `tests/unit/test_plan.py` checks it against what autograd keeps), or, with activation checkpointing,
  each checkpointed block's input (H) plus one block recomputed during the backward pass; the log-prob chunks
  (three chunk x vocab fp32 buffers) and the final hidden states; attention's per-document outputs and their
  concatenation for one layer; the weight sync in the engine dtype, from the exact bucket layout (buckets of whole
  layers up to `world.weight_bucket_mb`; the first trainer's two send slots, each the largest bucket it carries;
  the largest parameter gathered on every other trainer). Host memory while loading: the largest tensor's rows
  converted from the file's dtype (the files are memory-mapped; the shards go straight to the GPU).
engine (vLLM): `gpu_memory_utilization` of the GPU for weights, activations and KV cache (activations and CUDA
  graphs are taken as 2 GiB: vLLM's profile decides the exact number at start-up); on top of it the weight sync's
  two receive slots and a copy of the vocabulary layers (embeddings, head) during an update, and in async mode a
  whole staged update per worker; and how many KV-cache tokens fit next to the weights, against `max_num_seqs` x
  `max_model_len`.
export: the final (and periodic) HF export gathers one full fp32 tensor at a time and moves it to the host of the
  first trainer rank, so it adds one tensor to a trainer GPU, not the model.
Under `[lora]` the items change as docs/lora.md ("Memory") lists: the frozen base in the parameter dtype, fp32
  adapters with their gradients and AdamW state, the adapters' activations, a push of the adapters (fp32); on
  the engines, the copy W0 of the targeted weights each one merges from.
Every GPU also loses ~1.5 GiB to the CUDA context and the allocator. The plan fails when a GPU's total exceeds its
memory, when an engine cannot hold one full-length sequence, or when a node has fewer GPUs than its ranks need.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipelinerl_fsdp.config import (
    Config,
    ConfigError,
    InferenceConfig,
    LoRAConfig,
    ModelConfig,
    PlanConfig,
    TaskConfig,
    TrainerConfig,
)
from pipelinerl_fsdp.inference.lora_merge import slab_layout
from pipelinerl_fsdp.inference.vllm_config import VLLMInferenceConfig
from pipelinerl_fsdp.job.world import rank_layout
from pipelinerl_fsdp.models.args import ModelArgs
from pipelinerl_fsdp.plan_sizes import (
    DTYPE_BYTES,
    attention_extra_bytes,
    block_activation_elements,
    engine_dtype_bytes,
    file_dtype_bytes,
    load_host_memory,
    lora_sizes,
    plan_model_args,
    weight_sync_buffers,
)

GIB = 1 << 30
# `trainer.micro_batch_tokens = "auto"`: on CPU today's budget; on GPU the largest of these the plan fits
CPU_MICRO_BATCH_TOKENS = 4096
GPU_MICRO_BATCH_TOKENS = (32768, 16384, 8192, 4096)
# ...within this share of `plan.gpu_memory_gib` (the estimate leaves out the allocator's fragmentation)
AUTO_MEMORY_SHARE = 0.9
CUDA_CONTEXT_GIB = 1.5
VLLM_ACTIVATIONS_GIB = 2.0
# pinned host-to-device copies, PCIe Gen4 x16 (~25 GB/s measured by CUDA's bandwidthTest; Gen5 about twice):
# what `lora.engine_base = "host"` pays per update, an estimate the plan prints as one
H2D_BYTES_PER_S = 25e9


@dataclass
class NodeLayout:
    node: int
    trainers: int
    engines: int
    gpus_needed: int


def procs_per_node(pl: PlanConfig) -> int:
    """Processes on every node (torchrun --nproc-per-node): `plan.procs_per_node`, else one per GPU."""
    return pl.procs_per_node or pl.gpus_per_node


def layout(pl: PlanConfig, n_inf: int, tp: int) -> list[NodeLayout]:
    """Trainer and engine ranks per node (`world.rank_layout`, `plan.procs_per_node` per node) for
    `world.inference_ranks` = `n_inf` engines of `tp` GPUs each."""
    procs = procs_per_node(pl)
    world = pl.nodes * procs
    if not 0 < n_inf < world:
        raise ConfigError(
            f"plan: world.inference_ranks = {n_inf} must be in [1, {world - 1}] for {pl.nodes} node(s) x "
            f"{procs} processes"
        )
    trainer_ranks = set(rank_layout(world, n_inf)[0])  # the job's rule (world.py)
    out = []
    for node in range(pl.nodes):
        ranks = range(node * procs, (node + 1) * procs)
        trainers = sum(r in trainer_ranks for r in ranks)
        engines = procs - trainers
        out.append(NodeLayout(node, trainers, engines, trainers + engines * tp))
    return out


def trainer_memory(
    tr: TrainerConfig,
    args: ModelArgs,
    n_trainers: int,
    checkpointing: bool,
    *,
    engine_dtype: str = "auto",
    bucket_mb: int = 64,
    kl_reference: bool = False,
    lora: LoRAConfig | None = None,
) -> dict[str, float]:
    """Bytes per trainer GPU by item (see the module docstring). `engine_dtype`: `inference.dtype`, `bucket_mb`:
    `world.weight_bucket_mb`, `kl_reference`: `rl.kl_coef > 0` (a frozen copy of the policy is kept; none under
    LoRA), `lora`: the `[lora]` section (enabled: only adapters train). The trainer's "auto" keys must be decided first
    (`resolve_trainer_defaults`)."""
    if tr.micro_batch_tokens == "auto" or tr.defer_grad_sync == "auto":
        raise ValueError("trainer_memory: decide trainer.micro_batch_tokens / defer_grad_sync first")
    p = args.num_params()
    h, v, layers = args.hidden_size, args.vocab_size, args.num_hidden_layers
    root = v * h * (1 if args.tie_word_embeddings else 2) + h
    block = (p - root) / layers
    pbytes = 4 if tr.param_dtype == "float32" else 2  # "auto" on GPU: bf16
    fp32_head = tr.fp32_head == "on"  # "auto" gathers the root in the param dtype (fp32 logits from bf16 operands)
    rbytes = DTYPE_BYTES[tr.reduce_dtype]
    ebytes = engine_dtype_bytes(engine_dtype)
    t = tr.micro_batch_tokens
    lora = lora if lora is not None and lora.enabled else None
    # adapters: elements in all (pl) and per block, and the bytes per token one block's adapters keep for the
    # backward pass: A's output (rank per targeted linear) and, with dropout, its output and mask (the input widths)
    pl, block_l, lora_act = 0, 0.0, 0.0
    if lora is not None:
        sizes = lora_sizes(args, lora)
        pl, widths = sum(n for _, n in sizes.adapters), sizes.widths
        block_l = pl / layers
        lora_act = lora.rank * len(lora.target_modules) * pbytes + (widths * (pbytes + 1) if lora.dropout > 0 else 0)
    # FSDP2 keeps the sharded (master) parameters in fp32 whatever param_dtype: only an fp32 engine takes them as-is
    # (the adapters travel in fp32)
    as_is = n_trainers == 1 and (ebytes == 4 or lora is not None)
    send, _, largest = weight_sync_buffers(args, engine_dtype, bucket_mb, as_is, lora)
    act = block_activation_elements(args) * pbytes + lora_act
    if checkpointing:
        every = tr.ac_every
        kept = sum(1 for i in range(layers) if i % every == 0)
        activations = t * (kept * h * pbytes + (layers - kept) * act + act)
    else:
        activations = t * layers * act
    trained, of = (pl, " of the adapters") if lora is not None else (p, "")  # what has gradients, AdamW state
    out = {"parameters (fp32 shard)": 4 * p / n_trainers}
    if lora is not None:  # the base frozen in the parameter dtype (training/policy.py: frozen_base_dtype)
        out = {f"base parameters (frozen, {'fp32' if pbytes == 4 else 'bf16'} shard)": pbytes * p / n_trainers}
        out["LoRA adapters (fp32 shard)"] = 4 * pl / n_trainers
    out |= {
        f"gradients{of} (fp32 shard)": 4 * trained / n_trainers,
        f"AdamW state{of} (fp32 shard)": 8 * trained / n_trainers,
        # under LoRA the reference is the policy with its adapters off: no copy
        "KL reference (fp32 shard)": 4 * p / n_trainers if kl_reference and lora is None else 0.0,
        # the block's gradient: of its adapters only under LoRA
        "gathered blocks (2) + block gradient": 2 * (block + block_l) * pbytes + (block_l if lora else block) * rbytes,
        f"root: embeddings + head ({'fp32' if fp32_head else 'param dtype'})": root * (4 if fp32_head else pbytes),
        f"unsharded gradients{of} (defer_grad_sync)": 4 * trained if tr.defer_grad_sync else 0.0,
        f"activations ({t} tokens, {'checkpointed' if checkpointing else 'no checkpointing'})": activations,
        "attention: document outputs + their concatenation (one layer)": attention_extra_bytes(args, t, pbytes),
        "log-prob chunks + final hidden": 3 * tr.logprob_chunk_size * v * 4 + t * h * 4,
        "weight sync: send buffers (first trainer)": send,
        "weight sync: one gathered parameter outside the buffers": largest if n_trainers > 1 else 0.0,
        "CUDA context, allocator": CUDA_CONTEXT_GIB * GIB,
    }
    return out


def auto_trainer_settings(
    tr: TrainerConfig, args: ModelArgs, n_trainers: int, gpu_bytes: float, **sync: object
) -> tuple[int, bool]:
    """(micro_batch_tokens, defer_grad_sync) for a GPU trainer, each "auto" one chosen with the plan: the largest
    budget of GPU_MICRO_BATCH_TOKENS, deferring the gradient sync where that budget still fits with the unsharded
    gradients, whose planned trainer memory (`trainer_memory`, with the trainer's activation checkpointing; `sync`:
    its keyword arguments) stays within AUTO_MEMORY_SHARE of `gpu_bytes`; the smallest, not deferred, when none
    fits (the plan stage then names the problem). A key already set keeps its value."""
    tokens = GPU_MICRO_BATCH_TOKENS if tr.micro_batch_tokens == "auto" else (tr.micro_batch_tokens,)
    defers = (True, False) if tr.defer_grad_sync == "auto" else (tr.defer_grad_sync,)
    checkpointing = tr.activation_checkpointing == "full"
    for t in tokens:
        for defer in defers:
            trial = replace(tr, micro_batch_tokens=t, defer_grad_sync=defer)
            if _total(trainer_memory(trial, args, n_trainers, checkpointing, **sync)) <= AUTO_MEMORY_SHARE * gpu_bytes:
                return int(t), bool(defer)
    return int(tokens[-1]), bool(defers[-1])


def resolve_trainer_defaults(
    tr: TrainerConfig, model: ModelConfig, n_trainers: int, on_gpu: bool, gpu_bytes: float, **sync: object
) -> None:
    """Decide `trainer.micro_batch_tokens` and `trainer.defer_grad_sync` where they are "auto", by the trainers'
    device: on CPU CPU_MICRO_BATCH_TOKENS, not deferred (the values before these keys had "auto"); on GPU
    `auto_trainer_settings` for `gpu_bytes` (`plan.gpu_memory_gib`; `sync`: `trainer_memory`'s keyword arguments).
    Called before anything reads them and before the run's config.toml is written, so that it holds the values
    used; every rank decides the same from the same inputs."""
    if tr.micro_batch_tokens != "auto" and tr.defer_grad_sync != "auto":
        return
    tokens, defer = CPU_MICRO_BATCH_TOKENS, False
    if on_gpu:
        tokens, defer = auto_trainer_settings(tr, plan_model_args(model)[0], n_trainers, gpu_bytes, **sync)
    if tr.micro_batch_tokens == "auto":
        tr.micro_batch_tokens = tokens
    if tr.defer_grad_sync == "auto":
        tr.defer_grad_sync = defer


def engine_memory(
    inf: VLLMInferenceConfig,
    args: ModelArgs,
    max_model_len: int,
    gpu_memory_gib: float,
    bucket_mb: int,
    staged_update: bool,
    lora: LoRAConfig | None = None,
) -> tuple[dict[str, float], int, int]:
    """(bytes per engine GPU by item, KV-cache tokens that fit, tokens the engine's slots can ask for) on a GPU of
    `plan.gpu_memory_gib`. `bucket_mb`: `world.weight_bucket_mb`; `staged_update`: async mode (a whole update held
    until loaded); `lora` enabled: pushes carry fp32 adapters, merged into the engine's weights from its own copy
    W0 of the targeted weights (kept whole on every worker, in the engine dtype, as its files hold them: on its GPU,
    or in host memory under `lora.engine_base = "host"`; "auto" must be decided first, `resolve_engine_base`)."""
    tp = inf.tensor_parallel_size
    gpu = gpu_memory_gib * GIB
    ebytes = engine_dtype_bytes(inf.dtype)
    p = args.num_params()
    h, v = args.hidden_size, args.vocab_size
    root = v * h * (1 if args.tie_word_embeddings else 2) + h
    lora = lora if lora is not None and lora.enabled else None
    if lora is not None and lora.engine_base == "auto":
        raise ValueError("engine_memory: lora.engine_base is still 'auto' (resolve_engine_base decides it)")
    _, receive, _ = weight_sync_buffers(args, inf.dtype, bucket_mb, sent_as_is=False, lora=lora)
    pushed = p * ebytes  # a whole update's bytes
    if lora is not None:
        sizes = lora_sizes(args, lora)
        pushed, root = 4 * sum(n for _, n in sizes.adapters), 0  # adapters only: the vocabulary layers never travel
    weights = p * ebytes / tp
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    kv_per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * hd * ebytes / tp
    budget = inf.gpu_memory_utilization * gpu
    kv = max(0.0, budget - weights - VLLM_ACTIVATIONS_GIB * GIB)
    items = {
        "vLLM budget (gpu_memory_utilization)": budget,
        "  of which weights": weights,
        "  of which activations, CUDA graphs (est.)": VLLM_ACTIVATIONS_GIB * GIB,
        "  of which KV cache": kv,
        "weight sync: receive buffers (2 slots) + vocabulary copies": receive + root * ebytes,
        # async mode receives a whole update while generating and loads it later: every worker holds one full copy
        # (HF shapes, not its tensor-parallel shard), outside vLLM's budget
        "weight sync: a whole staged update (rl.mode = 'async')": pushed if staged_update else 0.0,
    }
    if lora is not None:
        # the targets and their untargeted siblings in vLLM's fused q/k/v and gate/up (loaded with their W0); in
        # host memory (`lora.engine_base = "host"`) one weight at a time comes to the GPU
        on_gpu = lora.engine_base != "host"
        w0 = "LoRA: the base copy W0 of the targeted weights (engine dtype)"
        items[w0 if on_gpu else "LoRA: W0 in host memory, one weight of it on the GPU"] = (
            sizes.w0 if on_gpu else max(sizes.targeted)
        ) * ebytes
        # merged_weight on the largest one: W0 upcast, B A and s B A in fp32, alive at once
        items["LoRA: merging one weight (3 fp32 copies of the largest targeted)"] = 12 * max(sizes.targeted)
    items["CUDA context, allocator"] = CUDA_CONTEXT_GIB * GIB
    return items, int(kv // kv_per_token), inf.max_num_seqs * max_model_len


def resolve_engine_base(
    lora: LoRAConfig,
    on_gpu: bool,
    inf: VLLMInferenceConfig | None = None,
    args: ModelArgs | None = None,
    gpu_memory_gib: float = 0.0,
    bucket_mb: int = 0,
    staged_update: bool = False,
) -> None:
    """Decide `lora.engine_base` where it is "auto": "device" for engines off the GPU (host and device are one
    memory there) and where the engine GPU fits with W0 (`engine_memory`'s items within AUTO_MEMORY_SHARE of
    `gpu_memory_gib`: the estimate leaves out the allocator's fragmentation), else
    "host" (W0 pinned in host memory, each weight moved to the GPU as it is merged). The other arguments are
    `engine_memory`'s, needed only `on_gpu` (not max_model_len: vLLM's budget is a share of the GPU whatever the
    length, so the engine's total does not depend on it). Called before the run's config.toml is written, so that
    it holds the value used; every rank decides the same from the same inputs."""
    if not lora.enabled or lora.engine_base != "auto":
        return
    lora.engine_base = "device"
    if on_gpu:
        assert inf is not None and args is not None, "a GPU engine's choice needs its memory plan's inputs"
        items, _, _ = engine_memory(inf, args, 0, gpu_memory_gib, bucket_mb, staged_update, lora)
        if _total(items) > AUTO_MEMORY_SHARE * gpu_memory_gib * GIB:  # the trainer's "auto" keeps this margin too
            lora.engine_base = "host"


def engine_max_model_len(inf: InferenceConfig, task: TaskConfig) -> int:
    """The engines' max_model_len as the plan can know it without reading the data."""
    if inf.max_model_len:
        return inf.max_model_len
    cap = getattr(task, "max_prompt_tokens", 0)
    if not cap:
        raise ConfigError("plan: set inference.max_model_len or task.max_prompt_tokens (the engines' sequence length)")
    return cap + task.max_new_tokens


def _total(items: dict[str, float]) -> float:
    return sum(v for k, v in items.items() if not k.startswith("  "))


def make_plan(cfg: Config) -> tuple[str, list[str]]:
    """The plan as text, and the reasons it does not fit (empty: it fits)."""
    inf = cfg.inference
    if not isinstance(inf, VLLMInferenceConfig):
        raise ConfigError(f"plan: lays out vLLM engines on GPUs; inference.engine = {inf.engine!r}")
    args, source = plan_model_args(cfg.model)
    pl = cfg.plan
    gpu = pl.gpu_memory_gib * GIB
    nodes = layout(pl, cfg.world.inference_ranks, inf.tensor_parallel_size)
    n_trainers = sum(n.trainers for n in nodes)
    lora = cfg.lora if cfg.lora.enabled else None
    sync = {"engine_dtype": inf.dtype, "bucket_mb": cfg.world.weight_bucket_mb, "kl_reference": cfg.rl.kl_coef > 0}
    sync["lora"] = lora
    resolve_trainer_defaults(cfg.trainer, cfg.model, n_trainers, True, gpu, **sync)  # a plan is for GPUs
    problems = []
    lines = [
        f"plan: {pl.nodes} node(s) x {pl.gpus_per_node} GPUs of {pl.gpu_memory_gib:g} GiB; model from {source}: "
        f"{args.num_params() / 1e9:.2f}B parameters, {args.num_hidden_layers} layers, hidden {args.hidden_size}",
    ]
    if lora is not None:
        n_lora = sum(n for _, n in lora_sizes(args, lora).adapters)
        lines.append(
            f"LoRA: rank {lora.rank} on {', '.join(lora.target_modules)}: {n_lora / 1e6:.1f}M adapter parameters "
            f"trained and pushed ({4 * n_lora / GIB:.2f} GiB in fp32 per update)"
        )
    lines += [
        "",
        "| node | trainer ranks | engine ranks (x tp) | GPUs used |",
        "|---|---|---|---|",
    ]
    runs: list[list[NodeLayout]] = []  # consecutive nodes with the same layout share a row
    for n in nodes:
        if runs and (runs[-1][0].trainers, runs[-1][0].engines) == (n.trainers, n.engines):
            runs[-1].append(n)
        else:
            runs.append([n])
    for run in runs:
        n = run[0]
        name = f"{n.node}" if len(run) == 1 else f"{n.node}-{run[-1].node}"
        lines.append(
            f"| {name} | {n.trainers} | {n.engines} (x{inf.tensor_parallel_size}) | "
            f"{n.gpus_needed} of {pl.gpus_per_node} |"
        )
        if n.gpus_needed > pl.gpus_per_node:
            why = ""
            if n.engines and inf.tensor_parallel_size > 1:
                why = (
                    f": each engine rank takes {inf.tensor_parallel_size} GPUs (tensor_parallel_size), "
                    f"and the launch scripts start the same number of processes ({procs_per_node(pl)}) on every "
                    "node, so engine nodes cannot be filled by fewer, wider ranks; lower plan.procs_per_node "
                    "(NPROC_PER_NODE) on every node, or inference.tensor_parallel_size"
                )
            problems.append(f"node(s) {name} need {n.gpus_needed} GPUs and have {pl.gpus_per_node}{why}")
    lines.append("")
    ac = cfg.trainer.activation_checkpointing == "full"
    plain = trainer_memory(cfg.trainer, args, n_trainers, False, **sync)
    ckpt = trainer_memory(cfg.trainer, args, n_trainers, True, **sync)
    chosen = ckpt if ac else plain
    lines += [
        f"trainer GPU (FSDP2 over {n_trainers} ranks; trainer.activation_checkpointing = "
        f"{cfg.trainer.activation_checkpointing!r}):",
        "",
        "| item | GiB |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v / GIB:.2f} |" for k, v in chosen.items()]
    lines.append(f"| **total** | **{_total(chosen) / GIB:.2f}** of {pl.gpu_memory_gib:g} |")
    other = "with" if not ac else "without"
    lines.append(f"| (total {other} activation checkpointing) | {_total(ckpt if not ac else plain) / GIB:.2f} |")
    stored = 4 if lora is None or cfg.trainer.param_dtype == "float32" else 2  # a frozen base: bf16 on GPU
    host = sum(load_host_memory(args, n_trainers, file_dtype_bytes(cfg.model), stored, on_gpu=True).values())
    lines.append(f"| (host memory per trainer rank while loading its shards; not on the GPU) | {host / GIB:.2f} |")
    if _total(chosen) > gpu:
        problems.append(
            f"a trainer GPU needs {_total(chosen) / GIB:.1f} GiB of {pl.gpu_memory_gib:g} (lower "
            "trainer.micro_batch_tokens, set trainer.activation_checkpointing = 'full', or add trainer ranks)"
        )
    max_len = engine_max_model_len(inf, cfg.task)
    staged, auto = cfg.rl.mode == "async", lora is not None and lora.engine_base == "auto"
    bucket_mb = cfg.world.weight_bucket_mb
    if lora is not None:
        resolve_engine_base(lora, True, inf, args, pl.gpu_memory_gib, bucket_mb, staged)
    eng, kv_tokens, wanted = engine_memory(inf, args, max_len, pl.gpu_memory_gib, bucket_mb, staged, lora)
    lines += [
        "",
        f"engine GPU (vLLM, tensor_parallel_size {inf.tensor_parallel_size}, max_model_len {max_len}):",
        "",
        "| item | GiB |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v / GIB:.2f} |" for k, v in eng.items()]
    lines.append(f"| **total** | **{_total(eng) / GIB:.2f}** of {pl.gpu_memory_gib:g} |")
    lines.append(
        f"| KV-cache tokens that fit | {kv_tokens} ({kv_tokens / max(wanted, 1):.2f}x the {wanted} that "
        f"max_num_seqs {inf.max_num_seqs} x max_model_len {max_len} can ask for) |"
    )
    if lora is not None and lora.engine_base == "host":
        sizes, ebytes = lora_sizes(args, lora), engine_dtype_bytes(inf.dtype)
        w0, pinned = sizes.w0 * ebytes, sum(slab_layout([n * ebytes for n in sizes.w0_each])[0])
        lines.append(f"| (host memory per engine worker: W0 in pinned slabs; not on the GPU) | {pinned / GIB:.2f} |")
        lines.append(
            f"\nLoRA: the engines keep W0 in host memory (lora.engine_base = 'host'{', chosen by auto' if auto else ''}"
            f"): each update moves its {w0 / GIB:.2f} GiB to the GPU, ~{w0 / H2D_BYTES_PER_S:.1f} s at "
            f"{H2D_BYTES_PER_S / 1e9:g} GB/s (pinned host-to-device copies over PCIe Gen4 x16, est.)"
        )
    if _total(eng) > gpu:
        problems.append(
            f"an engine GPU needs {_total(eng) / GIB:.1f} GiB of {pl.gpu_memory_gib:g} (the weight sync's receive "
            "buffers, and in async mode a whole staged update, sit beside vLLM's budget"
            + (", as does LoRA's copy W0 of the targeted weights" if lora else "")
            + ": lower inference.gpu_memory_utilization or world.weight_bucket_mb, or use rl.mode = 'pipeline'"
            + (", or target fewer lora.target_modules" if lora else "")
            + (", or set lora.engine_base = 'host')" if lora and lora.engine_base == "device" else ")")
        )
    if kv_tokens < max_len:
        problems.append(f"an engine's KV cache holds {kv_tokens} tokens, less than one sequence of {max_len}")
    lines.append("")
    lines.append("fits" if not problems else "does NOT fit:\n  - " + "\n  - ".join(problems))
    return "\n".join(lines), problems
