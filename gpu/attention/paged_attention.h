/* Sparse paged decode attention: the C ABI of libeps_attention.so.
 *
 * One query token per sequence attends over a list of KV-cache blocks in vLLM's
 * FlashAttention layout. The lists are read on the device, never copied to the host,
 * so the same call runs dense (the engine's block table and context lengths) and
 * gated (epsd's visit_blocks / visit_count, docs/api-memory.md section 3.6). Its cost is
 * proportional to the blocks a list names: skipped blocks are never read.
 * docs/benchmarks/attention.md has its measured speed and how to build and load it.
 *
 * Shapes (element strides, the last dimension contiguous):
 *   q          [batch, num_q_heads, head_dim]                    bf16 | fp16
 *   k_cache    [num_blocks, block_size, num_kv_heads, head_dim]  same dtype (kv_cache[0])
 *   v_cache    [num_blocks, block_size, num_kv_heads, head_dim]  same strides (kv_cache[1])
 *   lists      [batch, max_list_blocks] or [batch, num_kv_heads, max_list_blocks] int32
 *   lengths    [batch] or [batch, num_kv_heads]                   int32
 *   out        [batch, num_q_heads, head_dim]                    same dtype as q
 *   lse        [batch, num_q_heads]                              float32, natural log (optional)
 *   feedback   [feedback_seqs, num_q_heads, feedback_groups]     float32 (optional; see below)
 *
 * A row's list (for one KV head) is its first n entries of `lists`, read in list order;
 * the row attends over the first `tokens` tokens of those blocks, FlashAttention's
 * seqused_k semantics: every listed block but the last is full, the last holds
 * tokens - (n - 1) * block_size tokens. With length_kind == EPS_ATTN_SEQUSED_TOKENS,
 * lengths holds `tokens` and n = ceil(tokens / block_size). With
 * EPS_ATTN_VISIT_COUNT, lengths is epsd's visit_count (blocks): n = count and
 * tokens = (n - 1) * block_size + the tokens of the sequence's last block (from
 * context_lens), which epsd always lists last; a count < 0 means "attend densely":
 * the row then reads dense_table[row] over context_lens[row] tokens.
 *
 * Errors. Host-visible arguments (shapes, dtypes, strides, alignment, sizes) are checked
 * before any launch: the call returns EPS_ATTN_EINVAL and eps_attn_last_error() names
 * the field and its value. List contents live on the device and are checked there,
 * recorded in `error_word` (first error wins) and never read out of bounds: a row that
 * cannot be read (tokens or count 0, context_lens 0, a list longer than max_list_blocks,
 * a visit_count above the sequence's ceil(context_lens / block_size) blocks) is written
 * as zeros with lse -inf; a block id outside [0, num_blocks) is skipped, so its row
 * attends over its other listed blocks. eps_attn_read_error() synchronises the stream
 * and turns the word into EPS_ATTN_ELIST and a message. Without an error_word the
 * errors are not reported, and the outputs are the same. Not checked: that the partial
 * block is listed last (EPS_ATTN_VISIT_COUNT); that a list names each block once (a block
 * listed twice is attended twice, by the kernels and the reference alike; epsd's lists
 * never repeat one); that scores are finite in float32 (an
 * overflowing score makes its row NaN; a head whose every score is -inf gets zeros and
 * lse -inf).
 *
 * Selection feedback (optional; docs/api-memory.md "Selection feedback"). With `feedback` set,
 * the call also writes, for every group of blocks a row's list visits, each query
 * head's log Σ exp(score) over the group's listed tokens (score as for lse: natural log,
 * softmax_scale and softcap applied) into epsd's feedback buffer of this layer:
 * entry [feedback_rows[row], qh, block_positions[id] / feedback_group_blocks]. An entry
 * that is NaN takes the value; a finite one is combined with it (log-add-exp, atomic),
 * so the blocks of one group may land in any order and split. Entries of groups no list
 * visits are not touched: epsd leaves them NaN after each step, so the buffer then holds
 * exactly the groups this step visited. block_positions[id] is the index of cache block
 * `id` within its sequence (a block shared by several sequences sits at the same index
 * in each, as prefix sharing places it); eps_attn_block_positions() derives it from a
 * block table. Dense fallback rows (count < 0) visit every group. A position outside
 * [0, feedback_groups * feedback_group_blocks) or a feedback row outside
 * [0, feedback_seqs) is recorded in `error_word` and its entry skipped; the attention
 * output is unaffected. Feedback runs the tensor-core unit (a choice of the planner).
 *
 * Thread safety: every function may be called from any thread; eps_attn_last_error()
 * is per thread. Nothing allocates device memory or synchronises, except
 * eps_attn_read_error(), so eps_attn_paged_decode() can be captured in a CUDA graph.
 */
#ifndef EPS_GPU_ATTENTION_PAGED_ATTENTION_H_
#define EPS_GPU_ATTENTION_PAGED_ATTENTION_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPS_ATTN_ABI_VERSION 2

#if defined(__GNUC__)
#define EPS_ATTN_API __attribute__((visibility("default")))
#else
#define EPS_ATTN_API
#endif

/* Return codes. */
#define EPS_ATTN_OK 0
#define EPS_ATTN_EINVAL 1 /* a host-visible argument is invalid: nothing was launched */
#define EPS_ATTN_ECUDA 2  /* a CUDA call failed */
#define EPS_ATTN_ELIST 3  /* a device-side list was invalid (from eps_attn_read_error) */

/* dtype of q, the KV cache and out. 0 is invalid, so a zeroed struct is refused. */
#define EPS_ATTN_BF16 1
#define EPS_ATTN_FP16 2

/* What `lengths` holds. */
#define EPS_ATTN_SEQUSED_TOKENS 0 /* seqused_k: tokens over the listed blocks */
#define EPS_ATTN_VISIT_COUNT 1    /* epsd's visit_count: blocks; < 0 = dense fallback */

/* int32 words of an error word (device memory, zeroed before first use). */
#define EPS_ATTN_ERROR_WORDS 4

typedef struct EpsAttnParams {
  uint64_t struct_size; /* sizeof(EpsAttnParams): catches a caller built for another ABI */

  const void* q; /* device pointers; q, caches and out 16-byte aligned */
  const void* k_cache;
  const void* v_cache;
  const int32_t* lists;
  const int32_t* lengths;
  const int32_t* dense_table;  /* EPS_ATTN_VISIT_COUNT only: [batch, dense_max_blocks] */
  const int32_t* context_lens; /* EPS_ATTN_VISIT_COUNT only: [batch] tokens */
  void* out;
  float* lse;          /* optional (NULL: not written) */
  void* workspace;     /* eps_attn_workspace_bytes() bytes, 256-byte aligned; may be NULL if 0 */
  int32_t* error_word; /* optional: EPS_ATTN_ERROR_WORDS int32, zeroed */

  int64_t q_stride_row, q_stride_head; /* elements */
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  int64_t lists_stride_row, lists_stride_head;     /* lists_stride_head 0: one list per row */
  int64_t lengths_stride_row, lengths_stride_head; /* lengths_stride_head 0: per row */
  int64_t dense_stride_row;
  int64_t out_stride_row, out_stride_head;
  int64_t lse_stride_row, lse_stride_head;
  uint64_t workspace_bytes;

  int32_t dtype; /* EPS_ATTN_BF16 | EPS_ATTN_FP16 */
  int32_t batch;
  int32_t num_q_heads; /* a multiple of num_kv_heads */
  int32_t num_kv_heads;
  int32_t head_dim;         /* 64, 128 or 256 */
  int32_t block_size;       /* 16 */
  int32_t num_blocks;       /* blocks in the cache: valid ids are [0, num_blocks) */
  int32_t max_list_blocks;  /* entries per list row */
  int32_t dense_max_blocks; /* entries per dense_table row */
  int32_t length_kind;      /* EPS_ATTN_SEQUSED_TOKENS | EPS_ATTN_VISIT_COUNT */
  int32_t num_splits;       /* KV splits per row; 0 = chosen from the list width, shape and
                               occupancy. A row's split covers ceil(count / splits) of its
                               entries (at least 8 when chosen), from its count on the
                               device, so trailing splits may idle */
  float softmax_scale;      /* scores are q.k * softmax_scale (e.g. 1/sqrt(head_dim)) */
  float softcap;            /* > 0: scores become softcap * tanh(score / softcap) */
  int32_t reserved;         /* 0 */

  /* Selection feedback (ABI 2; optional: feedback NULL and the rest 0 when unused). */
  float* feedback;                /* epsd's feedback buffer, at this layer's first entry */
  const int32_t* block_positions; /* [num_blocks]: each block's index within its sequence */
  const int32_t* feedback_rows;   /* [batch]: each row's table row; NULL: row b is row b */
  int64_t feedback_stride_row, feedback_stride_head; /* elements */
  int32_t feedback_seqs;         /* table rows in the buffer (epsd's max_seqs) */
  int32_t feedback_groups;       /* groups per (table row, query head) (max_groups) */
  int32_t feedback_group_blocks; /* blocks per group (epsd's group_blocks) */
  int32_t reserved2;             /* 0 */
} EpsAttnParams;

/* sizeof(EpsAttnParams) and EPS_ATTN_ABI_VERSION of the loaded library. */
EPS_ATTN_API uint64_t eps_attn_params_size(void);
EPS_ATTN_API int32_t eps_attn_abi_version(void);

/* The last error message of this thread ("" after success). */
EPS_ATTN_API const char* eps_attn_last_error(void);

/* Workspace a call with these parameters needs (split partials), in *bytes. Validates
 * the host-visible arguments like eps_attn_paged_decode(), pointers excepted. */
EPS_ATTN_API int32_t eps_attn_workspace_bytes(const EpsAttnParams* params, uint64_t* bytes);

/* Enqueues the attention on `stream` (a cudaStream_t; NULL is the legacy default). */
EPS_ATTN_API int32_t eps_attn_paged_decode(const EpsAttnParams* params, void* stream);

/* Synchronises `stream`, reads `error_word` and returns EPS_ATTN_OK when no device
 * error was recorded, else EPS_ATTN_ELIST with the message in eps_attn_last_error();
 * clear != 0 zeroes the word afterwards. */
EPS_ATTN_API int32_t eps_attn_read_error(int32_t* error_word, void* stream, int32_t clear);

/* Enqueues positions[table[b, j]] = j for every row b < batch and j < min(table_width,
 * ceil(lengths[b] / block_size)) (table [batch, table_width] int32 with row stride
 * table_stride_row, lengths [batch] tokens, device memory): block_positions for the feedback above,
 * from the engine's block table. Ids outside [0, num_blocks) are skipped. Other entries of
 * positions are left as they were. */
EPS_ATTN_API int32_t eps_attn_block_positions(const int32_t* table, int64_t table_stride_row,
                                              int32_t table_width, const int32_t* lengths,
                                              int32_t batch, int32_t block_size, int32_t num_blocks,
                                              int32_t* positions, void* stream);

/* The float64 reference on host memory: params as for eps_attn_paged_decode() but
 * every pointer in host memory; writes out_f64 [batch, num_q_heads, head_dim] and,
 * when lse_f64 is not NULL, lse_f64 [batch, num_q_heads]; with params->feedback set and
 * feedback_f64 not NULL, the feedback into feedback_f64, laid out as params->feedback
 * (the caller fills it with NaN first; entries combine as on the device). List errors
 * and feedback errors return EPS_ATTN_ELIST with a message (the GPU path reports the
 * same ones through error_word). Ignores out, lse, feedback's float32 buffer,
 * workspace and error_word. */
EPS_ATTN_API int32_t eps_attn_reference_host(const EpsAttnParams* params, double* out_f64,
                                             double* lse_f64, double* feedback_f64);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // EPS_GPU_ATTENTION_PAGED_ATTENTION_H_
