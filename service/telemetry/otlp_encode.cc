#include "service/telemetry/otlp_encode.h"

#include "service/telemetry/utf8.h"

namespace eps::telemetry {
namespace {

namespace otlp_common = opentelemetry::proto::common::v1;
namespace otlp_trace = opentelemetry::proto::trace::v1;

// OTLP span flags: bits 0-7 the W3C flags, bit 8 "has remote-ness", bit 9 "parent is remote".
constexpr uint32_t kHasIsRemote = 0x100, kIsRemote = 0x200;

void SetValue(const SpanAttribute& a, otlp_common::AnyValue* out) {
  if (const auto* s = std::get_if<std::string>(&a.value)) {
    out->set_string_value(ScrubUtf8(*s));
  } else if (const auto* i = std::get_if<int64_t>(&a.value)) {
    out->set_int_value(*i);
  } else if (const auto* d = std::get_if<double>(&a.value)) {
    out->set_double_value(*d);
  } else {
    out->set_bool_value(std::get<bool>(a.value));
  }
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

// A field of `payload` bytes behind a one-byte tag (field numbers below 16) and its length.
size_t LengthDelimited(size_t payload) { return 1 + VarintSize(payload) + payload; }

// What ScrubUtf8 can make of `text`: itself, or at worst 3 bytes (U+FFFD) for each byte.
size_t ScrubbedSize(const std::string& text) {
  return IsValidUtf8(text) ? text.size() : 3 * text.size();
}

}  // namespace

size_t EncodedSizeBound(const SpanRecord& s) {
  // Span fields (opentelemetry/proto/trace/v1/trace.proto): trace_id 16 bytes, span_id and
  // parent_span_id 8, trace_state, name, kind (varint), two fixed64 times, attributes,
  // status {message, code}, and flags (fixed32, field 16: a two-byte tag).
  size_t span = LengthDelimited(16) + 2 * LengthDelimited(8) +
                LengthDelimited(ScrubbedSize(s.trace_state)) +
                LengthDelimited(ScrubbedSize(s.name)) + 2 + 2 * 9 + (2 + 4);
  for (const SpanAttribute& a : s.attributes) {
    size_t value = 0;
    if (const auto* text = std::get_if<std::string>(&a.value)) {
      value = LengthDelimited(ScrubbedSize(*text));
    } else if (std::holds_alternative<int64_t>(a.value)) {
      value = 1 + 10;
    } else if (std::holds_alternative<double>(a.value)) {
      value = 1 + 8;
    } else {
      value = 1 + 1;
    }
    span += LengthDelimited(LengthDelimited(ScrubbedSize(a.key)) + LengthDelimited(value));
  }
  if (s.error) span += LengthDelimited(LengthDelimited(ScrubbedSize(s.status_message)) + 2);
  return LengthDelimited(span);  // the span as one element of ScopeSpans.spans
}

opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest EncodeSpans(
    const std::vector<std::pair<std::string, std::string>>& resource,
    const std::vector<SpanRecord>& spans) {
  // Every string goes out as valid UTF-8 (ScrubUtf8), whatever the span holds: a strict
  // receiver refuses the whole request for one bad field, and the other spans in it are lost
  // with it. The sources bound and clean what they put in spans; this is the backstop.
  opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest request;
  otlp_trace::ResourceSpans* rs = request.add_resource_spans();
  for (const auto& [key, value] : resource) {
    otlp_common::KeyValue* kv = rs->mutable_resource()->add_attributes();
    kv->set_key(ScrubUtf8(key));
    kv->mutable_value()->set_string_value(ScrubUtf8(value));
  }
  otlp_trace::ScopeSpans* ss = rs->add_scope_spans();
  ss->mutable_scope()->set_name(kScopeName);
  ss->mutable_scope()->set_version(kScopeVersion);
  for (const SpanRecord& s : spans) {
    otlp_trace::Span* out = ss->add_spans();
    out->set_trace_id(s.trace_id.data(), s.trace_id.size());
    out->set_span_id(s.span_id.data(), s.span_id.size());
    if (s.parent_span_id != SpanId{}) {
      out->set_parent_span_id(s.parent_span_id.data(), s.parent_span_id.size());
    }
    out->set_trace_state(ScrubUtf8(s.trace_state));
    out->set_flags(s.trace_flags | kHasIsRemote | (s.parent_is_remote ? kIsRemote : 0));
    out->set_name(ScrubUtf8(s.name));
    out->set_kind(s.kind == SpanKind::kServer ? otlp_trace::Span::SPAN_KIND_SERVER
                                              : otlp_trace::Span::SPAN_KIND_INTERNAL);
    out->set_start_time_unix_nano(s.start_unix_ns);
    out->set_end_time_unix_nano(s.end_unix_ns);
    for (const SpanAttribute& a : s.attributes) {
      otlp_common::KeyValue* kv = out->add_attributes();
      kv->set_key(ScrubUtf8(a.key));
      SetValue(a, kv->mutable_value());
    }
    if (s.error) {
      out->mutable_status()->set_code(otlp_trace::Status::STATUS_CODE_ERROR);
      out->mutable_status()->set_message(ScrubUtf8(s.status_message));
    }
  }
  return request;
}

}  // namespace eps::telemetry
