#include "service/selector.h"

#include <chrono>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "service/convert.h"
#include "service/cpu_backend.h"
#include "service/cuda_backend.h"

namespace eps::service {
namespace {

std::string NewSessionId(uint64_t counter) {
  static const uint64_t process_nonce = std::random_device{}();
  return absl::StrFormat("s-%08x-%llu", static_cast<uint32_t>(process_nonce),
                         static_cast<unsigned long long>(counter));
}

}  // namespace

Selector::Selector(const ServerConfig& config) : config_(config) {
  reaper_ = std::thread([this] {
    const auto period = absl::Milliseconds(std::max<uint32_t>(10, config_.lease_ms / 10));
    while (!stop_.WaitForNotificationWithTimeout(period)) ExpireSessions();
  });
}

Selector::~Selector() {
  stop_.Notify();
  reaper_.join();
}

absl::Status Selector::CountFailure(absl::Status status) {
  if (!status.ok()) validation_failures_.fetch_add(1, std::memory_order_relaxed);
  return status;
}

void Selector::ExpireSessions() {
  for (const auto& session : sessions_.TakeExpired(SteadyNowMs())) {
    expired_total_.fetch_add(1);
    // The last shared_ptr released (here, or by a call still running) unmaps its memory.
    (void)session;
  }
}

absl::StatusOr<std::shared_ptr<Session>> Selector::BuildSession(const v1::AttachRequest& req) {
  auto s = std::make_shared<Session>();
  if (req.engine_id().empty() || req.engine_id().size() > 256) {
    return absl::InvalidArgumentError("engine_id must be 1-256 bytes");
  }
  s->engine_id = req.engine_id();
  ASSIGN_OR_RETURN(s->model, LayoutFromProto(req.layout(), config_.group_blocks, config_.sketch_dim));
  if (req.layout().query_dtype() == v1::DTYPE_UNSPECIFIED) {
    s->query_dtype = DType::kFloat32;
  } else {
    absl::StatusOr<DType> q = FromProto(req.layout().query_dtype());
    if (!q.ok() || *q == DType::kInt32 || *q == DType::kInt8) {
      return absl::InvalidArgumentError(absl::StrCat("layout.query_dtype=",
                                                     ProtoDTypeName(req.layout().query_dtype()),
                                                     " is not a float type"));
    }
    s->query_dtype = *q;
  }
  if (req.max_batch() < 1) return absl::InvalidArgumentError("max_batch=0 must be >= 1");
  if (req.max_batch() > config_.max_batch) {
    return absl::ResourceExhaustedError(absl::StrCat("max_batch=", req.max_batch(),
                                                     " exceeds the server's --max-batch=",
                                                     config_.max_batch));
  }
  s->max_batch = req.max_batch();
  if (req.num_kv_blocks() > static_cast<uint64_t>(INT32_MAX) + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_blocks=", req.num_kv_blocks(), " exceeds the int32 block id range"));
  }
  s->num_kv_blocks = req.num_kv_blocks() == 0 ? -1 : static_cast<int64_t>(req.num_kv_blocks());
  s->lease_ms = req.lease_ms() == 0 ? config_.lease_ms : std::clamp<uint32_t>(req.lease_ms(), 50, 3600000);

  // Backend: asked for, or the server's --backend; auto follows the memory kind.
  bool cuda = false;
  switch (req.backend()) {
    case v1::BACKEND_CPU:
      break;
    case v1::BACKEND_CUDA:
      cuda = true;
      break;
    case v1::BACKEND_UNSPECIFIED:
      cuda = config_.backend == BackendKind::kCuda ||
             (config_.backend == BackendKind::kAuto &&
              req.buffers().summary_pool().memory_case() == v1::MemoryDescriptor::kCudaIpc);
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("backend=", req.backend(), " is unknown"));
  }
  if (cuda) {
    if (!CudaBackendBuilt() || !CudaDevicePresent()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "backend BACKEND_CUDA is not available: ",
          CudaBackendBuilt() ? "no CUDA device is visible to epsd" : "epsd was built without CUDA"));
    }
    s->device = req.buffers().summary_pool().has_cuda_ipc()
                    ? req.buffers().summary_pool().cuda_ipc().device()
                    : req.device();
    s->mappings.set_cuda_ipc_opener(MakeCudaIpcOpener());
  }

  // Buffers: shapes follow from the layout, the batch and the group/block tables.
  const ModelLayout& m = s->model;
  const SummaryLayout record = SummaryLayout::For(m);
  const v1::SharedBuffers& b = req.buffers();
  const bool per_head = b.visit_blocks().shape_size() == 4;
  s->output_granularity = per_head ? Granularity::kPerKvHead : Granularity::kUnion;
  std::vector<std::pair<TensorSpec, HostTensor>> tensors;
  auto resolve = [&](const v1::MemoryDescriptor& desc, TensorSpec spec,
                     HostTensor* out) -> absl::Status {
    ASSIGN_OR_RETURN(*out, ResolveTensor(desc, spec, s->mappings));
    tensors.emplace_back(std::move(spec), *out);
    return absl::OkStatus();
  };
  SessionBuffers& buf = s->buffers;
  RETURN_IF_ERROR(resolve(b.summary_pool(),
                          {"summary_pool", v1::DTYPE_FLOAT32,
                           {-1, m.num_layers, m.num_kv_heads, record.record_words},
                           {"slots", "num_layers", "num_kv_heads", "record_words"}},
                          &buf.summary_pool));
  s->num_slots = buf.summary_pool.shape[0];
  if (s->num_slots > INT32_MAX) {
    return absl::InvalidArgumentError("summary_pool.shape[0] exceeds the int32 slot range");
  }
  RETURN_IF_ERROR(resolve(b.group_table(),
                          {"group_table", v1::DTYPE_INT32, {-1, -1}, {"max_seqs", "max_groups"}},
                          &buf.group_table));
  s->max_seqs = buf.group_table.shape[0];
  s->max_groups = buf.group_table.shape[1];
  RETURN_IF_ERROR(resolve(b.block_table(),
                          {"block_table", v1::DTYPE_INT32, {s->max_seqs, -1},
                           {"group_table.shape[0]", "max_blocks"}},
                          &buf.block_table));
  s->max_blocks = buf.block_table.shape[1];
  const int64_t batch = s->max_batch;
  RETURN_IF_ERROR(resolve(b.queries(),
                          {"queries", ToProto(s->query_dtype),
                           {m.num_layers, batch, m.num_q_heads, m.head_dim},
                           {"num_layers", "max_batch", "num_q_heads", "head_dim"}},
                          &buf.queries));
  if (per_head) {
    RETURN_IF_ERROR(resolve(b.visit_blocks(),
                            {"visit_blocks", v1::DTYPE_INT32,
                             {m.num_layers, batch, m.num_kv_heads, s->max_blocks},
                             {"num_layers", "max_batch", "num_kv_heads", "max_blocks"}, true},
                            &buf.visit_blocks));
    RETURN_IF_ERROR(resolve(b.visit_count(),
                            {"visit_count", v1::DTYPE_INT32, {m.num_layers, batch, m.num_kv_heads},
                             {"num_layers", "max_batch", "num_kv_heads"}, true},
                            &buf.visit_count));
  } else {
    RETURN_IF_ERROR(resolve(b.visit_blocks(),
                            {"visit_blocks", v1::DTYPE_INT32, {m.num_layers, batch, s->max_blocks},
                             {"num_layers", "max_batch", "max_blocks"}, true},
                            &buf.visit_blocks));
    RETURN_IF_ERROR(resolve(b.visit_count(),
                            {"visit_count", v1::DTYPE_INT32, {m.num_layers, batch},
                             {"num_layers", "max_batch"}, true},
                            &buf.visit_count));
  }
  if (b.has_flags()) {
    RETURN_IF_ERROR(resolve(b.flags(), {"flags", v1::DTYPE_UINT64, {2}, {"2"}, true}, &buf.flags));
    buf.has_flags = true;
  }
  RETURN_IF_ERROR(CheckNoOverlap(tensors));
  for (const auto& [spec, tensor] : tensors) {
    if (cuda && !tensor.is_device) {
      return absl::InvalidArgumentError(absl::StrCat(
          spec.name, " is host memory, but a cuda session needs every buffer as cuda_ipc"));
    }
  }

  ASSIGN_OR_RETURN(SelectPolicy policy, MergeOptions(config_.policy, req.options()));
  if (req.options().granularity() == v1::GRANULARITY_UNSPECIFIED) {
    policy.granularity = s->output_granularity;
  } else if (policy.granularity != s->output_granularity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.granularity=", GranularityName(policy.granularity),
        " does not match the rank-", b.visit_blocks().shape_size(), " visit_blocks buffer"));
  }
  if (policy.heads == HeadMode::kRetrieval && policy.retrieval_heads.empty()) {
    return absl::InvalidArgumentError(
        "heads=retrieval needs options.retrieval_heads ([layers * q_heads] marks)");
  }
  RETURN_IF_ERROR(policy.Validate(m));
  s->policy = std::move(policy);

  ASSIGN_OR_RETURN(PhiBank phi, PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads,
                                                m.head_dim, m.sketch_dim));
  s->phi = std::make_unique<PhiBank>(std::move(phi));
  ASSIGN_OR_RETURN(PageSelector selector, PageSelector::Create(m, *s->phi));
  s->selector = std::make_unique<PageSelector>(std::move(selector));
  if (cuda) {
    ASSIGN_OR_RETURN(s->backend,
                     MakeCudaBackend(m, s->device, s->max_batch, s->max_groups,
                                     std::chrono::milliseconds(config_.inputs_timeout_ms)));
  } else {
    s->backend = MakeCpuBackend();
  }
  return s;
}

absl::Status Selector::Attach(const v1::AttachRequest& request, v1::AttachResponse* response) {
  absl::StatusOr<std::shared_ptr<Session>> built = BuildSession(request);
  if (!built.ok()) return CountFailure(built.status());
  std::shared_ptr<Session> session = *std::move(built);
  session->id = NewSessionId(next_session_.fetch_add(1));
  session->Touch();
  response->set_session_id(session->id);
  response->set_lease_ms(session->lease_ms);
  *response->mutable_effective_options() = ToProto(session->policy);
  response->set_backend(std::string(session->backend->name()) == "cuda" ? v1::BACKEND_CUDA
                                                                         : v1::BACKEND_CPU);
  response->set_record_words(SummaryLayout::For(session->model).record_words);
  response->set_server_version("epsd 0.1.0");
  if (absl::Status s = sessions_.Add(std::move(session), config_.max_sessions); !s.ok()) {
    response->Clear();
    return CountFailure(s);
  }
  attached_total_.fetch_add(1);
  return absl::OkStatus();
}

absl::Status Selector::Detach(const v1::DetachRequest& request) {
  if (!sessions_.Remove(request.session_id())) {
    return CountFailure(absl::NotFoundError(
        absl::StrCat("session '", request.session_id(), "' not found")));
  }
  return absl::OkStatus();
}

absl::Status Selector::ApplyWrites(Session& session, const v1::SelectPagesRequest& request) {
  for (int i = 0; i < request.writes_size(); ++i) {
    const v1::BufferWrite& w = request.writes(i);
    const HostTensor* target = nullptr;
    switch (w.target()) {
      case v1::BufferWrite::TARGET_SUMMARY_POOL:
        target = &session.buffers.summary_pool;
        break;
      case v1::BufferWrite::TARGET_GROUP_TABLE:
        target = &session.buffers.group_table;
        break;
      case v1::BufferWrite::TARGET_BLOCK_TABLE:
        target = &session.buffers.block_table;
        break;
      case v1::BufferWrite::TARGET_QUERIES:
        target = &session.buffers.queries;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("writes[", i, "].target=", w.target(),
                                                       " is not a writable input"));
    }
    if (!target->is_inline) {
      return absl::FailedPreconditionError(absl::StrCat(
          "writes[", i, "] targets ", v1::BufferWrite::Target_Name(w.target()),
          ", which lives in shared memory: write it there instead"));
    }
    uint64_t end = 0;
    if (__builtin_add_overflow(w.offset(), w.data().size(), &end) || end > target->bytes) {
      return absl::InvalidArgumentError(absl::StrCat("writes[", i, "]: offset ", w.offset(), " + ",
                                                     w.data().size(), " bytes exceeds the ",
                                                     target->bytes, "-byte buffer"));
    }
  }
  for (const v1::BufferWrite& w : request.writes()) {
    const HostTensor& t = w.target() == v1::BufferWrite::TARGET_SUMMARY_POOL ? session.buffers.summary_pool
                          : w.target() == v1::BufferWrite::TARGET_GROUP_TABLE ? session.buffers.group_table
                          : w.target() == v1::BufferWrite::TARGET_BLOCK_TABLE ? session.buffers.block_table
                                                                             : session.buffers.queries;
    std::memcpy(t.data + w.offset(), w.data().data(), w.data().size());
  }
  return absl::OkStatus();
}

void Selector::CountStep(Session& session, const StepStats& stats) {
  session.steps.fetch_add(1);
  session.groups_total.fetch_add(stats.groups_total);
  session.groups_visited.fetch_add(stats.groups_visited);
  session.bytes_dense.fetch_add(stats.kv_bytes_dense);
  session.bytes_read.fetch_add(stats.kv_bytes_read_est);
  steps_total_.fetch_add(1);
}

absl::Status Selector::SelectPages(const v1::SelectPagesRequest& request,
                                   v1::SelectPagesResponse* response) {
  std::shared_ptr<Session> session = sessions_.Find(request.session_id());
  if (session == nullptr) {
    return CountFailure(absl::NotFoundError(absl::StrCat(
        "session '", request.session_id(), "' not found (detached or lease expired): re-attach")));
  }
  session->Touch();
  const bool async = request.reply_mode() == v1::REPLY_MODE_ASYNC;
  if (request.reply_mode() != v1::REPLY_MODE_UNSPECIFIED &&
      request.reply_mode() != v1::REPLY_MODE_SYNC && !async) {
    return CountFailure(absl::InvalidArgumentError(
        absl::StrCat("reply_mode=", request.reply_mode(), " is unknown")));
  }
  if (async && !session->backend->async_replies()) {
    return CountFailure(absl::UnimplementedError(absl::StrCat(
        "reply_mode=REPLY_MODE_ASYNC needs the cuda backend; the ", session->backend->name(),
        " backend answers sync")));
  }
  if (request.rows_size() > static_cast<int>(session->max_batch)) {
    return CountFailure(absl::InvalidArgumentError(
        absl::StrCat("batch of ", request.rows_size(), " rows exceeds the session's max_batch=",
                     session->max_batch)));
  }
  absl::StatusOr<SelectPolicy> policy = MergeOptions(session->policy, request.options());
  if (!policy.ok()) return CountFailure(policy.status());
  if (policy->granularity != session->output_granularity) {
    return CountFailure(absl::InvalidArgumentError(
        absl::StrCat("options.granularity=", GranularityName(policy->granularity),
                     " does not match the session's output buffers (",
                     GranularityName(session->output_granularity), ")")));
  }
  std::vector<StepRow> rows;
  rows.reserve(request.rows_size());
  for (const v1::BatchRow& r : request.rows()) {
    rows.push_back({.table_row = r.table_row(), .context_tokens = r.context_tokens(),
                    .seq_id = r.seq_id()});
  }

  absl::MutexLock lock(&session->step_mu);
  if (session->has_step && request.step() <= session->last_step) {
    session->errors.fetch_add(1);
    return CountFailure(absl::FailedPreconditionError(
        absl::StrCat("step ", request.step(), " is not after the session's last step ",
                     session->last_step)));
  }
  if (absl::Status s = ApplyWrites(*session, request); !s.ok()) {
    session->errors.fetch_add(1);
    return CountFailure(s);
  }
  StepResult result;
  const absl::Status run =
      session->backend->Run(*session, rows, request.step(), *policy, async, &result);
  // Async steps finished since the last call count now, whatever this step does.
  for (const FinishedStep& f : result.earlier) {
    v1::StepStats* earlier = response->add_earlier();
    ToProto(f.stats, f.step, f.prepass_us, earlier);
    if (!f.status.ok()) {
      earlier->set_error(f.status.ToString());
      session->errors.fetch_add(1);
      continue;
    }
    CountStep(*session, f.stats);
  }
  if (!run.ok()) {
    session->errors.fetch_add(1);
    return CountFailure(run);
  }
  session->has_step = true;
  session->last_step = request.step();
  session->last_step_seen.store(request.step());
  response->set_step(request.step());
  response->set_done(result.done);
  if (result.done) {
    CountStep(*session, result.stats);
    ToProto(result.stats, request.step(), result.prepass_us, response->mutable_stats());
  }
  if (session->buffers.visit_blocks.is_inline && !session->buffers.visit_blocks.is_device) {
    AppendInlineVisitLists(*session, rows, response);
  }
  session->Touch();
  return absl::OkStatus();
}

absl::Status Selector::Heartbeat(const v1::HeartbeatRequest& request,
                                 v1::HeartbeatResponse* response) {
  std::shared_ptr<Session> session = sessions_.Find(request.session_id());
  if (session == nullptr) {
    return CountFailure(absl::NotFoundError(
        absl::StrCat("session '", request.session_id(), "' not found: re-attach")));
  }
  session->Touch();
  response->set_lease_ms(session->lease_ms);
  return absl::OkStatus();
}

absl::Status Selector::GetStats(const v1::GetStatsRequest& request,
                                v1::GetStatsResponse* response) {
  response->set_sessions_active(sessions_.size());
  response->set_sessions_attached_total(attached_total_.load());
  response->set_sessions_expired_total(expired_total_.load());
  response->set_steps_total(steps_total_.load());
  response->set_validation_failures_total(validation_failures_.load());
  for (const auto& s : sessions_.All()) {
    if (!request.session_id().empty() && s->id != request.session_id()) continue;
    v1::SessionStats* out = response->add_sessions();
    out->set_session_id(s->id);
    out->set_engine_id(s->engine_id);
    out->set_steps(s->steps.load());
    out->set_last_step(s->last_step_seen.load());
    out->set_groups_total(s->groups_total.load());
    out->set_groups_visited(s->groups_visited.load());
    out->set_bytes_kv_dense(s->bytes_dense.load());
    out->set_bytes_kv_read_est(s->bytes_read.load());
    out->set_errors(s->errors.load());
  }
  if (!request.session_id().empty() && response->sessions_size() == 0) {
    return absl::NotFoundError(absl::StrCat("session '", request.session_id(), "' not found"));
  }
  return absl::OkStatus();
}

}  // namespace eps::service
