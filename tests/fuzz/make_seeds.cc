// Writes the fuzz targets' seed corpus: valid and nearly valid requests,
// serialized, one file each. Usage: make_seeds <corpus dir> (it makes
// attach/ and select_pages/ inside). The seeds are committed under
// tests/fuzz/corpus; run this again when the messages change.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "tests/fuzz/fuzz_session.h"

namespace {

void Write(const std::filesystem::path& dir, const std::string& name,
           const google::protobuf::Message& message) {
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary);
  message.SerializeToOstream(&out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds <corpus dir>\n");
    return 2;
  }
  using namespace eps;
  const std::filesystem::path root = argv[1];
  const std::filesystem::path attach_dir = root / "attach", select_dir = root / "select_pages";

  v1::AttachRequest attach = fuzz::SmallInlineAttach("seed-engine");
  Write(attach_dir, "valid_inline", attach);
  v1::AttachRequest per_head = attach;
  per_head.mutable_buffers()->mutable_visit_blocks()->clear_shape();
  for (int64_t s : {2, 2, 2, 16}) per_head.mutable_buffers()->mutable_visit_blocks()->add_shape(s);
  per_head.mutable_buffers()->mutable_visit_count()->add_shape(2);
  Write(attach_dir, "valid_per_kv_head", per_head);
  v1::AttachRequest shm = attach;
  shm.mutable_buffers()->mutable_summary_pool()->mutable_host_shm()->set_name("/eps-fuzz-none");
  shm.mutable_buffers()->mutable_summary_pool()->mutable_host_shm()->set_size(4096);
  Write(attach_dir, "shm_absent", shm);
  v1::AttachRequest options = attach;
  options.mutable_options()->set_method(v1::METHOD_QUEST);
  options.mutable_options()->set_strict(true);
  options.mutable_options()->set_top_pages(3);
  options.mutable_layout()->mutable_features()->set_quest(true);
  Write(attach_dir, "quest_strict", options);
  v1::AttachRequest big = attach;
  big.mutable_layout()->set_num_layers(4096);
  big.mutable_layout()->set_head_dim(1024);
  Write(attach_dir, "huge_layout", big);

  const v1::AttachRequest coarse = fuzz::SmallInlineCoarseAttach("seed-engine");
  Write(attach_dir, "valid_inline_coarse", coarse);
  v1::AttachRequest coarse_without_level = coarse;
  coarse_without_level.mutable_layout()->set_coarse_blocks(0);
  Write(attach_dir, "coarse_buffers_without_level", coarse_without_level);
  v1::AttachRequest coarse_missing = coarse;
  coarse_missing.mutable_buffers()->clear_coarse_table();
  Write(attach_dir, "coarse_table_missing", coarse_missing);

  // Selection feedback [layers, seqs, q_heads, groups], inline and NaN (nothing fed), in
  // the flat session; then with one dimension off.
  v1::AttachRequest feedback = attach;
  *feedback.mutable_buffers()->mutable_feedback() = fuzz::Inline(v1::DTYPE_FLOAT32, {2, 2, 4, 8});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::string nans;
  for (int i = 0; i < 2 * 2 * 4 * 8; ++i) nans.append(reinterpret_cast<const char*>(&nan), 4);
  feedback.mutable_buffers()->mutable_feedback()->mutable_inline_bytes()->set_data(nans);
  Write(attach_dir, "valid_inline_feedback", feedback);
  v1::AttachRequest feedback_heads = feedback;
  feedback_heads.mutable_buffers()->mutable_feedback()->set_shape(2, 2);
  Write(attach_dir, "feedback_bad_shape", feedback_heads);

  // A mass-budget setting per layer (one per layer: valid); then one too few.
  v1::AttachRequest mass_layers = attach;
  mass_layers.mutable_options()->set_budget(v1::BUDGET_MASS);
  for (uint32_t layer = 0; layer < attach.layout().num_layers(); ++layer) {
    v1::MassSetting* m = mass_layers.mutable_options()->add_mass_layers();
    m->set_target(layer == 0 ? 0.5f : 0.99f);
    m->set_temperature(1.0f);
    m->set_max_pages(layer + 1);
  }
  Write(attach_dir, "mass_layers", mass_layers);
  v1::AttachRequest mass_layers_short = mass_layers;
  mass_layers_short.mutable_options()->mutable_mass_layers()->RemoveLast();
  Write(attach_dir, "mass_layers_too_few", mass_layers_short);

  v1::SelectPagesRequest step;
  v1::BatchRow* row = step.add_rows();
  row->set_table_row(0);
  row->set_context_tokens(200);
  row = step.add_rows();
  row->set_table_row(1);
  row->set_context_tokens(256);
  Write(select_dir, "two_rows", step);
  v1::SelectPagesRequest writes = step;
  v1::BufferWrite* w = writes.add_writes();
  w->set_target(v1::BufferWrite::TARGET_QUERIES);
  w->set_offset(0);
  w->set_data(std::string(64, '\x3f'));
  w = writes.add_writes();
  w->set_target(v1::BufferWrite::TARGET_SUMMARY_POOL);
  w->set_offset(128);
  w->set_data(std::string(256, '\x01'));
  Write(select_dir, "with_writes", writes);
  v1::SelectPagesRequest options_step = step;
  options_step.mutable_options()->set_method(v1::METHOD_OFF);
  options_step.mutable_options()->set_budget(v1::BUDGET_TOP_P);
  options_step.mutable_options()->set_top_p(0.5f);
  Write(select_dir, "options", options_step);
  v1::SelectPagesRequest mass_step = step;
  mass_step.mutable_options()->set_budget(v1::BUDGET_MASS);
  for (uint32_t layer = 0; layer < attach.layout().num_layers(); ++layer) {
    v1::MassSetting* m = mass_step.mutable_options()->add_mass_layers();
    m->set_target(0.8f);
    m->set_temperature(layer == 0 ? 0.5f : 2.0f);
    m->set_min_pages(1);
  }
  Write(select_dir, "mass_layers", mass_step);
  mass_step.mutable_options()->mutable_mass_layers(0)->set_min_pages(9);
  mass_step.mutable_options()->mutable_mass_layers(0)->set_max_pages(2);
  Write(select_dir, "mass_layers_min_above_max", mass_step);
  v1::SelectPagesRequest extreme = step;
  extreme.mutable_rows(0)->set_context_tokens(std::numeric_limits<int64_t>::max());
  extreme.mutable_rows(1)->set_table_row(-1);
  Write(select_dir, "extreme_rows", extreme);
  v1::SelectPagesRequest fallbacks = step;
  fallbacks.mutable_fallbacks()->set_deadline(3);
  fallbacks.set_reply_mode(v1::REPLY_MODE_ASYNC);
  Write(select_dir, "async_fallbacks", fallbacks);
  v1::SelectPagesRequest coarse_step = step;
  coarse_step.set_session_id("coarse");  // the fuzz target's coarse session
  coarse_step.mutable_options()->set_coarse_candidates(1.0f);
  w = coarse_step.add_writes();
  w->set_target(v1::BufferWrite::TARGET_COARSE_TABLE);
  w->set_offset(4);
  w->set_data(std::string("\x07\x00\x00\x00", 4));
  w = coarse_step.add_writes();
  w->set_target(v1::BufferWrite::TARGET_COARSE_POOL);
  w->set_offset(0);
  w->set_data(std::string(64, '\x02'));
  Write(select_dir, "coarse_with_writes", coarse_step);
  v1::SelectPagesRequest coarse_on_flat = coarse_step;
  coarse_on_flat.clear_session_id();  // coarse writes to the flat session: refused
  Write(select_dir, "coarse_writes_on_flat", coarse_on_flat);
  return 0;
}
