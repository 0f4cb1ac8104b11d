// The live sessions, by id and by engine id.
//
// Thread safety: all methods lock; sessions are shared, so a call that found
// one keeps it alive after it was removed here.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "service/session.h"

namespace eps::service {

class SessionRegistry {
 public:
  // Publishes `session`; a session of the same engine_id is replaced (re-attach
  // after an engine restart) when the new one's owner may use it, and
  // PERMISSION_DENIED otherwise; one attached by an unknown peer (TCP) only once
  // its lease has run out (ALREADY_EXISTS before). RESOURCE_EXHAUSTED when it would
  // be a new session beyond `max_sessions` (checked under the lock, so concurrent
  // attaches agree).
  absl::Status Add(std::shared_ptr<Session> session, size_t max_sessions);
  // What Add would say now of a session of `engine_id` as one beyond `max_sessions`
  // (RESOURCE_EXHAUSTED, or OK): checked before an Attach maps and allocates anything
  // (Add decides).
  absl::Status Room(const std::string& engine_id, size_t max_sessions) const;
  std::shared_ptr<Session> Find(const std::string& id) const;
  bool Remove(const std::string& id);
  // Removes and returns the sessions whose lease ran out.
  std::vector<std::shared_ptr<Session>> TakeExpired(int64_t now_ms);
  size_t size() const;
  std::vector<std::shared_ptr<Session>> All() const;

 private:
  absl::Status RoomLocked(const std::string& engine_id, size_t max_sessions) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Drops `id` from the engine index if it still names `id`.
  void ForgetEngine(const std::string& engine_id, const std::string& id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> by_id_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> id_by_engine_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service
