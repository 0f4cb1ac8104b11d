#include "service/session.h"

namespace eps::service {

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Session::Touch() { last_active_ms.store(SteadyNowMs()); }

std::shared_ptr<Session> SessionRegistry::Add(std::shared_ptr<Session> session) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Session> replaced;
  if (auto it = id_by_engine_.find(session->engine_id); it != id_by_engine_.end()) {
    auto old = by_id_.find(it->second);
    if (old != by_id_.end()) {
      replaced = old->second;
      by_id_.erase(old);
    }
  }
  id_by_engine_[session->engine_id] = session->id;
  by_id_[session->id] = std::move(session);
  return replaced;
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
