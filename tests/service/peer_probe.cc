// Plays another local user against a running epsd, for session_isolation_test:
// tries to step, inspect, detach and replace a session it did not attach, and
// prints one line "step=<code> stats=<code> detach=<code> replace=<code> listed=<n>";
// with a fourth argument, a file holding a serialized AttachRequest (another user's
// buffers), it also attaches that and appends " borrow=<code>".
// Usage: peer_probe <target> <session_id> <engine_id> [attach_request_file]
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/service/raw_calls.h"

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr,
                 "usage: peer_probe <target> <session_id> <engine_id> [attach_request_file]\n");
    return 2;
  }
  using namespace eps;
  auto stub = testing::RawStub(argv[1]);
  const std::string session = argv[2];
  v1::BatchRow row;
  row.set_table_row(0);
  row.set_context_tokens(900);
  const grpc::Status step = testing::RawStep(*stub, testing::StepRequest(session, 1u << 30, {row}));
  grpc::Status stats;
  {
    grpc::ClientContext context;
    testing::SetDeadline(context, std::chrono::seconds(10));
    v1::GetStatsRequest request;
    request.set_session_id(session);
    v1::GetStatsResponse response;
    stats = stub->GetStats(&context, request, &response);
  }
  int listed = 0;
  {
    grpc::ClientContext context;
    testing::SetDeadline(context, std::chrono::seconds(10));
    v1::GetStatsResponse response;
    if (stub->GetStats(&context, v1::GetStatsRequest(), &response).ok()) {
      for (const v1::SessionStats& s : response.sessions()) {
        if (!s.session_id().empty() || s.engine_id() == argv[3]) ++listed;
      }
    }
  }
  grpc::Status detach;
  {
    grpc::ClientContext context;
    testing::SetDeadline(context, std::chrono::seconds(10));
    v1::DetachRequest request;
    request.set_session_id(session);
    v1::DetachResponse response;
    detach = stub->Detach(&context, request, &response);
  }
  // Replace: attach a session of the victim's engine_id (a minimal valid layout, inline buffers).
  v1::AttachRequest attach;
  attach.set_engine_id(argv[3]);
  v1::ModelLayout* l = attach.mutable_layout();
  l->set_num_layers(1);
  l->set_num_q_heads(1);
  l->set_num_kv_heads(1);
  l->set_head_dim(4);
  l->set_block_size(16);
  l->set_group_blocks(1);
  l->set_sketch_dim(1);
  attach.set_max_batch(1);
  attach.mutable_options()->set_method(v1::METHOD_JL);  // minimal records: no quest part
  auto inline_desc = [](v1::MemoryDescriptor* d, v1::DType dtype, std::vector<int64_t> shape) {
    d->set_dtype(dtype);
    for (int64_t s : shape) d->add_shape(s);
    d->mutable_inline_bytes();
  };
  v1::SharedBuffers* b = attach.mutable_buffers();  // record_words = 4 for m = 1
  inline_desc(b->mutable_summary_pool(), v1::DTYPE_FLOAT32, {1, 1, 1, 4});
  inline_desc(b->mutable_group_table(), v1::DTYPE_INT32, {1, 1});
  inline_desc(b->mutable_block_table(), v1::DTYPE_INT32, {1, 1});
  inline_desc(b->mutable_queries(), v1::DTYPE_FLOAT32, {1, 1, 1, 4});
  inline_desc(b->mutable_visit_blocks(), v1::DTYPE_INT32, {1, 1, 1});
  inline_desc(b->mutable_visit_count(), v1::DTYPE_INT32, {1, 1});
  v1::AttachResponse attached;
  const grpc::Status replace = testing::RawAttach(*stub, attach, &attached);
  std::printf("step=%d stats=%d detach=%d replace=%d listed=%d", step.error_code(),
              stats.error_code(), detach.error_code(), replace.error_code(), listed);
  if (!replace.ok()) std::fprintf(stderr, "replace: %s\n", replace.error_message().c_str());
  if (argc == 5) {  // another user's buffers, named in an Attach of this user's own
    std::ifstream file(argv[4], std::ios::binary);
    std::stringstream bytes;
    bytes << file.rdbuf();
    v1::AttachRequest borrowed;
    if (!borrowed.ParseFromString(bytes.str())) {
      std::printf(" borrow=unreadable\n");
      return 0;
    }
    v1::AttachResponse borrowed_response;
    const grpc::Status borrow = testing::RawAttach(*stub, borrowed, &borrowed_response);
    std::printf(" borrow=%d", borrow.error_code());
    if (!borrow.ok()) std::fprintf(stderr, "borrow: %s\n", borrow.error_message().c_str());
  }
  std::printf("\n");
  return 0;
}
