// Which kernels a step of the GPU pre-pass launches (gpu/step.h), keyed by the
// core Method, Budget and strict mode, and the list of every kernel a step may
// launch, so the selector can load them all up front. Included by gpu/step.cu
// only.
#pragma once

#include <utility>

#include "core/bounds.h"
#include "core/select.h"
#include "gpu/coarse_select.cuh"
#include "gpu/feedback.cuh"
#include "gpu/fused_select.cuh"
#include "gpu/score_kernel.cuh"
#include "gpu/select_kernel.cuh"
#include "gpu/terms_held.cuh"
#include "gpu/terms_kernel.cuh"

namespace eps::gpu::kernels {

// Every kernel the step may launch, so Create can load them all up front.
template <Budget kBudget, bool kStrict, int kWarps>
const void* SelectKernelOf() {
  return reinterpret_cast<const void*>(&SelectKernel<kBudget, kStrict, kWarps>);
}
inline const void* const kSelectKernels[] = {
    SelectKernelOf<Budget::kThreshold, false, 8>(), SelectKernelOf<Budget::kThreshold, false, 32>(),
    SelectKernelOf<Budget::kThreshold, true, 8>(),  SelectKernelOf<Budget::kThreshold, true, 32>(),
    SelectKernelOf<Budget::kFixed, false, 8>(),     SelectKernelOf<Budget::kFixed, false, 32>(),
    SelectKernelOf<Budget::kTopP, false, 8>(),      SelectKernelOf<Budget::kMass, false, 8>()};

// The coarse level's candidate kernel (coarse_select.cuh), with as many warps as
// the selection kernel for the same lists.
template <int kWarps>
const void* CandidateKernelOf() {
  return reinterpret_cast<const void*>(&CandidateKernel<kWarps>);
}
inline const void* const kCandidateKernels[] = {CandidateKernelOf<8>(), CandidateKernelOf<32>()};
inline std::pair<const void*, int> CandidateKernelFor(int heads_per_list) {
  return heads_per_list > 8 ? std::pair{CandidateKernelOf<32>(), 32}
                            : std::pair{CandidateKernelOf<8>(), 8};
}

// Selection feedback's kernels (feedback.cuh): before and after the selection.
inline const void* const kFeedbackKernels[] = {reinterpret_cast<const void*>(&FeedbackKernel),
                                               reinterpret_cast<const void*>(&ConsumeKernel)};

template <Method kMethod, int kM, bool kStrict, int kHeads = kHeadBatch, int kOctetD = 0,
          bool kQuest8 = false>
const void* ScoreKernelOf() {
  return reinterpret_cast<const void*>(
      &ScoreKernel<kMethod, kM, kStrict, kHeads, kOctetD, kQuest8>);
}
inline const void* const kScoreKernels[] = {
    ScoreKernelOf<Method::kJl, 4, false>(),
    ScoreKernelOf<Method::kJl, 8, false>(),
    ScoreKernelOf<Method::kJl, 16, false>(),
    ScoreKernelOf<Method::kJl, 0, false>(),
    ScoreKernelOf<Method::kOnePc, 0, false>(),
    ScoreKernelOf<Method::kFro, 0, false>(),
    ScoreKernelOf<Method::kQuest, 0, false, 4>(),
    ScoreKernelOf<Method::kQuest, 0, false, 8>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 4>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 8>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 4, 64>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 8, 64>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 4, 128>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 8, 128>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 4, 256>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 8, 256>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 4, 64, true>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 8, 64, true>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 4, 128, true>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 8, 128, true>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 4, 256, true>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 8, 256, true>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 4, 0, true>(),
    ScoreKernelOf<Method::kQuestClt, 0, false, 8, 0, true>(),
    ScoreKernelOf<Method::kOff, 0, false>(),
    ScoreKernelOf<Method::kOff, 0, true, 4>(),
    ScoreKernelOf<Method::kOff, 0, true, 8>()};

template <Method kMethod, int kM, int kHeads = kHeadBatch, bool kQuest8 = false>
const void* FusedKernelOf() {
  return reinterpret_cast<const void*>(&FusedSelectKernel<kMethod, kM, kHeads, kQuest8>);
}
inline const void* const kFusedKernels[] = {FusedKernelOf<Method::kJl, 4>(),
                                            FusedKernelOf<Method::kJl, 8>(),
                                            FusedKernelOf<Method::kJl, 16>(),
                                            FusedKernelOf<Method::kJl, 0>(),
                                            FusedKernelOf<Method::kOnePc, 0>(),
                                            FusedKernelOf<Method::kFro, 0>(),
                                            FusedKernelOf<Method::kQuest, 0, 4>(),
                                            FusedKernelOf<Method::kQuest, 0, 8>(),
                                            FusedKernelOf<Method::kQuestClt, 0, 4>(),
                                            FusedKernelOf<Method::kQuestClt, 0, 8>(),
                                            FusedKernelOf<Method::kQuestClt, 0, 4, true>(),
                                            FusedKernelOf<Method::kQuestClt, 0, 8, true>()};

template <int kM>
const void* TermsKernelOf() {
  return reinterpret_cast<const void*>(&TermsKernel<kM>);
}
template <int kM, int kE>
const void* TermsHeldOf() {
  return reinterpret_cast<const void*>(&TermsKernelHeld<kM, kE>);
}
inline const void* const kTermsKernels[] = {
    TermsKernelOf<-1>(), TermsKernelOf<0>(),   TermsKernelOf<4>(),   TermsKernelOf<8>(),
    TermsKernelOf<16>(), TermsHeldOf<-1, 2>(), TermsHeldOf<-1, 4>(), TermsHeldOf<-1, 8>(),
    TermsHeldOf<4, 2>(), TermsHeldOf<4, 4>(),  TermsHeldOf<4, 8>(),  TermsHeldOf<8, 2>(),
    TermsHeldOf<8, 4>(), TermsHeldOf<8, 8>(),  TermsHeldOf<16, 2>(), TermsHeldOf<16, 4>()};

// TermsKernelHeld<kM, d / 32> (TermsHeldFits), or null.
template <int kM>
const void* TermsHeldFor(int d) {
  switch (d) {
    case 64:
      return TermsHeldOf<kM, 2>();
    case 128:
      return TermsHeldOf<kM, 4>();
    case 256:
      if constexpr (kM <= 8) return TermsHeldOf<kM, 8>();
      return nullptr;
    default:
      return nullptr;
  }
}

// The terms kernel: ‖q‖ only unless jl scores, and for jl Φᵀq with m known
// where it is one of the common sketch sizes; TermsKernelHeld (`held`) where it
// fits (d of 64, 128, 256) and the queries allow its 16-byte loads (`aligned`).
struct TermsChoice {
  const void* kernel;
  bool held;
};
inline TermsChoice TermsKernelFor(Method method, int m, int d, bool strict, bool aligned) {
  const int held_m = method != Method::kJl || strict ? -1 : m;
  if (aligned && TermsHeldFits(d, held_m)) {
    const void* held = held_m == -1  ? TermsHeldFor<-1>(d)
                       : held_m == 4 ? TermsHeldFor<4>(d)
                       : held_m == 8 ? TermsHeldFor<8>(d)
                                     : TermsHeldFor<16>(d);
    if (held != nullptr) return {held, true};
  }
  switch (held_m) {
    case -1:
      return {TermsKernelOf<-1>(), false};
    case 4:
      return {TermsKernelOf<4>(), false};
    case 8:
      return {TermsKernelOf<8>(), false};
    case 16:
      return {TermsKernelOf<16>(), false};
    default:
      return {TermsKernelOf<0>(), false};
  }
}

// jl with m of 4, 8 or 16 stages its records in shared memory (score_kernel.cuh)
// when they fit beside the query terms; any other m, or a model whose terms
// leave no room, takes the generic kernel, which reads each record itself.
inline bool StagesRecords(Method method, int m, bool strict) {
  return method == Method::kJl && !strict && (m == 4 || m == 8 || m == 16);
}
// questclt takes its sums an octet of lanes per record (questclt_octets.cuh)
// for d of 64, 128 or 256 with the part it reads (quest8 where the records
// hold it, else quest) on a 16-byte boundary (as core/layout.h places both),
// when its ring fits beside the query terms; else the general path reads each
// record's words into registers (warp_sums.cuh).
inline bool TakesOctetPath(Method method, bool strict, int d, const SummaryLayout& layout) {
  const int part = layout.quest8 >= 0 ? layout.quest8 : layout.quest_min;
  return method == Method::kQuestClt && !strict && HasOctetPath(d) && part >= 0 && part % 4 == 0;
}

// questclt's scoring kernel: the octet path for head dimension kOctetD (0: the
// general path), passes of 4 or 8 heads, over the quest8 part or the 16-bit one.
template <int kOctetD>
const void* QuestCltKernelOf(bool four, bool quest8) {
  if (quest8) {
    return four ? ScoreKernelOf<Method::kQuestClt, 0, false, 4, kOctetD, true>()
                : ScoreKernelOf<Method::kQuestClt, 0, false, 8, kOctetD, true>();
  }
  return four ? ScoreKernelOf<Method::kQuestClt, 0, false, 4, kOctetD>()
              : ScoreKernelOf<Method::kQuestClt, 0, false, 8, kOctetD>();
}

// The scoring kernel for a step: keyed by the core Method (and m for jl's
// register-resident Gram of staged records); strict mode scores brackets
// whatever the method. quest, questclt and strict read their sums for 4 query heads per
// pass of the warp when a KV head has at most 4 (more records per pass), else 8;
// `octets`: questclt takes the octet path (TakesOctetPath and its ring fits) for head
// dimension d, over the quest8 part's codes with `quest8`.
inline const void* ScoreKernelFor(Method method, int m, bool strict, int ratio, bool staged,
                                  bool octets, int d, bool quest8) {
  const bool four = ratio <= 4;
  if (method == Method::kOff) return ScoreKernelOf<Method::kOff, 0, false>();
  if (strict) {
    return four ? ScoreKernelOf<Method::kOff, 0, true, 4>()
                : ScoreKernelOf<Method::kOff, 0, true, 8>();
  }
  switch (method) {
    case Method::kJl:
      if (!staged) return ScoreKernelOf<Method::kJl, 0, false>();
      switch (m) {  // the common sketch sizes keep the Gram in registers
        case 4:
          return ScoreKernelOf<Method::kJl, 4, false>();
        case 8:
          return ScoreKernelOf<Method::kJl, 8, false>();
        case 16:
          return ScoreKernelOf<Method::kJl, 16, false>();
        default:
          return ScoreKernelOf<Method::kJl, 0, false>();
      }
    case Method::kOnePc:
      return ScoreKernelOf<Method::kOnePc, 0, false>();
    case Method::kFro:
      return ScoreKernelOf<Method::kFro, 0, false>();
    case Method::kQuest:
      return four ? ScoreKernelOf<Method::kQuest, 0, false, 4>()
                  : ScoreKernelOf<Method::kQuest, 0, false, 8>();
    case Method::kQuestClt:
      if (octets) {
        switch (d) {
          case 64:
            return QuestCltKernelOf<64>(four, quest8);
          case 128:
            return QuestCltKernelOf<128>(four, quest8);
          case 256:
            return QuestCltKernelOf<256>(four, quest8);
          default:
            break;
        }
      }
      return QuestCltKernelOf<0>(four, quest8);
    case Method::kOff:
      break;
  }
  return ScoreKernelOf<Method::kOff, 0, false>();
}

// The fused scoring-and-selection kernel (fused_select.cuh) for a method that
// scores, chosen as ScoreKernelFor chooses.
inline const void* FusedKernelFor(Method method, int m, int ratio, bool staged, bool quest8) {
  const bool four = ratio <= 4;
  switch (method) {
    case Method::kJl:
      if (!staged) return FusedKernelOf<Method::kJl, 0>();
      switch (m) {
        case 4:
          return FusedKernelOf<Method::kJl, 4>();
        case 8:
          return FusedKernelOf<Method::kJl, 8>();
        case 16:
          return FusedKernelOf<Method::kJl, 16>();
        default:
          return FusedKernelOf<Method::kJl, 0>();
      }
    case Method::kOnePc:
      return FusedKernelOf<Method::kOnePc, 0>();
    case Method::kFro:
      return FusedKernelOf<Method::kFro, 0>();
    case Method::kQuest:
      return four ? FusedKernelOf<Method::kQuest, 0, 4>() : FusedKernelOf<Method::kQuest, 0, 8>();
    case Method::kQuestClt:
      if (quest8) {
        return four ? FusedKernelOf<Method::kQuestClt, 0, 4, true>()
                    : FusedKernelOf<Method::kQuestClt, 0, 8, true>();
      }
      return four ? FusedKernelOf<Method::kQuestClt, 0, 4>()
                  : FusedKernelOf<Method::kQuestClt, 0, 8>();
    case Method::kOff:
      break;
  }
  return nullptr;
}

// The selection kernel and its warps per block: a warp per head for lists of
// more than 8 heads (up to 32), else 8 warps.
inline std::pair<const void*, int> SelectKernelFor(Budget budget, bool strict, int heads_per_list) {
  const bool wide = heads_per_list > 8;
  switch (budget) {
    case Budget::kThreshold:
      if (strict) {
        return wide ? std::pair{SelectKernelOf<Budget::kThreshold, true, 32>(), 32}
                    : std::pair{SelectKernelOf<Budget::kThreshold, true, 8>(), 8};
      }
      return wide ? std::pair{SelectKernelOf<Budget::kThreshold, false, 32>(), 32}
                  : std::pair{SelectKernelOf<Budget::kThreshold, false, 8>(), 8};
    case Budget::kFixed:
      return wide ? std::pair{SelectKernelOf<Budget::kFixed, false, 32>(), 32}
                  : std::pair{SelectKernelOf<Budget::kFixed, false, 8>(), 8};
    case Budget::kTopP:
      break;
    case Budget::kMass:
      return {SelectKernelOf<Budget::kMass, false, 8>(), 8};
  }
  return {SelectKernelOf<Budget::kTopP, false, 8>(), 8};
}

}  // namespace eps::gpu::kernels
