"""benchlib: the benchmark code behind `experiments/*.py`, beside them and
outside the installed `jaxinfer` package (a script finds it on `sys.path`,
the tests through pytest's `pythonpath`). It uses jaxinfer's public names
only (the Engine's device state through `jaxinfer.engine.inspect`;
`tests/repo/test_benchlib_api.py` checks it). One line per entry point, by
concept; each module's docstring says more.

The command line (every script):
  cli.run(main)                         quiet logs, terminal-only colour
  flag_config.define_config / apply_config   `--config=configs/<file>.py`, `--config.<field>=`
  model_flags.define / define_preset    --model, --hf_dir, --checkpoint_dir
  results.write / write_report          the JSON with its device, a plot beside it
  results.machine_info / spread         the machine a result ran on; tokens/s samples' spread

Timing and the roofline:
  kernel_timing.time_calls / rel_err / measure_roofline   one clock for every kernel timing
  decode.run_decode_bench               Engine decode / prefill tokens/s vs HF, memory roofline
  decode_roofline.decode_bytes_per_step / measure_bandwidth   a decode step's memory roofline
  traffic.paged_traffic / flash_traffic   FLOPs and HBM bytes of an attention call, from shapes

Peers (vLLM, torch, transformers):
  vllm_compare (VllmOffline, serve_run, summarize)   jaxinfer against vLLM's CPU build
  hf_peer.bench_hf / hf_model           transformers on this CPU as the decode peer
  torch_peer.measure_generate           transformers' generate as the decode peer on a GPU
  tool_runs.run                         guidellm and aiperf against serve.py

Kernels:
  kernels.run_kernel_bench              the kernels against peers and the measured roofline
  kernel_peers.BUILDERS                 each kernel's cases (ours, peers, reference)
  kernel_case.Case / Impl               what a case is; kernel_gmm.gmm_cases: the MoE matmul's
  kernel_report.run_report              compiled H100 resources per kernel case
  gpu_cases.build                       the seed models' kernel shapes as compile cases

Rooflines and HLO reports (compiled for GPUs on a CPU machine):
  gpu_plan.run_gpu_plan                 the Engine's steps: memory, FLOPs, bytes, roofline
  hlo_report.read / collectives         a compiled step's kernels, copies, collectives (HLO)
  gpu_executable.kernel_launches        launch shapes and resources of a compiled executable
  ep_bytes.report                       wide-EP exchange bytes per MoE layer
  sharding_report.run_sharding_report   bytes per device and collectives on a mesh
  wan_plan.wan_step_plan                a WAN-2.2 denoising step compiled for GPUs

The GPU day (a lent GPU, time-boxed):
  gpu_day (run_tests_part, run_kernels_part, run_engine_part, summary)
  gpu_engine.run_engine_bench           the Engine at real widths on one GPU
  trace_top.trace_top                   a profiler trace's top kernels

Simulator studies (`jaxinfer/sim/`):
  sim_calibration.calibrate_check       fit this machine's step times, predict the Engine
  sim_scale.scale_study                 DeepSeek-R1 on 8..288 GPUs
  sim_mlperf.mlperf_study               MLPerf's published GB300 rows, predicted

Engine studies on CPU:
  host_profile.run / host_overlap.run   a decode step's host time; host vs device overlap
  dp_balance.compare                    attention-DP step balance policies
  kv_quant.kv_quant_agreement           fp8 / int8 KV cache against full precision
  quant_error.report                    weight-only quantization error
  moe_prefill.run                       the routed experts' paths at 8-2048 tokens
  linear_forms.measure                  XLA:CPU's ways to multiply a few rows
  vl_encoder.encoder_cache_bench        the vision encoder cache's hit rate and tokens/s

Serving tools:
  cold_start.run                        serve.py's start from an empty and a warm cache

What each script calls (besides cli, flag_config, model_flags, results):
  bench_decode: decode.run_decode_bench     bench_speculative: sharding_report.parse_mesh
  bench_vs_vllm: vllm_compare               cold_start: cold_start.run
  dp_balance: dp_balance.compare            ep_bytes: ep_bytes.report
  generate, mlperf_harness: sharding_report.parse_mesh (the rest is jaxinfer's)
  gpu_day: gpu_day, kernels                 gpu_plan: gpu_plan.run_gpu_plan
  host_overlap: host_overlap.run            host_profile: host_profile.run
  kernel_bench: kernels.run_kernel_bench    kernel_report: kernel_report.run_report
  kv_quant: kv_quant.kv_quant_agreement     moe_prefill: moe_prefill.run
  mosaic_tune: kernel_peers, kernel_timing  quant_error: quant_error.report
  sharding_report: sharding_report.run_sharding_report
  simulate_cluster: sim_calibration, sim_scale, sim_mlperf
  tool_runs: tool_runs.run                  vl_encoder_cache: vl_encoder.encoder_cache_bench
  weight_layout: jaxinfer                   linear_forms: linear_forms (its child processes)
  check_hf, dlrm_loadgen, dlrm_memory_plan, kv_transfer_bench, repeat_tests, sampling_bench,
  serve, serve_bench, soak, train_tiny, weights_memory: jaxinfer (and the command line) only
"""
