#include "service/session_registry.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace eps::service {
namespace {

EngineKey KeyOf(const Session& session) {
  return EngineKey::Of(session.owner(), session.spec().engine_id);
}

}  // namespace

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Add(std::shared_ptr<Session> session,
                                                              const SessionLimits& limits) {
  absl::MutexLock lock(&mu_);
  const EngineKey key = KeyOf(*session);
  ASSIGN_OR_RETURN(std::shared_ptr<Session> replaced, AdmissionLocked(key, limits));
  if (replaced != nullptr) by_id_.erase(replaced->id());
  id_by_engine_[key] = session->id();
  by_id_[session->id()] = std::move(session);
  return replaced;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Admission(
    const EngineKey& key, const SessionLimits& limits) const {
  absl::MutexLock lock(&mu_);
  return AdmissionLocked(key, limits);
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::AdmissionLocked(
    const EngineKey& key, const SessionLimits& limits) const {
  const auto engine = id_by_engine_.find(key);
  if (engine == id_by_engine_.end()) {
    RETURN_IF_ERROR(RoomLocked(key, limits));
    return nullptr;
  }
  const auto existing = by_id_.find(engine->second);
  if (existing == by_id_.end()) return nullptr;
  const Session& old = *existing->second;
  // A session whose user is unknown (attached over TCP) is protected by its id
  // alone: an Attach naming its engine_id, which any caller can learn, replaces it
  // only once its lease has run out (its Detach, with the id, frees it at once).
  if (!key.known && !old.Expired(SteadyNowMs())) {
    return absl::AlreadyExistsError(
        absl::StrCat("engine '", key.engine_id,
                     "' has a session attached by an unknown peer (over TCP) whose lease of ",
                     old.spec().lease_ms,
                     " ms has not run out: such a session is replaced only after its lease or its "
                     "Detach"));
  }
  return existing->second;
}

absl::Status SessionRegistry::RoomLocked(const EngineKey& key, const SessionLimits& limits) const {
  if (by_id_.size() >= limits.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server holds --max-sessions=", limits.max_sessions, " sessions"));
  }
  if (limits.max_per_user == 0) return absl::OkStatus();
  // The owner's engines are one run of the index, ordered by (known, uid, engine_id).
  size_t owned = 0;
  for (auto it = id_by_engine_.lower_bound({.known = key.known, .uid = key.uid, .engine_id = {}});
       it != id_by_engine_.end() && it->first.known == key.known && it->first.uid == key.uid;
       ++it) {
    ++owned;
  }
  if (owned < limits.max_per_user) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(key.known ? absl::StrCat("uid ", key.uid)
                             : std::string("the callers of unknown credentials (TCP)"),
                   " hold", key.known ? "s" : "", " --max-sessions-per-user=", limits.max_per_user,
                   " sessions: detach one, or ask the operator for a larger quota"));
}

std::shared_ptr<Session> SessionRegistry::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

void SessionRegistry::ForgetEngine(const Session& session) {
  auto engine = id_by_engine_.find(KeyOf(session));
  if (engine != id_by_engine_.end() && engine->second == session.id()) {
    id_by_engine_.erase(engine);
  }
}

std::shared_ptr<Session> SessionRegistry::Remove(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return nullptr;
  ForgetEngine(*it->second);
  std::shared_ptr<Session> removed = std::move(it->second);
  by_id_.erase(it);
  return removed;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::TakeExpired(int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> expired;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    if (it->second->Expired(now_ms)) {
      ForgetEngine(*it->second);
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
