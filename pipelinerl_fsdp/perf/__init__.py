"""The job's performance model: what a layout of engines and trainer GPUs will do, before running it
([docs/performance_model.md](../../docs/performance_model.md)).

- `perf/costs.py`: the cost models, `DecodeCost` (an engine's decode step), `TrainCost` (a trainer step),
  `PushCost` (a weight update: the trainer's transfer, the engine's pause);
- `perf/spec.py`: those costs from a GPU's datasheet (`GpuSpec`: `H100_SXM`, `H200_SXM`, `A100_80GB`) and the
  model's shape (`ModelShape.flavour("qwen2.5-7b")`), every assumption a named parameter;
- `perf/profile.py`: those costs from a measured profile (JSON written by the micro-benchmarks), and the
  non-negative least-squares fits from measured points (`fit_decode`, `fit_train`);
- `perf/lengths.py`: completion-length distributions (`Empirical`, `PowerLaw`, `Uniform`);
- `perf/simulate.py`: the discrete-event simulator of the job per `rl.mode` (`simulate`, `SimConfig`, `SimCosts`,
  `SimResult`), over `perf/engine_sim.py` (the engines, the event queue, the push) and `perf/lags.py` (token lags
  from version histories).

Only the standard library and numpy (and the model flavours' shapes, imported when asked for). Usage:

    from pipelinerl_fsdp.perf.lengths import PowerLaw
    from pipelinerl_fsdp.perf.simulate import SimConfig, SimCosts, simulate
    from pipelinerl_fsdp.perf.spec import H100_SXM, ModelShape, decode_from_spec, push_from_spec, train_from_spec

    shape = ModelShape.flavour("qwen2.5-7b")
    costs = SimCosts(decode_from_spec(shape, H100_SXM), train_from_spec(shape, H100_SXM, gpus=80),
                     push_from_spec(shape, H100_SXM, trainer_gpus=80))
    cfg = SimConfig(mode="pipeline", engines=48, slots=256, batch_size=4096, attempts=16, steps=100,
                    prompt_tokens=256, max_new_tokens=8192)
    r = simulate(cfg, costs, PowerLaw(alpha=1.0, lo=64, hi=8192), seed=0)
    print(r.samples_per_s, r.lag_p90, r.engine_occupancy, r.engine_paused_frac)
"""
