#!/usr/bin/env bash
# Runs on the H200 device machine (torch 2.11 / triton 3.6 there; no install needed: the package is pure Python).
# Usage: bash scripts/gpu_all.sh [tests] [kernels] [decode] [train] ...   (default: tests kernels)
# Logs and JSON land in $OUT (or ./gpu_out when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(tests kernels)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee -a "$OUT/gpu.txt"
for s in "${stages[@]}"; do
  echo "=== stage $s ($(date -u +%T)) ==="
  case "$s" in
    tests)   timeout "${TESTS_TIMEOUT:-3000}" python3 -m pytest -v -m gpu tests/gpu -p no:cacheprovider 2>&1 \
               | tee "$OUT/gpu_tests.log" | grep -v PASSED | tail -40 ;;
    tests1|tests2)  # the suite in two halves, each inside one 10-minute call (the whole took over 10 min in session 49)
      first=(tests/gpu/test_engine_*.py tests/gpu/test_fused_helpers_gpu.py tests/gpu/test_host_gpu.py
             tests/gpu/test_losses_gpu.py tests/gpu/test_moe_*.py tests/gpu/test_msa_attention_gpu.py)
      if [ "$s" = tests1 ]; then files=("${first[@]}")
      else files=(); for f in tests/gpu/test_*.py; do [[ " ${first[*]} " == *" $f "* ]] || files+=("$f"); done; fi
      timeout "${TESTS_TIMEOUT:-580}" python3 -m pytest -v -m gpu "${files[@]}" -p no:cacheprovider --durations 10 \
        2>&1 | tee "$OUT/gpu_$s.log" | grep -v PASSED | tail -40 ;;
    tests:*)  # tests:PATHS (split on spaces: node ids or files); a -k expression goes in TESTS_K="a or b"
      python3 -m pytest -q -m gpu ${s#tests:} ${TESTS_K:+-k "$TESTS_K"} -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_tests_sel.log" | tail -40 ;;
    kernels) python3 -m benchmarks.msa_kernels --out "$OUT" 2>&1 | tee "$OUT/msa_kernels.log" | tail -60 ;;
    kernels:*) python3 -m benchmarks.msa_kernels --out "$OUT" --T ${s#kernels:} 2>&1 | tee "$OUT/msa_kernels.log" | tail -60 ;;
    floors)  # the measured floors of the missed targets (decode key streaming, forward gather) and the overlapped prefill
      python3 -m benchmarks.msa_floors --out "$OUT" 2>&1 | tee "$OUT/msa_floors.log" | tail -40 ;;
    bandwidth)  # how fast anything reads the 1M fp8 key cache's bytes: dense at equal bytes, torch, Triton streams, scoring knobs
      python3 -m benchmarks.msa_floors --parts bandwidth --out "$OUT" 2>&1 | tee "$OUT/msa_floors_bandwidth.log" | tail -30 ;;
    tail)  # the 1M batch-1 decode step's kernel timeline for a few knobs (COMPARE=module: another version beside it)
      python3 -m benchmarks.msa_floors --parts tail --out "$OUT" ${COMPARE:+--compare "$COMPARE"} 2>&1 \
        | tee "$OUT/msa_floors_tail.log" | tail -12 ;;
    selkl)   python3 -m benchmarks.msa_select_kl --out "$OUT" 2>&1 | tee "$OUT/msa_select_kl.log" | tail -40 ;;
    decode)  python3 -m benchmarks.msa_decode --out "$OUT" 2>&1 | tee "$OUT/msa_decode.log" | tail -40 ;;
    train)   python3 -m benchmarks.train_throughput --out "$OUT" 2>&1 | tee "$OUT/train.log" | tail -40 ;;
    traindist) python3 -m benchmarks.train_distributed --out "$OUT" 2>&1 | tee "$OUT/train_dist.log" | tail -40 ;;
    generate1m) python3 -m openm3.engine.generate --preset m3-small --random-prompt 1000000 --max-new-tokens 32 \
                  --chunk-size 8192 --device cuda 2>&1 | tee "$OUT/generate_1m.log" | tail -40 ;;
    kernels128)  # the 128K table (dense, no flex/iid) and the fused-KL step with narrower dk/dv tiles
      python3 -m benchmarks.msa_kernels --out "$OUT" --T 131072 --skip-flex --skip-iid --skip-check --sweep-T 0 \
        2>&1 | tee "$OUT/msa_kernels_128k.log" | tail -12
      OPENM3_ATTN_LAUNCH=dkdv_block_n=64 python3 -m benchmarks.msa_kernels --out "$OUT/bn64" --T 131072 --skip-dense \
        --skip-flex --skip-iid --skip-check --sweep-T 0 2>&1 | tee "$OUT/msa_kernels_128k_bn64.log" | tail -6 ;;
    klsweep) python3 -m benchmarks.msa_select_kl --out "$OUT" --skip-check --T 131072 --sweep 131072 2>&1 \
               | tee "$OUT/msa_select_kl_sweep.log" | tail -16 ;;
    decodefinal) python3 -m benchmarks.msa_decode --out "$OUT" --T 131072 1048576 --batch 1 32 --index fp8 bf16 \
                   --variants no_pdl tma --score-variants --prefill-T 1048576 --chunk 131072 2>&1 \
                   | tee "$OUT/msa_decode_final.log" | tail -24 ;;
    decodescale)  # fp8 index keys with e8m0 scales (the default since session 21) against fp32 ones, same process
      python3 -m benchmarks.msa_decode --out "$OUT/scale" --T 1048576 131072 --batch 1 32 --index fp8 \
        --variants scale_fp32 shrink16 default_again --score-variants tma tma_scale_fp32 --prefill-T 2>&1 \
        | tee "$OUT/msa_decode_scale.log" | tail -24 ;;
    decodeknobs)  # the scoring kernel's segment and stages (session 22's bandwidth sweep), step and kernel, same process
      python3 -m benchmarks.msa_decode --out "$OUT/knobs" --T 1048576 131072 --batch 1 32 --index fp8 \
        --variants seg32 keep_all_s4 seg32_s4 default_again --score-variants tma tma_s4 tma_seg32 tma_seg32_s4 \
        --prefill-T 2>&1 | tee "$OUT/msa_decode_knobs.log" | tail -24 ;;
    decodebatch)  # the batch sizes between the benchmark's 1 and 32, with the shrink-group settings beside
      python3 -m benchmarks.msa_decode --out "$OUT/batch" --T 1048576 131072 --batch 2 4 8 16 --index fp8 \
        --variants scale_fp32 shrink16 shrink32 --score-variants --prefill-T 2>&1 \
        | tee "$OUT/msa_decode_batch.log" | tail -24 ;;
    decodeq)  # a few new queries per sequence (speculative / MTP drafts), batch 1, with the shrink groups beside
      for ql in 2 4; do
        python3 -m benchmarks.msa_decode --out "$OUT/q$ql" --q-len $ql --T 1048576 131072 --batch 1 --index fp8 \
          --variants shrink16 shrink32 --score-variants --prefill-T 2>&1 | tee "$OUT/msa_decode_q$ql.log" | tail -8
      done ;;
    decodesplit) python3 -m benchmarks.msa_decode --out "$OUT/split" --T 1048576 131072 --batch 1 32 --index fp8 \
                   --variants split table --score-variants split split_s4 split_seg16 split_seg32 split_seg32_s4 tma \
                   --prefill-T 2>&1 | tee "$OUT/msa_decode_split.log" | tail -24 ;;
    generate128k)  # decode tokens/s at a 128K prompt: CUDA graphs (default) against --eager, m3-small, fp8 index keys too
      for mode in "" "--eager" "--index-dtype fp8"; do
        echo "--- generate 128K $mode"
        python3 -m openm3.engine.generate --preset m3-small --random-prompt 131072 --max-new-tokens 64 --no-stream \
          --chunk-size 32768 --device cuda $mode 2>&1 | tee -a "$OUT/generate_128k.log" | tail -8
      done ;;
    generatecompile)  # CUDA-graph decode over torch.compile'd layers at a 128K prompt (m3-small)
      python3 -m openm3.engine.generate --preset m3-small --random-prompt 131072 --max-new-tokens 64 --no-stream \
        --chunk-size 32768 --device cuda --compile 2>&1 | tee "$OUT/generate_128k_compile.log" | tail -8 ;;
    prefillprof) python3 -m benchmarks.prefill_profile --out "$OUT" 2>&1 | tee "$OUT/prefill_profile.log" | tail -45 ;;
    batching) python3 -m benchmarks.serve_batching --out "$OUT" 2>&1 | tee "$OUT/serve_batching.log" | tail -6 ;;
    batchingab)  # continuous batching with prefill chunks interleaved (default), then with each group prefilled whole
      python3 -m benchmarks.serve_batching --out "$OUT" 2>&1 | tee "$OUT/serve_batching.log" | tail -5
      python3 -m benchmarks.serve_batching --out "$OUT" --whole-prefill 2>&1 | tee "$OUT/serve_batching_whole.log" \
        | tail -5 ;;
    interleave)  # a decoding request's token gaps while a 128K prompt prefills, chunks interleaved with decode or not
      python3 -m benchmarks.serve_interleave --out "$OUT" 2>&1 | tee "$OUT/serve_interleave.log" | tail -4 ;;
    interleave4)  # the same while 4 prompts of 32K arrive one after another (one chunk per step vs one per group)
      python3 -m benchmarks.serve_interleave --out "$OUT" --long 32768 --longs 4 2>&1 \
        | tee "$OUT/serve_interleave4.log" | tail -5 ;;
    speculative)  # m3-small: n-gram speculative decoding vs plain, real lookups and scripted drafts right at a rate
      python3 -m benchmarks.speculative_decode --out "$OUT" ${SPEC_ARGS:-} 2>&1 | tee "$OUT/speculative.log" | tail -12
      python3 -m benchmarks.speculative_decode --out "$OUT" --prompt 16384 --batch 8 --drafts 4 2>&1 \
        | tee "$OUT/speculative_b8.log" | tail -6 ;;
    specgate)  # m3-small: speculation with and without the adaptive gate, drafts right at 0 / 25 / 50 / 100%
      python3 -m benchmarks.speculative_decode --out "$OUT" --prompt 131072 --new 128 --drafts 4 --alphas 0,0.25,0.5,1 \
        --adaptive 2>&1 | tee "$OUT/specgate_b1.log" | tail -11
      python3 -m benchmarks.speculative_decode --out "$OUT" --prompt 16384 --batch 8 --new 128 --drafts 4 \
        --alphas 0,0.25,0.5,1 --adaptive 2>&1 | tee "$OUT/specgate_b8.log" | tail -11 ;;
    fourth)  # session 32's fourth-capture slowdown: kernel workloads captured again and again (a pool each, then one
      # pool), then generate with three graph-less calls first, and with one pool for every capture
      python3 -m benchmarks.graph_repeat --out "$OUT" 2>&1 | tee "$OUT/graph_repeat.log" | tail -9
      python3 -m benchmarks.graph_repeat --shared-pool --out "$OUT" 2>&1 | tee "$OUT/graph_repeat_shared.log" | tail -9
      python3 -m benchmarks.generate_repeat --steps eager,eager,eager,plain,plain --out "$OUT" 2>&1 \
        | tee "$OUT/repeat_eager.log" | tail -6
      python3 -m benchmarks.generate_repeat --steps sharedpool,plain,plain,plain,plain,plain --out "$OUT" 2>&1 \
        | tee "$OUT/repeat_sharedpool.log" | tail -6 ;;
    servecompile)  # staggered 2K requests, eager then compiled layers (warmed up as `serve --compile`), each in its
      # own process, two rounds per max batch (session 33, compiled first, one round: batch 4 215.8 vs 247.7
      # tokens/s, batch 16 681.2 vs 565.7 on an H100; the second process finds the first one's Triton cache)
      for c in "" --compile; do
        timeout 240 python3 -m benchmarks.serve_batching --preset m3-small --device cuda --prompt-len 2048 --new 128 \
          --new-min 16 --requests-per-batch 4 --batch 4 16 --rounds 2 $c --out "$OUT" 2>&1 | grep -v Warn \
          | cut -c1-190 | tail -3
      done ;;
    nodes)  # the decode step's kernels and the idle time between them (generate_repeat kprof), plain then compiled
      # (BEFORE="DIR ...": older commits' openm3 with this benchmarks/ beside, from `bash scripts/before.sh COMMIT`,
      # carried to the device and run first; NODES_STEPS: other generate_repeat steps)
      for v in ${BEFORE:-} after; do
        root=$PWD; [ "$v" != after ] && root=$v
        echo "--- $v"
        (cd "$root" && PYTHONPATH="$root" python3 -m benchmarks.generate_repeat \
           --steps "${NODES_STEPS:-plain,plain,kprof,compile,plain,kprof}" --out "$OUT/$(basename "$v")" 2>&1 \
           | grep -v "^ \|^-\|Name\|Self" | cut -c1-120 | tail -8)
      done ;;
    overlapab)  # decode steps launched ahead of the host against plain ones, same process each: generate (m3-small
      # 8 x 16K, CUDA-graph replays) and continuous batching (2K prompts, 256 new tokens, max batch 8)
      python3 -m benchmarks.generate_repeat --steps plain,overlap,plain --out "$OUT" 2>&1 | grep -v "^ \|^-\|Name\|Self" \
        | cut -c1-160 | tail -4
      python3 -m benchmarks.serve_batching --preset m3-small --device cuda --prompt-len 2048 --new 256 --batch 8 \
        --rounds 2 --overlap both --out "$OUT" 2>&1 | tee "$OUT/serve_overlap.log" | tail -2 ;;
    repeat)  # m3-small: the same plain generate run again and again, GPU clocks / power / temperature beside each run
      python3 -m benchmarks.generate_repeat --out "$OUT" ${REPEAT_ARGS:-} 2>&1 | tee "$OUT/generate_repeat.log" | tail -14 ;;
    prefix)  # m3-small: an agent's turns from a 128K prompt, then 4 requests sharing it at once; prefix cache on / off
      python3 -m benchmarks.serve_prefix --out "$OUT" ${PREFIX_ARGS:---parallel 4} 2>&1 | tee "$OUT/serve_prefix.log" \
        | tail -11 ;;
    servegraphs)  # continuous batching with staggered requests (graphs by shape, padded rows): the graph GPU tests,
      # then 2K prompts at max batch 4 / 16 and 4-8K prompts at 16 (BEFORE=DIR: an older commit's openm3, from
      # git archive, with this benchmarks/ copied in, timed first in the same call)
      python3 -m pytest -q -m gpu tests/gpu/test_engine_graphs_gpu.py -p no:cacheprovider 2>&1 | tail -3
      for v in ${BEFORE:+before} after; do
        root=$PWD; [ "$v" = before ] && root=$BEFORE
        (cd "$root" && PYTHONPATH="$root" python3 -m benchmarks.serve_batching --preset m3-small --device cuda \
           --prompt-len 2048 --new 128 --new-min 16 --requests-per-batch 4 --batch 4 16 --out "$OUT/$v" 2>&1 \
           | tee "$OUT/serve_staggered_$v.log" | tail -2
         PYTHONPATH="$root" python3 -m benchmarks.serve_batching --preset m3-small --device cuda --prompt-len 8192 \
           --prompt-len-min 4096 --new 128 --new-min 16 --requests-per-batch 4 --batch 16 --out "$OUT/$v" 2>&1 \
           | tee "$OUT/serve_varied_$v.log" | tail -1)
      done ;;
    indexab)  # generate m3-small 8 x 16K with bf16 index keys (the default) against fp8 ones, same process
      python3 -m benchmarks.generate_repeat --steps plain,fp8idx,plain --out "$OUT" 2>&1 \
        | grep -v "^ \|^-\|Name\|Self" | cut -c1-160 | tail -4 ;;
    fusemoe)  # each MoE layer's shared gate_up and router weights as one GEMM (session 39, untimed): its GPU tests,
      # then generate m3-small 8 x 16K plain, then fused, same process (replay ms is the figure)
      python3 -m pytest -q -m gpu tests/gpu/test_moe_routing_gpu.py -p no:cacheprovider 2>&1 \
        | tee "$OUT/fusemoe_tests.log" | tail -4
      python3 -m benchmarks.generate_repeat --steps plain,plain,fusemoe,plain,plain --out "$OUT" 2>&1 \
        | grep -v "^ \|^-\|Name\|Self" | cut -c1-160 | tail -6 ;;
    moe)  # the decode-size expert kernels (openm3.ops.moe_experts): GPU tests, then one layer at 1-64 tokens against
      # the grouped GEMMs, the projections with 2 and 4 splits beside (session 38: splits untimed)
      python3 -m pytest -q -m gpu tests/gpu/test_moe_experts_gpu.py tests/gpu/test_moe_routing_gpu.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/moe_tests.log" | tail -6
      python3 -m benchmarks.moe_decode --splits 2 4 --out "$OUT" 2>&1 | tee "$OUT/moe_decode.log" | tail -7 ;;
    router) python3 -m benchmarks.moe_router --out "$OUT" 2>&1 | tee "$OUT/moe_router.log" | tail -12 ;;
    routing) python3 -m benchmarks.moe_routing_ops --out "$OUT" 2>&1 | tee "$OUT/moe_routing_ops.log" | tail -4 ;;
    klcompact)  # the KL with its old work-list compaction (a host sync per call; off by default since session 5)
      python3 -m benchmarks.msa_group_sweep --out "$OUT/klcompact" --attn "" --kl "" "compact_items=1" 2>&1 \
        | tee "$OUT/klcompact_sweep.log" | tail -8
      OPENM3_KL_LAUNCH=compact_items=1 python3 -m benchmarks.train_throughput --out "$OUT/klcompact" --only mfu \
        --steps 3 --warmup 2 2>&1 | tee "$OUT/klcompact_mfu.log" | tail -2 ;;
    klcompact128)  # M3's shape (G = 16) at 128K: the KL with and without the work-list compaction
      python3 -m benchmarks.msa_group_sweep --out "$OUT/klcompact128" --hq 64 --T 131072 --seq-len 131072 --attn \
        --kl "" "compact_items=1" 2>&1 | tee "$OUT/klcompact128.log" | tail -4 ;;
    ncu)  # Nsight Compute on the dk/dv and KL main kernels at m3-small's shape (warm launches), if ncu is there
      if command -v ncu >/dev/null; then
        ncu --version | tail -1
        timeout 150 ncu -k regex:"_kl_main_kernel|_attn_dkdv_kernel" --launch-skip 2 --launch-count 2 --section SpeedOfLight \
          --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
          --section ComputeWorkloadAnalysis python3 -m benchmarks.ncu_msa > "$OUT/ncu_msa.txt" 2>&1
        grep -E "^  _|Duration|Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles|ERR|==PROF==" \
          "$OUT/ncu_msa.txt" | head -60
      else
        echo "no ncu on PATH"; ls /usr/local/cuda*/bin 2>/dev/null | grep -i -E "ncu|nsys" | head
      fi ;;
    groupsweep128)  # M3's shape (G = 16) at 128K: the dk/dv and KL occupancy knobs
      python3 -m benchmarks.msa_group_sweep --out "$OUT/groupsweep128" --hq 64 --T 131072 --seq-len 131072 --attn "" \
        "dkdv_block_n=64" "dkdv_maxnreg=128" "dkdv_block_n=64,dkdv_maxnreg=128" "dkdv_num_stages=1" "dkdv_num_stages=3" \
        --kl "" "unroll_heads=0" "unroll_heads=0,maxnreg=128" 2>&1 | tee "$OUT/groupsweep128.log" | tail -14 ;;
    knobconfirm)  # the session-6 sweep's winners against the defaults, 3 interleaved rounds, G = 4 and M3's G = 16
      python3 -m benchmarks.msa_group_sweep --out "$OUT/knobconfirm" --rounds 3 --attn "" "dkdv_num_stages=3" \
        --kl "" "unroll_heads=0,maxnreg=128" "unroll_heads=0" "maxnreg=128" 2>&1 | tee "$OUT/knobconfirm.log" | tail -6
      python3 -m benchmarks.msa_group_sweep --out "$OUT/knobconfirm128" --rounds 3 --hq 64 --T 131072 \
        --seq-len 131072 --attn "" "dkdv_num_stages=3" --kl "" "unroll_heads=0" 2>&1 \
        | tee "$OUT/knobconfirm128.log" | tail -4 ;;
    mfuab)  # the 8K MFU case with the defaults, then with OPENM3_KL_LAUNCH=$KL_AB (default: the G = 4 candidate)
      python3 -m benchmarks.train_throughput --out "$OUT/mfu_default" --only mfu --steps 3 --warmup 2 2>&1 \
        | tee "$OUT/train_mfu_default.log" | tail -2 | cut -c1-400
      OPENM3_KL_LAUNCH="${KL_AB:-unroll_heads=0,maxnreg=128}" python3 -m benchmarks.train_throughput \
        --out "$OUT/mfu_kl_ab" --only mfu --steps 3 --warmup 2 2>&1 | tee "$OUT/train_mfu_kl_ab.log" | tail -2 \
        | cut -c1-400 ;;
    ab64kl)  # the 64K MSA step (checkpointed) with the KL in the attention's backward (A) against in the forward (B), then dense
      python3 -m benchmarks.train_throughput --out "$OUT/ab64kl" --only msa --steps 6 --ab 'cfg.kl_in_backward=0' 2>&1 \
        | tee "$OUT/ab64kl.log" | grep -E "context|tokens_per_s|step_s|Error" | cut -c1-400
      python3 -m benchmarks.train_throughput --out "$OUT/dense64" --only dense 2>&1 | tee "$OUT/dense64.log" \
        | grep -E "context|tokens_per_s|Error" | cut -c1-300 ;;
    train64ac)  # 64K MSA and dense: full checkpointing A/B keeping the attention (same process), then no checkpointing
      python3 -m benchmarks.train_throughput --out "$OUT/train64keep" --only msa,dense --steps 4 \
        --ab 'cfg.ac_keep_attention=1' 2>&1 | tee "$OUT/train64keep.log" | tail -4 | cut -c1-600
      python3 -m benchmarks.train_throughput --out "$OUT/train64noac" --only msa,dense --long-ckpt off --steps 3 \
        2>&1 | tee "$OUT/train64noac.log" | tail -4 | cut -c1-600 ;;
    train64)  # the 64K MSA vs dense cases of train_throughput only
      python3 -m benchmarks.train_throughput --out "$OUT/train64" --only msa,dense 2>&1 | tee "$OUT/train64.log" \
        | grep -E "context|tokens_per_s" | cut -c1-300 ;;
    mfumb8)  # the 8K MFU case with all 8 rows in one micro-batch
      python3 -m benchmarks.train_throughput --out "$OUT/mfu_mb8" --only mfu --steps 3 --warmup 2 --rows 8 \
        --micro-batch 8 2>&1 | tee "$OUT/train_mfu_mb8.log" | tail -2 | cut -c1-600 ;;
    table128)  # the 128K M3 table alone (dense in the same run, no flex / iid / checks)
      python3 -m benchmarks.msa_kernels --out "$OUT" --T 131072 --skip-flex --skip-iid --skip-check --sweep-T 0 \
        2>&1 | tee "$OUT/msa_kernels_128k.log" | tail -12 ;;
    unionsweep)  # the hybrid forward's union threshold and launch knobs at M3's 128K, both regimes, with a profile
      python3 -m benchmarks.msa_kernels --out "$OUT/unionsweep" --T 131072 --skip-flex --skip-iid --skip-check \
        --skip-dense --prefill-only --sweep-T 131072 --sweep "" "union_max=0,block_m=16" "union_max=0" \
        ${UNION_SWEEP:-"union_max=36" "union_max=44" "num_warps=8" "num_stages=2" "num_stages=4"} 2>&1 \
        | tee "$OUT/unionsweep.log" | grep -A12 "^launch sweep" ;;
    step128)  # M3's 128K prefill and train step (KL in the backward) with dense, then under each of $STEP_AB
      python3 -m benchmarks.msa_kernels --out "$OUT/step128" --T 131072 --skip-flex --skip-iid --skip-check \
        --sweep-T 0 --cases select sparse_fwd msa_prefill msa_train_step_kl_bwd 2>&1 | tee "$OUT/step128.log" \
        | grep -E "^  131072|^    (select|sparse_fwd|msa_|dense)"
      for ab in ${STEP_AB:-}; do
        echo "--- OPENM3_ATTN_LAUNCH=$ab"
        OPENM3_ATTN_LAUNCH=$ab python3 -m benchmarks.msa_kernels --out "$OUT/step128_ab" --T 131072 --skip-flex \
          --skip-iid --skip-check --skip-dense --sweep-T 0 --cases msa_train_step_kl_bwd 2>&1 \
          | tee -a "$OUT/step128_ab.log" | grep -E "^    msa_"
      done ;;
    klsweep4)  # KL knobs on top of the session-6 defaults at m3-small's shape (G = 4), 2 interleaved rounds
      python3 -m benchmarks.msa_group_sweep --out "$OUT/klsweep4" --rounds 2 --attn --kl "" "block_q=32" \
        "num_warps=4,maxnreg=0" "num_warps=4" "max_entries=128" "max_entries=512" "prefetch=1" "dqi_buffer=1" \
        "heads_per_dot=2" 2>&1 | tee "$OUT/klsweep4.log" | grep median ;;
    splitsweep)  # the split dk/dv passes (dv, then dk + dq) at G = 4 and M3's G = 16 (128K), 2 interleaved rounds
      python3 -m benchmarks.msa_group_sweep --out "$OUT/splitsweep" --rounds 2 --attn "" "dkdv_split=1" \
        "dkdv_split=1,dkdv_block_n=64" --kl 2>&1 | tee "$OUT/splitsweep.log" | grep median
      python3 -m benchmarks.msa_group_sweep --out "$OUT/splitsweep128" --rounds 2 --hq 64 --T 131072 \
        --seq-len 131072 --attn "" "dkdv_split=1" "dkdv_split=1,dkdv_block_n=64" \
        "dkdv_split=1,dkdv_block_n=64,dkdv_maxnreg=128" --kl 2>&1 | tee "$OUT/splitsweep128.log" | grep median ;;
    dqsweep)  # dq in its own query-outer pass (no fp32 atomics in dk/dv) against dq fused, G = 4 and M3's G = 16 (128K)
      python3 -m benchmarks.msa_group_sweep --out "$OUT/dqsweep" --rounds 2 --attn "" "dq_in_dkdv=0" \
        "dq_in_dkdv=0,dq_block_m=32" "dq_in_dkdv=0,dq_block_m=64" "dq_in_dkdv=0,dq_block_m=64,dq_num_warps=8" \
        "dq_in_dkdv=0,dq_block_m=64,dkdv_block_m=64" "dq_in_dkdv=0,dq_block_m=64,dkdv_num_stages=3" --kl 2>&1 \
        | tee "$OUT/dqsweep.log" | grep median
      python3 -m benchmarks.msa_group_sweep --out "$OUT/dqsweep128" --rounds 2 --hq 64 --T 131072 \
        --seq-len 131072 --attn "" "dq_in_dkdv=0" "dq_in_dkdv=0,dq_block_m=32" "dq_in_dkdv=0,dkdv_num_stages=3" \
        --kl 2>&1 | tee "$OUT/dqsweep128.log" | grep median ;;
    statssweep)  # the KL's first pass (student log-sum-exps) with its own step height / warps / stages
      python3 -m benchmarks.msa_group_sweep --out "$OUT/statssweep" --rounds 2 --attn --kl "" "stats_block_q=64" \
        "stats_block_q=64,stats_num_warps=4" "stats_block_q=128,stats_num_warps=4" "stats_num_stages=3" \
        "stats_block_q=64,stats_num_stages=3" "stats_block_q=32,stats_num_warps=4,stats_num_stages=3" 2>&1 \
        | tee "$OUT/statssweep.log" | grep median
      python3 -m benchmarks.msa_group_sweep --out "$OUT/statssweep128" --rounds 2 --hq 64 --T 131072 \
        --seq-len 131072 --attn --kl "" "stats_block_q=64" "stats_block_q=64,stats_num_warps=4" \
        "stats_num_stages=3" "stats_block_q=64,stats_num_stages=3" 2>&1 | tee "$OUT/statssweep128.log" \
        | grep median ;;
    hotsweep)  # the dk/dv hot-block split threshold (queries per work item) at m3-small's shape
      python3 -m benchmarks.msa_group_sweep --out "$OUT/hotsweep" --rounds 2 --attn "" "dkdv_max_tokens=512" \
        "dkdv_max_tokens=1024" "dkdv_max_tokens=8192" --kl 2>&1 | tee "$OUT/hotsweep.log" | grep median ;;
    hot128)  # the dk/dv hot-block split threshold at M3's shape, 128K
      python3 -m benchmarks.msa_group_sweep --out "$OUT/hot128" --rounds 2 --hq 64 --T 131072 --seq-len 131072 \
        --attn "" "dkdv_max_tokens=512" "dkdv_max_tokens=1024" --kl 2>&1 | tee "$OUT/hot128.log" | grep median ;;
    mfuhot)  # the 8K MFU case with OPENM3_ATTN_LAUNCH=$ATTN_AB (default: dk/dv work items of at most 512 queries)
      OPENM3_ATTN_LAUNCH="${ATTN_AB:-dkdv_max_tokens=512}" python3 -m benchmarks.train_throughput --out "$OUT/mfuhot" \
        --only mfu --steps 3 --warmup 2 2>&1 | tee "$OUT/train_mfuhot.log" | tail -2 | cut -c1-700 ;;
    lsesweep)  # selection + KL with the student normaliser from the selection kernel, G = 4 (2 x 8K) and M3 128K
      python3 -m benchmarks.msa_group_sweep --out "$OUT/lsesweep" --rounds 3 --attn --kl --selkl "" "index_lse=1" \
        2>&1 | tee "$OUT/lsesweep.log" | grep median
      python3 -m benchmarks.msa_group_sweep --out "$OUT/lsesweep128" --rounds 2 --hq 64 --T 131072 --seq-len 131072 \
        --attn --kl --selkl "" "index_lse=1" 2>&1 | tee "$OUT/lsesweep128.log" | grep median ;;
    vl)  # native multimodal training throughput of m3-small's VL model at 8K (half the rows with 8 images each)
      python3 -m benchmarks.train_throughput --out "$OUT/vl" --only vl --steps 3 --warmup 2 --micro-batch 4 2>&1 \
        | tee "$OUT/train_vl.log" | tail -2 | cut -c1-900 ;;
    mfulse)  # the 8K MFU case with the KL's student normaliser from the selection kernel (untimed in session 7)
      OPENM3_SELECT_LAUNCH=index_lse=1 python3 -m benchmarks.train_throughput --out "$OUT/mfulse" --only mfu \
        --steps 3 --warmup 2 2>&1 | tee "$OUT/train_mfulse.log" | tail -2 | cut -c1-700 ;;
    train64lse)  # the 64K MSA case with the same (does the selection's extra exponentials cost more there?)
      OPENM3_SELECT_LAUNCH=index_lse=1 python3 -m benchmarks.train_throughput --out "$OUT/train64lse" --only msa \
        2>&1 | tee "$OUT/train64lse.log" | grep -E "tokens_per_s" | cut -c1-300 ;;
    teachersweep)  # the KL with its teacher probabilities from a query-outer pass, G = 4 (2 x 8K) and M3 128K
      python3 -m benchmarks.msa_group_sweep --out "$OUT/teachersweep" --rounds 3 --attn --kl "" "teacher_pass=1" \
        2>&1 | tee "$OUT/teachersweep.log" | grep median
      python3 -m benchmarks.msa_group_sweep --out "$OUT/teachersweep128" --rounds 2 --hq 64 --T 131072 \
        --seq-len 131072 --attn --kl "" "teacher_pass=1" 2>&1 | tee "$OUT/teachersweep128.log" | grep median ;;
    teachersweepiid)  # G = 4 as in the 8K training step: 8 x 8K tokens, a random indexer's (iid) and drifting selections
      for regime in iid drift; do
        python3 -m benchmarks.msa_group_sweep --out "$OUT/teachersweep_$regime" --rounds 3 --T 65536 --regime $regime \
          --attn --kl "teacher_pass=0" "teacher_pass=1" 2>&1 | tee "$OUT/teachersweep_$regime.log" | grep median
      done ;;
    mfuteacher)  # the 8K MFU case with the teacher pass ($KL_AB: default teacher_pass=1; $SELECT_AB: selection)
      OPENM3_KL_LAUNCH="${KL_AB:-teacher_pass=1}" OPENM3_SELECT_LAUNCH="${SELECT_AB:-}" python3 -m \
        benchmarks.train_throughput --out "$OUT/mfuteacher" --only mfu --steps "${STEPS:-3}" --warmup 2 2>&1 \
        | tee "$OUT/train_mfuteacher.log" | tail -2 | cut -c1-700 ;;
    mfunested)  # the 8K MFU case with Dynamo's nested graph breaks (2 graphs per decoder layer instead of 4)
      python3 -m benchmarks.train_throughput --out "$OUT/mfunested" --only mfu --steps "${STEPS:-3}" --warmup 2 \
        --nested-graph-breaks 2>&1 | tee "$OUT/train_mfunested.log" | tail -2 | cut -c1-700 ;;
    abstep)  # interleaved A/B in one process, the 8K MFU case: timed steps alternate defaults / $AB (8 steps)
      python3 -m benchmarks.train_throughput --out "$OUT/abstep" --only mfu --steps "${STEPS:-8}" --warmup 2 \
        --ab "${AB:-OPENM3_KL_LAUNCH=teacher_pass=0}" 2>&1 | tee "$OUT/train_abstep.log" | tail -2 | cut -c1-900 ;;
    dqtsweep)  # dq computed transposed in dk/dv (dq^T = K^T dS^T: wgmma instead of mma.sync), G = 4 and M3's 128K
      python3 -m benchmarks.msa_group_sweep --out "$OUT/dqt4" --rounds 3 --attn "" "dq_transposed=1" --kl 2>&1 \
        | tee "$OUT/dqt4.log" | grep median
      python3 -m benchmarks.msa_group_sweep --out "$OUT/dqt4iid" --rounds 3 --T 65536 --regime iid \
        --attn "" "dq_transposed=1" --kl 2>&1 | tee "$OUT/dqt4iid.log" | grep median
      python3 -m benchmarks.msa_group_sweep --out "$OUT/dqt128" --rounds 2 --hq 64 --T 131072 --seq-len 131072 \
        --attn "" "dq_transposed=1" --kl 2>&1 | tee "$OUT/dqt128.log" | grep median ;;
    stages4)  # dk/dv pipeline stages with dq transposed (115 KB of shared memory instead of 140), G = 4 8 x 8K iid
      python3 -m benchmarks.msa_group_sweep --out "$OUT/stages4" --rounds 3 --T 65536 --regime iid \
        --attn "" "dkdv_num_stages=3" "dkdv_num_stages=1" --kl 2>&1 | tee "$OUT/stages4.log" | grep median ;;
    lse64)  # m3-small's 64K MSA step, interleaved: the selection's student normaliser on (B) against the default
      python3 -m benchmarks.train_throughput --out "$OUT/lse64" --only msa --steps 6 --warmup 2 \
        --ab 'OPENM3_SELECT_LAUNCH=index_lse=1' 2>&1 | tee "$OUT/lse64.log" | tail -2 | cut -c1-600 ;;
    stages128)  # dk/dv pipeline stages at M3's shape, 128K (G = 4 measured -1.2% with 3 in session 9)
      python3 -m benchmarks.msa_group_sweep --out "$OUT/stages128" --rounds 2 --hq 64 --T 131072 --seq-len 131072 \
        --attn "" "dkdv_num_stages=3" --kl 2>&1 | tee "$OUT/stages128.log" | grep median ;;
    kmsweep)  # the KL main pass key-major after the teacher pass (all wgmma), with and without the G < 16 register cap
      python3 -m benchmarks.msa_group_sweep --out "$OUT/km4" --rounds 3 --T 65536 --regime iid --attn --kl "" \
        "key_major=1" "key_major=1,maxnreg=0" "maxnreg=0" 2>&1 | tee "$OUT/km4.log" | grep median
      python3 -m benchmarks.msa_group_sweep --out "$OUT/km128" --rounds 2 --hq 64 --T 131072 --seq-len 131072 \
        --attn --kl "" "key_major=1" 2>&1 | tee "$OUT/km128.log" | grep median ;;
    groupsweep) python3 -m benchmarks.msa_group_sweep --out "$OUT" 2>&1 | tee "$OUT/msa_group_sweep.log" | tail -24 ;;
    mfubatch)  # the 8K MFU case with larger micro-batches (fewer host launches per token) and more rows per step
      for rm in "4 4" "8 4"; do set -- $rm
        python3 -m benchmarks.train_throughput --out "$OUT/mfu_r$1_mb$2" --only mfu --steps 3 --warmup 2 --rows $1 \
          --micro-batch $2 2>&1 | tee "$OUT/train_mfu_r$1_mb$2.log" | tail -2 | cut -c1-600
      done ;;
    mfu16)  # the 8K MFU case with 16 rows per optimizer step in 2 micro-batches of 8 (AdamW once per 128K tokens)
      python3 -m benchmarks.train_throughput --out "$OUT/mfu16" --only mfu --steps 3 --warmup 2 --rows 16 \
        --micro-batch 8 2>&1 | tee "$OUT/train_mfu16.log" | tail -2 | cut -c1-700 ;;
    mfu) python3 -m benchmarks.train_throughput --out "$OUT" --only mfu --steps 3 --warmup 2 2>&1 \
           | tee "$OUT/train_mfu.log" | tail -4 ;;
    servetools)  # --constrain-tool-calls' cost through the app `openm3 serve` builds; the device image has no
      # fastapi: carry the serve extra's wheels (`bash scripts/serve_wheels.sh` here, then run with carry [".whl"])
      if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
      fi
      # the tokenizer serve_wheels.sh exported (training one needs the data extra's corpora, absent there)
      python3 -m benchmarks.serve_tools --out "$OUT" ${SERVE_TOOLS_ARGS:-} \
        $([ -f .whl/tokenizer/tokenizer.json ] && echo --tokenizer .whl/tokenizer) 2>&1 | tee "$OUT/serve_tools.log" | tail -4 ;;
    *) echo "unknown stage $s" ;;
  esac
done
echo "=== done ($(date -u +%T)) ==="
# The device tool returns few files (a count limit over all of $OUT: several invocations with OUT=$OUT/sub each
# add theirs, and session 9 lost a stage's JSON and log to it): every result and log of this invocation goes back
# in one archive, results.tgz (extract with `tar xzf`). An archive an earlier invocation of the same command left
# is unpacked first, so that several invocations in one call return all their files (until session 21 each
# archive replaced the last, which is how sessions 20 and 21 lost a tail JSON and the GPU test logs).
(cd "$OUT" && { [ ! -f results.tgz ] || { tar xzf results.tgz && rm -f results.tgz; }; } \
  && find . -type f ! -name 'results.tgz' > /tmp/out_list && [ -s /tmp/out_list ] \
  && tar czf /tmp/results.tgz -T /tmp/out_list && xargs rm -f < /tmp/out_list && find . -type d -empty -delete \
  && mv /tmp/results.tgz .)
