// Settings of the CUDA decode step and batched prefill that code may change
// (CudaOptions::decode). The defaults are the paths measured fastest
// (bench/NOTES-cuda.md; the slower variants were removed); the other values
// exist for tests (the token-by-token reference, paths the default reaches
// only at larger shapes), for the disk tier and for benchmarks.
// Plain C++ (no CUDA headers).
#pragma once

namespace flashmoe {

struct DecodeOptions {
  // Prompts of more than one token go through the batched prefill
  // (prefill.cuh) in chunks of up to prefill_chunk tokens (1..8191; 2048:
  // each chosen expert is read once per chunk, so longer chunks read fewer
  // bytes per token). false: token by token through the decode step (the
  // tests' reference for the batched path).
  bool batched_prefill = true;
  int prefill_chunk = 2048;

  // Blocks per query head of the decode step's attention (a cluster, each a
  // slice of the positions). Auto: one per 256 positions of KV capacity,
  // 1 to 8; Off: one; Force: 4 (tests: the split path on short contexts).
  enum class AttentionSplit { Auto, Off, Force };
  AttentionSplit attention_split = AttentionSplit::Auto;

  // Tests: the delta-rule cluster kernel with 8 value columns per block, so
  // that small heads run clusters of several blocks (default: 32 columns).
  bool force_small_delta_clusters = false;
  // Tests: every matvec takes 3 rows per warp at a time (default: only
  // where the grid leaves 3 rows per warp, as the 35B's in-proj).
  bool force_three_rows = false;

  // The expert pick made on the device inside the kernels: the router
  // folded into the output projection's launch, whose last block picks the
  // experts and resolves their row pointers, gate_up adding the weights.
  // The disk tier sets it false (CudaOptions::host_cache_*): there the host
  // reads the chosen experts from disk between the routing and the expert
  // kernels, so the pick is a kernel of its own (router + top-k) whose ids
  // the host reads, and the expert kernels look their rows up in tables
  // that are final only after that read.
  bool pick_in_kernels = true;

  // The batched decode step (forward_batch over several sequences) captured
  // in a CUDA graph per batch shape (sequences, KV types, attention split;
  // from a shape's second step) and replayed, its per-sequence arguments
  // rewritten before each replay; false: plain launches (tests, and bench
  // --batch-graph 0). Graphs won at every B on the H200 (bench/NOTES-cuda.md,
  // "Batched step graphs by default").
  bool batch_graph = true;

  // The routed experts of the batched step and prefill: Auto picks per
  // step by the rows per picked expert (at up to 1/4 row per picked
  // expert on average, skinny_gemm_kernel for bf16 experts and
  // few_rows_kernel for f16/f32 ones; the tiled tensor-core product
  // above; measured on the H200); the others force one path
  // (tests, and the bench that measures them side by side).
  enum class BatchExperts { Auto = 0, Tiled = 1, FewRows = 2, Skinny = 3 };
  BatchExperts batch_experts = BatchExperts::Auto;

  // Tests: the copies ahead of tiered experts (host_prefetch.cuh) pick the
  // host-tier experts ranked lowest, so they are (nearly all) wrong and the
  // chosen experts are copied after the router instead.
  bool prefetch_mispredict = false;

  // GGUF routed experts in VRAM rearranged at upload into the chunk layout
  // of the decode step's expert kernels (gguf_chunks.cuh, where the VRAM
  // allows: upload.cu); false (--gguf-experts stored): as the file stores
  // them, read by gguf_staged.cuh's kernels (25% fewer bytes for Q4_K).
  bool gguf_expert_chunks = true;

  // Benchmarks: time per phase of the batched prefill and of the batched
  // decode steps (forward_batch), printed to stderr when the model is
  // destroyed (events between phases; slows them a little; no graphs).
  bool prefill_profile = false;

  // Dense GGUF matrices (projections, lm_head) repacked at upload for the
  // decode matvec (gguf_dense_layout.cuh). false (tests: the reference the
  // repacked path is checked against): the file's blocks on the staged
  // kernels (gguf_staged.cuh), measured slower in session 8's rounds.
  bool gguf_dense_repack = true;
};

}  // namespace flashmoe
