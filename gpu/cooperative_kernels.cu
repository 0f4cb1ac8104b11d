#include "gpu/cooperative_kernels.h"

#include "gpu/cooperative_step.cuh"

namespace eps::gpu {
namespace {

using kernels::CooperativeStepKernel;

template <Method kMethod, int kM = 0, int kHeads = kHeadBatch, int kOctetD = 0,
          bool kQuest8 = false>
const void* Of() {
  return reinterpret_cast<const void*>(&CooperativeStepKernel<kMethod, kM, kHeads, kOctetD, kQuest8>);
}

template <int kOctetD>
const void* QuestClt(bool four, bool quest8) {
  if (quest8) {
    return four ? Of<Method::kQuestClt, 0, 4, kOctetD, true>()
                : Of<Method::kQuestClt, 0, 8, kOctetD, true>();
  }
  return four ? Of<Method::kQuestClt, 0, 4, kOctetD>() : Of<Method::kQuestClt, 0, 8, kOctetD>();
}

const void* const kKernels[] = {
    Of<Method::kJl, 4>(),   Of<Method::kJl, 8>(),         Of<Method::kJl, 16>(),
    Of<Method::kJl, 0>(),   Of<Method::kOnePc>(),         Of<Method::kFro>(),
    Of<Method::kOff>(),     Of<Method::kQuest, 0, 4>(),   Of<Method::kQuest, 0, 8>(),
    QuestClt<0>(true, false),   QuestClt<0>(false, false),   QuestClt<0>(true, true),
    QuestClt<0>(false, true),   QuestClt<64>(true, false),   QuestClt<64>(false, false),
    QuestClt<64>(true, true),   QuestClt<64>(false, true),   QuestClt<128>(true, false),
    QuestClt<128>(false, false), QuestClt<128>(true, true),  QuestClt<128>(false, true),
    QuestClt<256>(true, false), QuestClt<256>(false, false), QuestClt<256>(true, true),
    QuestClt<256>(false, true)};

}  // namespace

std::span<const void* const> CooperativeKernels() { return kKernels; }

const void* CooperativeKernelFor(Method method, int m, int ratio, bool staged, bool octets, int d,
                                 bool quest8) {
  const bool four = ratio <= 4;
  switch (method) {
    case Method::kJl:
      if (staged && m == 4) return Of<Method::kJl, 4>();
      if (staged && m == 8) return Of<Method::kJl, 8>();
      if (staged && m == 16) return Of<Method::kJl, 16>();
      return Of<Method::kJl, 0>();
    case Method::kOnePc:
      return Of<Method::kOnePc>();
    case Method::kFro:
      return Of<Method::kFro>();
    case Method::kQuest:
      return four ? Of<Method::kQuest, 0, 4>() : Of<Method::kQuest, 0, 8>();
    case Method::kQuestClt:
      if (octets && d == 64) return QuestClt<64>(four, quest8);
      if (octets && d == 128) return QuestClt<128>(four, quest8);
      if (octets && d == 256) return QuestClt<256>(four, quest8);
      return QuestClt<0>(four, quest8);
    case Method::kOff:
      break;
  }
  return Of<Method::kOff>();
}

}  // namespace eps::gpu
