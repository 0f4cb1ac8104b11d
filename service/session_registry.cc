#include "service/session_registry.h"

#include "absl/strings/str_cat.h"

namespace eps::service {

absl::Status SessionRegistry::Add(std::shared_ptr<Session> session, size_t max_sessions) {
  absl::MutexLock lock(&mu_);
  auto it = id_by_engine_.find(session->spec().engine_id);
  if (it != id_by_engine_.end()) {
    by_id_.erase(it->second);  // the replaced session unmaps once no call holds it
  } else if (by_id_.size() >= max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server holds --max-sessions=", max_sessions, " sessions"));
  }
  id_by_engine_[session->spec().engine_id] = session->id();
  by_id_[session->id()] = std::move(session);
  return absl::OkStatus();
}

std::shared_ptr<Session> SessionRegistry::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

void SessionRegistry::ForgetEngine(const std::string& engine_id, const std::string& id) {
  auto engine = id_by_engine_.find(engine_id);
  if (engine != id_by_engine_.end() && engine->second == id) id_by_engine_.erase(engine);
}

bool SessionRegistry::Remove(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return false;
  ForgetEngine(it->second->spec().engine_id, id);
  by_id_.erase(it);
  return true;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::TakeExpired(int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> expired;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    if (it->second->Expired(now_ms)) {
      ForgetEngine(it->second->spec().engine_id, it->first);
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
