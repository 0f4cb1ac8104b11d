// What core/ and client/cpp compute, for the Python package's tests to compare
// against bit for bit (client/python/tests). Not installed; built with the tests.
//
//   eps_core_reference summaries L H D M SEED KEY_SUM QUEST PRINCIPAL QUEST8 SLOTS DTYPE OPS
//                      KEYS OUT
//       Replays OPS (text lines "layer slot count kind", kind 0 = Append, 1 = Seal) with
//       core::SummaryWriter on a pool of Reset records, reading each op's keys
//       [count, H, D] of DTYPE (f32 | f16 | bf16) from KEYS in order; writes the pool to OUT.
//   eps_core_reference descriptors L QH H D BS G M KEY_SUM QUEST PRINCIPAL QUEST8 SLOTS MAX_SEQS
//                      MAX_CONTEXT MAX_BATCH PER_HEAD [COARSE_BLOCKS COARSE_SLOTS [FEEDBACK]]
//       Creates client::EngineBuffers and writes its SharedBuffers message to stdout
//       (with a coarse level when COARSE_BLOCKS > 0, with the feedback buffer when
//       FEEDBACK is 1).
//   eps_core_reference contract
//       Writes core/buffer_contract.h's table as JSON to stdout:
//       {"alignment": 256, "region_alignment": 2097152,
//        "buffers": [{"name", "dims", "dtype", "output", "optional", "coarse_level"}]}.
//   eps_core_reference select ATTACH ROWS OUT
//       Maps the host_shm buffers of the serialized AttachRequest ATTACH, runs
//       core::PageSelector::Select with the server's defaults merged with
//       ATTACH's options, for ROWS ("table_row:context_tokens,..."), and writes
//       visit_blocks then visit_count (int32, whole buffers) to OUT. With a coarse
//       level in ATTACH's layout, reads its coarse pool and table too; with a
//       feedback descriptor, a copy of the feedback buffer (the mapping is read-only,
//       so the step's consumption is not written back).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/cpp/engine_buffers.h"
#include "core/buffer_contract.h"
#include "core/phi.h"
#include "core/step.h"
#include "core/summary.h"
#include "nlohmann/json.hpp"
#include "service/convert.h"
#include "service/session_spec.h"

namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "eps_core_reference: %s\n", message.c_str());
  return 2;
}

int Int(const char* s) { return std::atoi(s); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

int Summaries(char** argv) {
  eps::ModelLayout model;
  model.num_layers = Int(argv[0]);
  model.num_kv_heads = Int(argv[1]);
  model.num_q_heads = model.num_kv_heads;
  model.head_dim = Int(argv[2]);
  model.sketch_dim = Int(argv[3]);
  uint64_t seed = 0;
  if (!absl::SimpleAtoi(argv[4], &seed)) return Fail("bad seed");
  model.phi_seed = seed;
  model.features.key_sum = Int(argv[5]) != 0;
  model.features.quest = Int(argv[6]) != 0;
  model.features.principal = Int(argv[7]) != 0;
  model.features.quest8 = Int(argv[8]) != 0;
  const int64_t slots = Int(argv[9]);
  const std::string dtype = argv[10];
  const eps::DType key_dtype = dtype == "f16"    ? eps::DType::kFloat16
                               : dtype == "bf16" ? eps::DType::kBFloat16
                                                 : eps::DType::kFloat32;
  const size_t elem = key_dtype == eps::DType::kFloat32 ? 4 : 2;
  if (absl::Status s = model.Validate(); !s.ok()) return Fail(std::string(s.message()));
  auto phi = eps::PhiBank::Create(model.phi_seed, model.num_layers, model.num_kv_heads,
                                  model.head_dim, model.sketch_dim);
  if (!phi.ok()) return Fail(std::string(phi.status().message()));
  const eps::SummaryWriter writer(model, *phi);
  const int64_t words = writer.layout().record_words;
  std::vector<float> pool(slots * model.num_layers * model.num_kv_heads * words);
  auto record = [&](int64_t slot, int layer, int head) {
    return std::span<float>(
        pool.data() + ((slot * model.num_layers + layer) * model.num_kv_heads + head) * words,
        words);
  };
  for (int64_t s = 0; s < slots; ++s) {
    for (int l = 0; l < model.num_layers; ++l) {
      for (int h = 0; h < model.num_kv_heads; ++h) (void)writer.Reset(record(s, l, h));
    }
  }
  std::ifstream ops(argv[11]);
  const std::string keys = ReadFile(argv[12]);
  size_t at = 0;
  int layer = 0, kind = 0;
  int64_t slot = 0, count = 0;
  while (ops >> layer >> slot >> count >> kind) {
    const size_t bytes = count * model.num_kv_heads * model.head_dim * elem;
    if (at + bytes > keys.size()) return Fail("keys file too short");
    for (int h = 0; h < model.num_kv_heads; ++h) {
      const eps::KeyRows rows{keys.data() + at + h * model.head_dim * elem, key_dtype, count,
                              int64_t{model.num_kv_heads} * model.head_dim};
      const absl::Status s = kind == 1 ? writer.Seal(record(slot, layer, h), layer, h, rows)
                                       : writer.Append(record(slot, layer, h), layer, h, rows);
      if (!s.ok()) {
        return Fail(std::string(s.message()));
      }
    }
    at += bytes;
  }
  std::ofstream out(argv[13], std::ios::binary);
  out.write(reinterpret_cast<const char*>(pool.data()), pool.size() * sizeof(float));
  return out ? 0 : Fail("cannot write output");
}

int Descriptors(char** argv, bool coarse, bool feedback_arg) {
  eps::ModelLayout model;
  model.num_layers = Int(argv[0]);
  model.num_q_heads = Int(argv[1]);
  model.num_kv_heads = Int(argv[2]);
  model.head_dim = Int(argv[3]);
  model.block_size = Int(argv[4]);
  model.group_blocks = Int(argv[5]);
  model.sketch_dim = Int(argv[6]);
  model.features = {.key_sum = Int(argv[7]) != 0,
                    .principal = Int(argv[9]) != 0,
                    .quest = Int(argv[8]) != 0,
                    .quest8 = Int(argv[10]) != 0};
  eps::client::BufferShape shape;
  shape.num_slots = Int(argv[11]);
  shape.max_seqs = Int(argv[12]);
  shape.max_context = Int(argv[13]);
  shape.max_batch = Int(argv[14]);
  shape.granularity = Int(argv[15]) != 0 ? eps::Granularity::kPerKvHead : eps::Granularity::kUnion;
  if (coarse) {
    model.coarse_blocks = Int(argv[16]);
    shape.coarse_slots = Int(argv[17]);
  }
  if (feedback_arg) shape.with_feedback = Int(argv[18]) != 0;
  auto buffers = eps::client::EngineBuffers::Create(model, shape, "pyref");
  if (!buffers.ok()) return Fail(std::string(buffers.status().message()));
  std::string bytes;
  (*buffers)->Descriptors().SerializeToString(&bytes);
  std::cout << bytes;
  return 0;
}

int Select(char** argv) {
  eps::v1::AttachRequest attach;
  if (!attach.ParseFromString(ReadFile(argv[0]))) return Fail("cannot parse the AttachRequest");
  // epsd's own rules for the session (a cpu backend with its default flags): the layout,
  // the query dtype, and the policy with the lists' granularity taken from the rank of
  // visit_blocks when the options leave it unset.
  eps::service::ServerConfig config;
  config.backend = eps::service::BackendKind::kCpu;
  auto spec = eps::service::SessionSpecFromProto(attach, config);
  if (!spec.ok()) return Fail(std::string(spec.status().message()));
  const eps::ModelLayout* model = &spec->model;
  auto policy = eps::service::SessionPolicy(*spec, attach, config.policy);
  if (!policy.ok()) return Fail(std::string(policy.status().message()));
  const eps::v1::SharedBuffers& b = attach.buffers();
  const std::string name = b.summary_pool().host_shm().name();
  const uint64_t size = b.summary_pool().host_shm().size();
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return Fail("shm_open " + name);
  void* base = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return Fail("mmap " + name);
  auto at = [&](const eps::v1::MemoryDescriptor& d) {
    return static_cast<const char*>(base) + d.offset();
  };
  std::vector<eps::StepRow> rows;
  for (absl::string_view part : absl::StrSplit(argv[1], ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(part, ':');
    eps::StepRow row;
    if (f.size() != 2 || !absl::SimpleAtoi(f[0], &row.table_row) ||
        !absl::SimpleAtoi(f[1], &row.context_tokens)) {
      return Fail("bad rows");
    }
    rows.push_back(row);
  }
  eps::StepInputs in;
  in.summary_pool = reinterpret_cast<const float*>(at(b.summary_pool()));
  in.num_slots = b.summary_pool().shape(0);
  in.group_table = reinterpret_cast<const int32_t*>(at(b.group_table()));
  in.block_table = reinterpret_cast<const int32_t*>(at(b.block_table()));
  in.max_seqs = b.group_table().shape(0);
  in.max_groups = b.group_table().shape(1);
  if (model->has_coarse_level()) {
    // Only a descriptor that has a shape (the reference trusts the engine's buffers).
    if (b.coarse_pool().shape_size() != 4 || b.coarse_table().shape_size() != 2) {
      return Fail("the layout has a coarse level, the buffers no coarse_pool or coarse_table");
    }
    in.coarse_pool = reinterpret_cast<const float*>(at(b.coarse_pool()));
    in.coarse_slots = b.coarse_pool().shape(0);
    in.coarse_table = reinterpret_cast<const int32_t*>(at(b.coarse_table()));
    in.max_coarse_groups = b.coarse_table().shape(1);
  }
  std::vector<float> feedback;
  if (b.has_feedback()) {
    if (b.feedback().shape_size() != 4) return Fail("the feedback descriptor has no shape");
    int64_t elems = 1;
    for (int64_t d : b.feedback().shape()) elems *= d;
    const auto* from = reinterpret_cast<const float*>(at(b.feedback()));
    feedback.assign(from, from + elems);
    in.feedback = feedback.data();
  }
  in.max_blocks = b.block_table().shape(1);
  in.num_physical_blocks = attach.num_kv_blocks() == 0 ? -1 : attach.num_kv_blocks();
  in.queries = at(b.queries());
  in.query_dtype = spec->query_dtype;
  in.max_batch = attach.max_batch();
  in.rows = rows;
  int64_t visit_elems = 1, count_elems = 1;
  for (int64_t d : b.visit_blocks().shape()) visit_elems *= d;
  for (int64_t d : b.visit_count().shape()) count_elems *= d;
  std::vector<int32_t> visit(visit_elems, 0), count(count_elems, 0);
  auto phi = eps::PhiBank::Create(model->phi_seed, model->num_layers, model->num_kv_heads,
                                  model->head_dim, model->sketch_dim);
  if (!phi.ok()) return Fail(std::string(phi.status().message()));
  auto selector = eps::PageSelector::Create(*model, *phi);
  if (!selector.ok()) return Fail(std::string(selector.status().message()));
  eps::StepStats stats;
  if (absl::Status s = selector->Select(in, *policy, {visit.data(), count.data()}, &stats);
      !s.ok()) {
    return Fail(std::string(s.message()));
  }
  munmap(base, size);
  std::ofstream out(argv[2], std::ios::binary);
  out.write(reinterpret_cast<const char*>(visit.data()), visit.size() * 4);
  out.write(reinterpret_cast<const char*>(count.data()), count.size() * 4);
  return out ? 0 : Fail("cannot write output");
}

}  // namespace

int Contract() {
  nlohmann::json buffers = nlohmann::json::array();
  for (const eps::BufferSpec& spec : eps::kBufferContract) {
    nlohmann::json dims = nlohmann::json::array();
    for (int i = 0; i < spec.rank; ++i) dims.push_back(eps::DimName(spec.dims[i]));
    buffers.push_back({{"name", spec.name},
                       {"dims", dims},
                       {"dtype", eps::DTypeName(spec.dtype)},
                       {"output", spec.output},
                       {"optional", spec.optional},
                       {"coarse_level", spec.coarse_level}});
  }
  const nlohmann::json contract = {{"alignment", eps::kBufferAlignment},
                                   {"summary_layout", eps::kSummaryLayoutRevision},
                                   {"region_alignment", eps::kRegionAlignment},
                                   {"buffers", buffers}};
  std::cout << contract.dump(2) << "\n";
  return 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "summaries" && argc == 16) return Summaries(argv + 2);
  if (mode == "descriptors" && (argc == 18 || argc == 20 || argc == 21)) {
    return Descriptors(argv + 2, argc >= 20, argc == 21);
  }
  if (mode == "select" && argc == 5) return Select(argv + 2);
  if (mode == "contract" && argc == 2) return Contract();
  return Fail("usage: see the comment at the top of client/python/tools/core_reference.cc");
}
