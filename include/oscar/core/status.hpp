// The library's one error model: functions that can fail return a Status (or a Result<T>),
// never throw. Messages name the argument and the problem so a user can act on them.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace oscar {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // a value the caller passed is wrong (null pointer, bad size, ...)
  kUnsupported,         // valid in principle, but not compiled in (head_dim, page_size, ...)
  kOutOfRange,          // an index (page id, request id) outside its table
  kResourceExhausted,   // no free pages left in a pool
  kFailedPrecondition,  // the object is not in a state that allows the call
  kDataLoss,            // a file is truncated or corrupted
  kIoError,             // the operating system refused a read or write
  kCudaError,           // a CUDA runtime call failed
  kInternal,            // a bug in oscar
};

inline const char* to_string(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kResourceExhausted: return "resource exhausted";
    case StatusCode::kFailedPrecondition: return "failed precondition";
    case StatusCode::kDataLoss: return "data loss";
    case StatusCode::kIoError: return "i/o error";
    case StatusCode::kCudaError: return "cuda error";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown";
}

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const {
    if (ok()) return "ok";
    return std::string(oscar::to_string(code_)) + ": " + message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string message) {
  return {StatusCode::kInvalidArgument, std::move(message)};
}
inline Status unsupported(std::string message) {
  return {StatusCode::kUnsupported, std::move(message)};
}
inline Status out_of_range(std::string message) {
  return {StatusCode::kOutOfRange, std::move(message)};
}
inline Status resource_exhausted(std::string message) {
  return {StatusCode::kResourceExhausted, std::move(message)};
}
inline Status failed_precondition(std::string message) {
  return {StatusCode::kFailedPrecondition, std::move(message)};
}
inline Status data_loss(std::string message) { return {StatusCode::kDataLoss, std::move(message)}; }
inline Status io_error(std::string message) { return {StatusCode::kIoError, std::move(message)}; }

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : storage_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : storage_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(storage_).ok()) {
      storage_ = Status(StatusCode::kInternal, "Result constructed from an ok Status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(storage_); }
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(storage_); }
  T& value() & { return std::get<T>(storage_); }
  const T& value() const& { return std::get<T>(storage_); }
  T&& value() && { return std::get<T>(std::move(storage_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> storage_;
};

}  // namespace oscar

// Propagates a non-ok Status to the caller.
#define OSCAR_RETURN_IF_ERROR(expr)              \
  do {                                           \
    ::oscar::Status oscar_status_ = (expr);      \
    if (!oscar_status_.ok()) return oscar_status_; \
  } while (0)
