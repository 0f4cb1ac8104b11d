#include "service/session.h"

#include "absl/strings/str_cat.h"

namespace eps::service {

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

StepInputs SessionStepInputs(const Session& session, std::span<const StepRow> rows) {
  const SessionBuffers& b = session.buffers;
  StepInputs in;
  in.summary_pool = reinterpret_cast<const float*>(b.summary_pool.data);
  in.num_slots = session.num_slots;
  in.group_table = reinterpret_cast<const int32_t*>(b.group_table.data);
  in.block_table = reinterpret_cast<const int32_t*>(b.block_table.data);
  in.max_seqs = session.max_seqs;
  in.max_groups = session.max_groups;
  in.max_blocks = session.max_blocks;
  in.num_physical_blocks = session.num_kv_blocks;
  in.queries = b.queries.data;
  in.query_dtype = session.query_dtype;
  in.max_batch = session.max_batch;
  in.rows = rows;
  return in;
}

StepOutputs SessionStepOutputs(const Session& session) {
  return {reinterpret_cast<int32_t*>(session.buffers.visit_blocks.data),
          reinterpret_cast<int32_t*>(session.buffers.visit_count.data)};
}

void Session::Touch() { last_active_ms.store(SteadyNowMs()); }

absl::Status SessionRegistry::Add(std::shared_ptr<Session> session, size_t max_sessions) {
  absl::MutexLock lock(&mu_);
  auto it = id_by_engine_.find(session->engine_id);
  if (it != id_by_engine_.end()) {
    by_id_.erase(it->second);  // the replaced session unmaps once no call holds it
  } else if (by_id_.size() >= max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server holds --max-sessions=", max_sessions, " sessions"));
  }
  id_by_engine_[session->engine_id] = session->id;
  by_id_[session->id] = std::move(session);
  return absl::OkStatus();
}

std::shared_ptr<Session> SessionRegistry::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

bool SessionRegistry::Remove(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return false;
  auto engine = id_by_engine_.find(it->second->engine_id);
  if (engine != id_by_engine_.end() && engine->second == id) id_by_engine_.erase(engine);
  by_id_.erase(it);
  return true;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::TakeExpired(int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> expired;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    if (it->second->Expired(now_ms)) {
      auto engine = id_by_engine_.find(it->second->engine_id);
      if (engine != id_by_engine_.end() && engine->second == it->first) {
        id_by_engine_.erase(engine);
      }
      expired.push_back(std::move(it->second));
      it = by_id_.erase(it);
    } else {
      ++it;
    }
  }
  return expired;
}

size_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return by_id_.size();
}

std::vector<std::shared_ptr<Session>> SessionRegistry::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> all;
  for (const auto& [id, session] : by_id_) all.push_back(session);
  return all;
}

}  // namespace eps::service
