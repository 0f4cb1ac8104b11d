#include "service/session_registry.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace eps::service {

absl::Status SessionRegistry::Add(std::shared_ptr<Session> session, size_t max_sessions) {
  absl::MutexLock lock(&mu_);
  auto it = id_by_engine_.find(session->spec().engine_id);
  if (it != id_by_engine_.end()) {
    // Only the user that attached a session (or root) replaces it (docs/security.md).
    const auto existing = by_id_.find(it->second);
    if (existing != by_id_.end()) {
      const Session& old = *existing->second;
      if (absl::Status s = old.CheckCaller(session->owner()); !s.ok()) return s;
      // A session whose user is unknown (attached over TCP) is protected by its id
      // alone: an Attach naming its engine_id, which any caller can learn, replaces it
      // only once its lease has run out (its Detach, with the id, frees it at once).
      const Peer& caller = session->owner();
      if (!old.owner().known && !(caller.known && caller.uid == 0) && !old.Expired(SteadyNowMs())) {
        return absl::AlreadyExistsError(absl::StrCat(
            "engine '", session->spec().engine_id,
            "' has a session attached by an unknown peer (over TCP) whose lease of ",
            old.spec().lease_ms,
            " ms has not run out: such a session is replaced only after its lease or its "
            "Detach"));
      }
    }
    by_id_.erase(it->second);  // the replaced session unmaps once no call holds it
  } else {
    RETURN_IF_ERROR(RoomLocked(session->spec().engine_id, max_sessions));
  }
  id_by_engine_[session->spec().engine_id] = session->id();
  by_id_[session->id()] = std::move(session);
  return absl::OkStatus();
}

absl::Status SessionRegistry::Room(const std::string& engine_id, size_t max_sessions) const {
  absl::MutexLock lock(&mu_);
  return RoomLocked(engine_id, max_sessions);
}

absl::Status SessionRegistry::RoomLocked(const std::string& engine_id, size_t max_sessions) const {
  if (id_by_engine_.contains(engine_id) || by_id_.size() < max_sessions) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("the server holds --max-sessions=", max_sessions, " sessions"));
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
