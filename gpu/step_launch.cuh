// One step's launch of the pre-pass (gpu/step.h): the three kernels (one less
// with the query terms built by the scoring blocks, or with the selection fused
// into scoring: gpu/fused_select.cuh; two more with the coarse level:
// gpu/coarse_select.cuh; and selection feedback's two around the selection:
// gpu/feedback.cuh) with all their parameters, planned here for the coarse level
// and feedback, launched one by one or replayed as a captured CUDA graph.
// Included by gpu/step.cu only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/layout.h"
#include "core/status.h"
#include "core/step.h"
#include "gpu/coarse_select.cuh"
#include "gpu/cuda_check.h"
#include "gpu/feedback.cuh"
#include "gpu/fused_select.cuh"
#include "gpu/live_streams.h"
#include "gpu/score_kernel.cuh"
#include "gpu/select_kernel.cuh"
#include "gpu/step_kernels.cuh"
#include "gpu/terms_kernel.cuh"

namespace eps::gpu {

// CUDA's limit on a grid's y and z dimensions.
inline constexpr int64_t kMaxGridYZ = 65535;

// Dynamic shared memory of the scoring and selection kernels (score_kernel.cuh
// and select_kernel.cuh lay them out; terms_kernel.cuh has its own).
inline size_t ScoreSharedBytes(const ModelLayout& m, bool staged, bool octets = false) {
  return sizeof(float) *
         kernels::ScoreSharedWords(m.gqa_ratio(), m.head_dim, m.sketch_dim, staged, octets);
}
// The words are padded to whole 16 bytes: the compiler reads them four at a
// time (LDS.128 in the fixed budget's rank loop), the last load reaching past
// the last word when max_groups is not a multiple of 4 (memcheck found it).
inline size_t SelectSharedBytes(int64_t max_groups) {
  return static_cast<size_t>((max_groups + 15) / 16 * 16 +
                             (max_groups + 3) / 4 * 4 * sizeof(unsigned));
}
// Groups a row may hold: the select kernel keeps a row's groups in shared memory.
inline constexpr int64_t kMaxGroups = 8192;

// Whether the kernels can serve `m` with up to `max_batch` rows of `max_groups` groups: at
// most 256 query heads, m <= 64 and kMaxGroups groups, and every grid within CUDA's
// limits (scoring and the coarse level put (layer, KV head) on y and the row on z; the
// terms kernel the layer on y and the row on z; the selection, the candidates and
// feedback the row on y; x, up to 2³¹−1, holds the rest).
inline absl::Status CheckLaunchLimits(const ModelLayout& m, int64_t max_batch, int64_t max_groups) {
  if (m.num_q_heads > 256 || m.sketch_dim > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_q_heads=", m.num_q_heads, ", sketch_dim=", m.sketch_dim,
                     ": the GPU pre-pass supports at most 256 query heads and m <= 64"));
  }
  const int64_t pairs = int64_t{m.num_layers} * m.num_kv_heads;
  if (pairs > kMaxGridYZ || max_batch > kMaxGridYZ) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers * num_kv_heads = ", m.num_layers, " * ", m.num_kv_heads, " = ",
                     pairs, " and max_batch=", max_batch,
                     ": the GPU pre-pass launches grids whose y and z are "
                     "these, each at most ",
                     kMaxGridYZ));
  }
  if (max_groups > kMaxGroups) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_groups=", max_groups, " exceeds the GPU pre-pass limit of ", kMaxGroups,
                     " groups per row: attach with a larger group_blocks, or the cpu backend"));
  }
  return absl::OkStatus();
}

// The kernels of one step (query terms, scoring, selection; or query terms,
// then scoring with the selection fused) with every parameter, launched one by
// one or captured as a graph. Built zeroed (padding included), so its bytes
// are a key.
struct StepLaunch {
  kernels::Shape shape;
  kernels::SelectRule rule;
  kernels::TermsArgs terms;
  kernels::ScoreArgs score;
  kernels::SelectArgs select;  // the fused kernel's too
  kernels::FusedArgs fused;
  bool fused_selection;      // score_kernel is a FusedSelectKernel; no selection kernel
  const void* terms_kernel;  // null: the scoring blocks build the terms (ScoreArgs::phi)
  dim3 terms_grid;
  size_t terms_shared;
  const void* score_kernel;
  dim3 score_grid;
  size_t score_shared;
  const void* select_kernel;
  dim3 select_grid, select_block;
  size_t select_shared;
  // The coarse level (gpu/coarse_select.cuh): score_kernel over the coarse
  // records first (coarse_shape, coarse_score, coarse_grid), then the candidate
  // kernel, then the fine scoring above with score.candidates set.
  bool coarse;
  kernels::Shape coarse_shape;
  kernels::ScoreArgs coarse_score;
  kernels::CoarseArgs candidates;
  dim3 coarse_grid;
  const void* candidate_kernel;
  dim3 candidate_grid, candidate_block;
  // Selection feedback (gpu/feedback.cuh): its scores rewritten after scoring
  // (feedback_apply), its entries consumed after the selection (feedback_consume).
  bool feedback_apply, feedback_consume;
  kernels::FeedbackArgs feedback;
  dim3 feedback_grid;
  size_t feedback_shared;  // FeedbackKernel's keys

  // The step's shape: the model's, its records' layout, the inputs' capacities.
  void PlanShape(const ModelLayout& m, const SummaryLayout& l, const StepInputs& in, int lists) {
    kernels::Shape& s = shape;
    s.layers = m.num_layers;
    s.q_heads = m.num_q_heads;
    s.kv_heads = m.num_kv_heads;
    s.d = m.head_dim;
    s.m = m.sketch_dim;
    s.record_words = l.record_words;
    s.block_size = m.block_size;
    s.group_blocks = m.group_blocks;
    s.record = {m.head_dim, l.gram_words, l.fro2,      l.max_norm,  l.count,
                l.key_sum,  l.quest_min,  l.quest_max, l.principal, l.quest8};
    s.max_batch = in.max_batch;
    s.max_seqs = in.max_seqs;
    s.max_groups = in.max_groups;
    s.max_blocks = in.max_blocks;
    s.num_slots = in.num_slots;
    s.num_physical_blocks = in.num_physical_blocks;
    s.query_dtype = in.query_dtype;
    s.lists = lists;
  }

  // The selection rule's policy fields (the mass budget's are set by the caller).
  void PlanRule(const ModelLayout& m, const SelectPolicy& policy, bool method_off) {
    rule.method_off = method_off;
    rule.alpha = policy.alpha;
    rule.first_n = policy.first_n;
    rule.last_n = policy.last_n;
    rule.top_pages = policy.top_pages;
    rule.top_p = policy.top_p;
    rule.inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(m.head_dim));  // as core MarkTopP
  }

  // The query terms' part: `args` without the run's fields; TermsKernelHeld, a
  // warp per (KV head, layer, run of heads: TermsHeadsPerRun of the warps the GPU
  // holds, `resident_warps`), where it fits; else TermsKernel, a block per (KV
  // head, layer, row).
  void PlanTerms(const ModelLayout& m, kernels::TermsArgs args, int64_t batch,
                 kernels::TermsChoice choice, int64_t resident_warps, int wanted_run) {
    terms = args;
    terms.rows = static_cast<int>(batch);
    terms.run = 1;
    terms_kernel = choice.kernel;
    terms_grid = dim3(static_cast<unsigned>(m.num_kv_heads), static_cast<unsigned>(m.num_layers),
                      static_cast<unsigned>(batch));
    terms_shared = sizeof(float) * kernels::TermsSharedWords(m.head_dim, m.sketch_dim);
    if (!choice.held) return;
    constexpr int kWarps = kernels::kTermsThreads / 32;
    const int64_t pairs = int64_t{m.num_layers} * m.num_kv_heads;
    const int64_t heads = batch * m.gqa_ratio();  // of each (layer, KV head)
    terms.run = kernels::TermsHeadsPerRun(pairs * heads, resident_warps, wanted_run);
    const int64_t warps = pairs * ((heads + terms.run - 1) / terms.run);
    terms_grid = dim3(static_cast<unsigned>((warps + kWarps - 1) / kWarps));
    terms_shared = 0;
  }

  int64_t ScoringBlocks() const { return int64_t{score_grid.y} * score_grid.z * score_grid.x; }

  // jl's staged path with one scoring block per (row, layer, KV head): where the
  // GPU holds every scoring block at once (`resident_blocks`), each builds its
  // heads' terms itself while its records load (score_kernel.cuh), each head's
  // once as the terms kernel would, and the step has one kernel less. With more
  // blocks than the GPU holds, each later wave would wait for its own terms, where
  // the terms kernel builds them all under the first (H100, jl 32k: 0.7-3.1 us less
  // at batch 1; in every block, 4 and 18 us more at batches 8 and 64;
  // docs/benchmarks/gpu-history-2026-11-26-sessions-3-7.md).
  // `held`: the terms kernel chosen is TermsKernelHeld, whose sums the blocks then
  // run where they hold its share of Φ (ScoreArgs::held_e, BlockHoldsPhi).
  void PlanTermsInBlocks(int64_t resident_blocks, const float* phi, bool held, int d, int m) {
    if (ScoringBlocks() > resident_blocks) return;
    terms_kernel = nullptr;
    score.phi = phi;
    score.held_e = held && kernels::BlockHoldsPhi(d / 32, m) ? d / 32 : 0;
  }

  // The selection fused into scoring (fused_select.cuh), once `score` and
  // `select` hold the two kernels' arguments: `kernel` scores and selects, no
  // selection kernel runs, and no score reaches global memory.
  void PlanFused(const void* kernel, size_t shared, kernels::FusedArgs args) {
    fused_selection = true;
    fused = args;
    score_kernel = kernel;
    score_shared = shared;
    score.scores = nullptr;  // written by no one
    select.scores = nullptr;
    select.uppers = nullptr;
  }

  // The coarse level's part (coarse_select.cuh), once `shape` and `score` hold the
  // fine scoring's: the coarse records scored first, by the same kernel under a
  // Shape whose groups are the coarse ones; then the candidates (`candidates`
  // per list: SelectPolicy::CoarseCandidates); then the fine records of theirs only.
  void PlanCoarse(const ModelLayout& m, const StepInputs& in, int64_t candidates_per_list,
                  int64_t max_nc, int64_t per_block, int lists, float* coarse_scores,
                  uint8_t* candidate_flags) {
    coarse = true;
    coarse_shape = shape;
    coarse_shape.group_blocks = m.coarse_blocks;
    coarse_shape.max_groups = in.max_coarse_groups;
    coarse_shape.num_slots = in.coarse_slots;
    coarse_score = score;
    coarse_score.pool = in.coarse_pool;
    coarse_score.group_table = in.coarse_table;
    coarse_score.scores = coarse_scores;
    coarse_score.coarse = 1;
    const unsigned batch = score_grid.z;
    coarse_grid = dim3(static_cast<unsigned>((max_nc + per_block - 1) / per_block),
                       static_cast<unsigned>(m.num_layers * m.num_kv_heads), batch);
    score.candidates = candidate_flags;
    score.max_coarse_groups = in.max_coarse_groups;
    score.coarse_ratio = m.coarse_ratio();
    candidates = {score.rows,          score.scored,    coarse_scores,
                  candidate_flags,     score.report,    in.max_coarse_groups,
                  candidates_per_list, m.coarse_blocks, m.coarse_ratio()};
    const auto [kernel, warps] = kernels::CandidateKernelFor(m.num_q_heads / lists);
    candidate_kernel = kernel;
    candidate_grid = dim3(m.num_layers * lists, batch);
    candidate_block = dim3(32 * warps);
  }

  // Selection feedback's part (feedback.cuh), once `score` and `select` are set:
  // a block per (layer, query head, row) rewrites the scored heads' scores before
  // the selection (`apply`: not with method off, nor in strict mode, which ranks
  // without the buffer) and consumes the row's entries after it, in every mode.
  void PlanFeedback(const ModelLayout& m, const StepInputs& in, bool apply, bool with_coarse,
                    int64_t max_n, int64_t per_block) {
    feedback_apply = apply;
    feedback_consume = true;
    feedback = {in.feedback,  score.rows,   score.scored,
                score.scores, score.report, std::sqrt(static_cast<double>(m.head_dim))};
    feedback_grid = dim3(static_cast<unsigned>(m.num_layers * m.num_q_heads), score_grid.z);
    // The median's keys in shared memory: room for the longest row's groups, rounded up
    // as the scoring grid rounds them, so that no more graphs are captured than it causes.
    feedback_shared = kernels::FeedbackSharedBytes(
        std::min(in.max_groups, (max_n + per_block - 1) / per_block * per_block));
    if (with_coarse && apply)
      select.feedback = in.feedback;  // fed groups pass the candidates' mask
  }

  absl::Status Launch(cudaStream_t stream) {
    void* terms_params[] = {&shape, &terms};
    if (terms_kernel != nullptr) {
      CUDA_RETURN_IF_ERROR(cudaLaunchKernel(terms_kernel, terms_grid, dim3(kernels::kTermsThreads),
                                            terms_params, terms_shared, stream));
    }
    // Scoring right after the terms may start while they are built (terms_kernel.cuh,
    // LetScoringStart); in a captured graph this is a programmatic edge.
    cudaLaunchAttribute overlap{};
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    auto launch_scoring = [&](dim3 grid, void** params, bool after_terms) {
      cudaLaunchConfig_t config{};
      config.gridDim = grid;
      config.blockDim = dim3(kernels::kScoreThreads);
      config.dynamicSmemBytes = score_shared;
      config.stream = stream;
      config.attrs = &overlap;
      config.numAttrs = after_terms && terms_kernel != nullptr ? 1 : 0;
      return cudaLaunchKernelExC(&config, score_kernel, params);
    };
    void* score_params[] = {&shape, &score};
    if (coarse) {
      // The fine scoring reads the candidates before it would wait for its
      // primary, so it starts only after the candidate kernel finished.
      void* coarse_params[] = {&coarse_shape, &coarse_score};
      CUDA_RETURN_IF_ERROR(launch_scoring(coarse_grid, coarse_params, true));
      void* candidate_params[] = {&shape, &rule, &candidates};
      CUDA_RETURN_IF_ERROR(cudaLaunchKernel(candidate_kernel, candidate_grid, candidate_block,
                                            candidate_params, 0, stream));
      CUDA_RETURN_IF_ERROR(launch_scoring(score_grid, score_params, false));
    } else {
      void* fused_params[] = {&shape, &score, &rule, &select, &fused};
      CUDA_RETURN_IF_ERROR(
          launch_scoring(score_grid, fused_selection ? fused_params : score_params, true));
    }
    if (fused_selection) return absl::OkStatus();  // never with feedback
    void* feedback_params[] = {&shape, &feedback};
    if (feedback_apply) {
      CUDA_RETURN_IF_ERROR(cudaLaunchKernel(reinterpret_cast<const void*>(&kernels::FeedbackKernel),
                                            feedback_grid, dim3(kernels::kFeedbackThreads),
                                            feedback_params, feedback_shared, stream));
    }
    void* select_params[] = {&shape, &rule, &select};
    CUDA_RETURN_IF_ERROR(cudaLaunchKernel(select_kernel, select_grid, select_block, select_params,
                                          select_shared, stream));
    if (feedback_consume) {  // after the selection, which may still fail the step
      CUDA_RETURN_IF_ERROR(cudaLaunchKernel(reinterpret_cast<const void*>(&kernels::ConsumeKernel),
                                            feedback_grid, dim3(kernels::kFeedbackThreads),
                                            feedback_params, 0, stream));
    }
    return absl::OkStatus();
  }

  // The kernel whose parameters carry the step and launch numbers (SelectArgs::step, launch).
  const void* StepKernel() const { return fused_selection ? score_kernel : select_kernel; }

  // That kernel's node parameters; `params` has room for 5.
  cudaKernelNodeParams StepNode(void** params) {
    if (fused_selection) {
      params[0] = &shape;
      params[1] = &score;
      params[2] = &rule;
      params[3] = &select;
      params[4] = &fused;
      cudaKernelNodeParams node{};
      node.func = const_cast<void*>(score_kernel);
      node.gridDim = score_grid;
      node.blockDim = dim3(kernels::kScoreThreads);
      node.sharedMemBytes = static_cast<unsigned>(score_shared);
      node.kernelParams = params;
      return node;
    }
    params[0] = &shape;
    params[1] = &rule;
    params[2] = &select;
    cudaKernelNodeParams node{};
    node.func = const_cast<void*>(select_kernel);
    node.gridDim = select_grid;
    node.blockDim = select_block;
    node.sharedMemBytes = static_cast<unsigned>(select_shared);
    node.kernelParams = params;
    return node;
  }

  // Every parameter's bytes but the step and launch numbers, which a replay sets.
  std::string Key() const {
    std::string key(reinterpret_cast<const char*>(this), sizeof(StepLaunch));
    for (const size_t field :
         {offsetof(kernels::SelectArgs, step), offsetof(kernels::SelectArgs, launch)}) {
      std::fill_n(key.begin() + offsetof(StepLaunch, select) + field, sizeof(uint64_t), '\0');
    }
    return key;
  }
};

// The graphs of recent steps, most recent first: a step whose launch equals a
// cached one's apart from the step and launch numbers replays it, with the selection (or
// fused) node given this step's number; any other step is captured anew (up to
// kCapacity are kept). Thread safety: one caller at a time, as GpuSelector.
class CapturedSteps {
 public:
  CapturedSteps() = default;
  CapturedSteps(const CapturedSteps&) = delete;
  CapturedSteps& operator=(const CapturedSteps&) = delete;
  ~CapturedSteps() {
    for (Captured& c : steps_) Destroy(c);
  }

  absl::Status Replay(cudaStream_t stream, StepLaunch& launch) {
    const std::string key = launch.Key();
    auto it =
        std::find_if(steps_.begin(), steps_.end(), [&](const Captured& c) { return c.key == key; });
    if (it == steps_.end()) {
      Captured c;
      c.key = key;
      cudaError_t ended = cudaSuccess;
      const absl::Status launched = [&]() -> absl::Status {
        const CaptureHold hold;  // no query of this stream while it is captured
        CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        absl::Status queued = launch.Launch(stream);
        ended = cudaStreamEndCapture(stream, &c.graph);
        return queued;
      }();
      if (!launched.ok()) {
        // A launch that failed mid-capture invalidated it: cudaStreamEndCapture's error
        // (not this step's) is cleared, and a graph it still made is freed.
        if (ended != cudaSuccess) ClearFailedCall();
        Destroy(c);
        return launched;
      }
      CUDA_RETURN_IF_ERROR(ended);
      if (absl::Status found = FindStepNode(c.graph, launch.StepKernel(), &c.step_node);
          !found.ok()) {
        Destroy(c);
        return found;
      }
      if (const cudaError_t made = cudaGraphInstantiate(&c.exec, c.graph, 0); made != cudaSuccess) {
        Destroy(c);
        return CudaFailure("cudaGraphInstantiate", made);
      }
      if (steps_.size() == kCapacity) {
        Destroy(steps_.back());
        steps_.pop_back();
      }
      steps_.insert(steps_.begin(), std::move(c));
    } else if (it != steps_.begin()) {
      std::rotate(steps_.begin(), it, it + 1);  // most recent first
    }
    Captured& c = steps_.front();
    void* params[5];
    const cudaKernelNodeParams node = launch.StepNode(params);
    CUDA_RETURN_IF_ERROR(cudaGraphExecKernelNodeSetParams(c.exec, c.step_node, &node));
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(c.exec, stream));
    return absl::OkStatus();
  }

 private:
  static constexpr size_t kCapacity = 8;
  struct Captured {
    std::string key;  // the launch's bytes, step and launch numbers zeroed
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaGraphNode_t step_node = nullptr;  // its parameters carry the step and launch numbers
  };

  static void Destroy(Captured& c) {
    if (c.exec != nullptr) cudaGraphExecDestroy(c.exec);
    if (c.graph != nullptr) cudaGraphDestroy(c.graph);
    c.exec = nullptr;
    c.graph = nullptr;
  }

  static absl::Status FindStepNode(cudaGraph_t graph, const void* kernel,
                                   cudaGraphNode_t* step_node) {
    size_t count = 0;
    CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nullptr, &count));
    std::vector<cudaGraphNode_t> nodes(count);
    CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nodes.data(), &count));
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type;
      CUDA_RETURN_IF_ERROR(cudaGraphNodeGetType(node, &type));
      if (type != cudaGraphNodeTypeKernel) continue;
      cudaKernelNodeParams params{};
      CUDA_RETURN_IF_ERROR(cudaGraphKernelNodeGetParams(node, &params));
      if (params.func == kernel) {
        *step_node = node;
        return absl::OkStatus();
      }
    }
    return absl::InternalError("the captured step has no selection (or fused) kernel node");
  }

  std::vector<Captured> steps_;
};

}  // namespace eps::gpu
