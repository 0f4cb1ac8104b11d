/* libeps_engine: the engine-side device pieces of the client library behind a C ABI,
 * for engines in Python (ctypes, eps_client.engine) or any other language:
 *
 *  - step counters on the engine's stream (gpu/stream_ops.h): signal inputs_ready,
 *    wait for selection_done, release a step densely; and a watchdog that releases
 *    a step epsd accepted but never finished (client/cpp/selection_watchdog.h's
 *    contract, on raw device pointers);
 *  - the device summary writer (gpu/summary.h), synchronous, and a queue that runs it
 *    on the engine's stream without a host wait: Submit queues the appends and a
 *    device counter raise behind them and returns; WaitSummaries waits for that
 *    counter (engine_summary_queue.h says why nothing runs on a stream of its own);
 *  - the engine-ready outputs of client/cpp/engine_outputs.h.
 *
 * Every function returns 0 or a canonical status code (absl::StatusCode values),
 * with the message in eps_engine_last_error() (per thread). Streams are cudaStream_t
 * handles (torch.cuda.Stream.cuda_stream), pointers device addresses. Handles are
 * owned by the caller and freed with their destroy function (NULL: a no-op). Every
 * entry point refuses, with 3 (INVALID_ARGUMENT) and a message, a NULL handle, a NULL
 * required pointer (flags, counters, out-pointers, the model), a NULL array with n > 0
 * and n < 0, and a device pointer not aligned to the words its kernels access there
 * (flags and counters 8 bytes; visit_count, feedback and the engine outputs' int32 arrays
 * 4), before anything is dereferenced or queued; the two that return a count
 * (watchdog_releases, summary_queue_errors) return 0 for a NULL handle and set the
 * message. A destroyed handle is the caller's to forget: it cannot be detected.
 * A device that cannot be made current (an ordinal this process lacks, no driver) is 9
 * (FAILED_PRECONDITION) from every entry point that takes a device or a handle on one, its
 * message naming the ordinal and CUDA's error ("cudaSetDevice(9999): invalid device
 * ordinal"). No C++ exception leaves an entry point (one would end the process): the host
 * out of memory is 8 (RESOURCE_EXHAUSTED), any other exception 13 (INTERNAL), both with a
 * message naming the call; the calls that return a count return 0 then. A count of appends or
 * record runs past one call's (67108863 appends, 2147483647 runs) is refused with 3 before
 * anything is sized by it.
 * Every entry point leaves the calling thread's current device as it found it, those
 * that take a `device` or a handle on one included, and leaves no CUDA error pending on
 * it: a failed call's error is this call's return, not cudaGetLastError()'s for the
 * engine's next launch check to report (a sticky error, one that ends the context, is
 * every call's). Thread safety: each handle is used by one
 * thread at a time, except eps_engine_watchdog_* (see the watchdog below: a call during
 * its destroy's wait is refused, one that may outlive the destroy is undefined) and the summary
 * writer's append and reset, which may be called from any thread.
 */
#ifndef EPS_CLIENT_CPP_ENGINE_CAPI_H_
#define EPS_CLIENT_CPP_ENGINE_CAPI_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 3: EpsEngineModel gained quest8 (2026-11-26). 4: eps_engine_summary_reset and
 * EpsRecordRun; queue submit returns a refusal, drain returns DATA_LOSS for skipped appends.
 * 5: eps_engine_clear_feedback and eps_engine_watchdog_clear_feedback (2026-11-28).
 * The version names the functions and structs; a call the library starts refusing that
 * never worked (watchdog_arm of step 0, which dropped the armed step's watch) or a crash
 * it turns into a refusal (a watchdog call overlapping its destroy) is no new version. */
#define EPS_ENGINE_ABI_VERSION 5

typedef struct EpsEngineModel {
  int32_t num_layers, num_q_heads, num_kv_heads, head_dim;
  int32_t block_size, group_blocks, sketch_dim;
  uint64_t phi_seed;
  int32_t key_sum, principal, quest, quest8; /* SummaryFeatures */
} EpsEngineModel;

/* Keys of one (layer, KV head) for one summary record (gpu::KeyAppend). */
typedef struct EpsKeyAppend {
  uint64_t record; /* float32 record in the summary pool */
  uint64_t keys;   /* `count` keys, `stride` elements apart (0: head_dim) */
  int64_t count;
  int64_t stride;
  int32_t layer;
  int32_t kv_head;
} EpsKeyAppend;

/* `records` consecutive summary records from `first` (gpu::RecordRun): one slot of a pool
 * is one run of num_layers * num_kv_heads records. */
typedef struct EpsRecordRun {
  uint64_t first;
  int64_t records;
} EpsRecordRun;

/* Key element types: the eps.v1 DType numbers. */
enum { EPS_ENGINE_FLOAT32 = 1, EPS_ENGINE_FLOAT16 = 2, EPS_ENGINE_BFLOAT16 = 3 };

int eps_engine_abi_version(void);
const char* eps_engine_last_error(void);
/* The error pending on the calling thread in the library's own CUDA runtime (a cudaError_t;
 * 0 when none), left as it was. The library links its runtime statically, so the caller's
 * cudaGetLastError does not see it; no entry point leaves one (docs/api-memory.md §3.8). */
int eps_engine_peek_cuda_error(void);
int eps_engine_device_count(int32_t* count);

/* Step counters (docs/api-memory.md §3.4). `flags` points at the [2] uint64 flags buffer.
 * eps_engine_preload loads, on `device`, every kernel a call may queue behind a wait on a
 * counter (the stream ops and the engine outputs' kernels): a first launch of a kernel not
 * loaded waits for the context to go idle, which a queued wait holds up for good. */
int eps_engine_preload(int32_t device);
int eps_engine_signal_inputs_ready(uint64_t stream, uint64_t flags, uint64_t step);
int eps_engine_wait_selection(uint64_t stream, uint64_t flags, uint64_t step);
int eps_engine_wait_counter(uint64_t stream, uint64_t counter, uint64_t value);
/* visit_count[0, n) = -1, then selection_done = max(selection_done, step); flags
 * non-NULL, n >= 0, visit_count non-NULL when n > 0. With a
 * `stream` (non-zero) it is queued there and not waited for: the engine's own stream,
 * before its wait for `step`, is the place (no other stream can be held up behind that
 * wait). With stream 0 it runs on a private stream and is waited for. */
int eps_engine_release_dense(int32_t device, uint64_t visit_count, int64_t n, uint64_t flags,
                             uint64_t step, uint64_t stream);

/* feedback[0, n) = NaN (float32): a step that falls back clears the selection feedback
 * before its attention writes it (docs/api-memory.md: no selection consumed the entries of
 * the step before, and the attention would combine its masses with them). n >= 0,
 * feedback non-NULL when n > 0, n * 4 bytes within a size_t (INVALID_ARGUMENT beyond); `stream`
 * as for eps_engine_release_dense. */
int eps_engine_clear_feedback(int32_t device, uint64_t feedback, int64_t n, uint64_t stream);

/* The watchdog borrows visit_count, flags and the feedback: free none of them before
 * eps_engine_watchdog_destroy returns. Its thread reads flags[1] at an armed step's due time
 * and may release it (writes) even after epsd answered, and destroy finishes the armed
 * step's watch. (Python's eps_client.engine.Watchdog keeps its CudaBuffers alive for this.)
 * Any thread may call these functions, destroy included. Destroy first refuses every
 * later call and waits for those running, then finishes the armed step's watch (up to its
 * due time): a call made during that wait is refused with 9 (FAILED_PRECONDITION, "the
 * watchdog is being destroyed"; releases returns 0 then) and touches nothing, where it
 * used to crash. A call that may still be in flight when destroy returns is undefined (a
 * destroy with no step armed returns at once), as for every handle: the handle is freed
 * and cannot be checked, so the caller must order its last calls before the destroy's
 * return (Python's Watchdog holds a lock through each call for this). */
typedef struct EpsEngineWatchdog EpsEngineWatchdog;
int eps_engine_watchdog_create(int32_t device, uint64_t visit_count, int64_t n, uint64_t flags,
                               int64_t timeout_us, EpsEngineWatchdog** out);
/* The watchdog clears feedback[0, n) (as eps_engine_clear_feedback) before each release.
 * A release in progress finishes (with the feedback it started with) before this returns. */
int eps_engine_watchdog_clear_feedback(EpsEngineWatchdog* w, uint64_t feedback, int64_t n);
/* Watches `step` (>= 1; 0, the watchdog's "nothing armed", is refused with 3) from now on:
 * released densely after timeout_us unless selection_done reaches it. A step newer than the
 * armed one supersedes it (its release raises selection_done past the older step too); an
 * older or equal one changes nothing (the newer stays armed, with its due time). */
int eps_engine_watchdog_arm(EpsEngineWatchdog* w, uint64_t step);
uint64_t eps_engine_watchdog_releases(EpsEngineWatchdog* w);
void eps_engine_watchdog_destroy(EpsEngineWatchdog* w);

/* The device summary writer. */
typedef struct EpsSummaryWriter EpsSummaryWriter;
int eps_engine_summary_writer_create(const EpsEngineModel* model, int32_t device,
                                     EpsSummaryWriter** out);
/* The words of one record of the writer's layout: a caller checks it against the
 * records it allocated, so that a feature the struct did not carry fails loudly. */
int eps_engine_summary_writer_record_words(const EpsSummaryWriter* w, int32_t* out);
/* Applies the appends on `stream` and waits for them. Records must be 16-byte aligned and
 * disjoint, keys aligned to their element size (INVALID_ARGUMENT otherwise, nothing
 * applied); an append with a bad key is skipped and reported by an INVALID_ARGUMENT naming
 * the append, key and element. Safe to call from several threads (calls serialise). */
int eps_engine_summary_append(EpsSummaryWriter* w, const EpsKeyAppend* appends, int64_t n,
                              int32_t key_dtype, uint64_t stream);
/* Queues on `stream`, without waiting, the reset of every record of the n runs to the
 * empty record (exactly core's SummaryWriter::Reset bytes). Call it whenever a slot is
 * (re)assigned to a new group, before the group's first append on the same stream: a
 * reused record otherwise keeps the old group's statistics. Runs must be 16-byte aligned
 * and disjoint (INVALID_ARGUMENT, nothing queued). Never waits for the stream: the runs go
 * up from the writer's pinned memory (as a queue's submissions do). */
int eps_engine_summary_reset(EpsSummaryWriter* w, const EpsRecordRun* runs, int64_t n,
                             uint64_t stream);
void eps_engine_summary_writer_destroy(EpsSummaryWriter* w);

typedef struct EpsSummaryQueue EpsSummaryQueue;
/* Shares `writer`'s device state: the writer handle may be destroyed before the queue
 * (the state lives until both are gone). */
int eps_engine_summary_queue_create(EpsSummaryWriter* writer, int32_t device,
                                    EpsSummaryQueue** out);
/* Queues the appends on `after_stream` (after its work so far), then the queue's counter
 * is raised to `step` there. No host wait. Appends refused (a negative or too large n, a
 * null array, a bad key_dtype, keys the host checks refuse, a host copy that cannot be
 * allocated): the counter is still raised and the refusal returned. A null queue raises
 * nothing. One stream per queue: a stream other than the first submit's is refused with
 * INVALID_ARGUMENT (nothing queued, no raise). */
int eps_engine_summary_queue_submit(EpsSummaryQueue* q, const EpsKeyAppend* appends, int64_t n,
                                    int32_t key_dtype, uint64_t after_stream, uint64_t step);
/* Enqueues on `stream`: wait until the appends of `step` are applied. */
int eps_engine_summary_queue_wait(EpsSummaryQueue* q, uint64_t stream, uint64_t step);
/* Host: blocks until the newest submission is applied. DATA_LOSS (15) when the device
 * skipped appends (a bad key: the run is missing from its record) since the last drain. */
int eps_engine_summary_queue_drain(EpsSummaryQueue* q);
/* Submissions refused plus appends skipped on the device (a device read: call after
 * drain), and the last message (copied into buf). */
uint64_t eps_engine_summary_queue_errors(EpsSummaryQueue* q, char* buf, int64_t buf_len);
void eps_engine_summary_queue_destroy(EpsSummaryQueue* q);

/* Engine-ready outputs (client/cpp/engine_outputs.h). cache_blocks > 0 refuses lists
 * naming a block outside [0, cache_blocks) (0: unchecked); refused_out (0: not
 * counted) is a device int32 the refused lists are added to. */
int eps_engine_flash_attention_views(uint64_t visit_blocks, uint64_t visit_count, int32_t layers,
                                     int64_t max_batch, int32_t lists, int64_t max_blocks,
                                     uint64_t engine_table, int64_t table_stride,
                                     uint64_t context_tokens, int64_t batch, int32_t block_size,
                                     int64_t cache_blocks, uint64_t block_table_out,
                                     uint64_t seqused_out, uint64_t refused_out, uint64_t stream);
int eps_engine_flashinfer_fixed(uint64_t visit_blocks, uint64_t visit_count, int32_t layers,
                                int64_t max_batch, int32_t lists, int64_t max_blocks,
                                uint64_t engine_table, int64_t table_stride,
                                uint64_t context_tokens, int64_t batch, int32_t block_size,
                                int64_t cache_blocks, uint64_t indptr, int64_t nnz,
                                uint64_t indices_out, uint64_t last_page_len_out,
                                uint64_t mismatched, uint64_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPS_CLIENT_CPP_ENGINE_CAPI_H_ */
