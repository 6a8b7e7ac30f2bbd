#include "tierflow/core/error.hpp"

#include <cstring>

namespace tierflow {
namespace {

std::string location(const std::source_location& where) {
  std::string_view file = where.file_name();
  // Keep the path from the module folder on: "io/src/uring_engine.cpp".
  for (std::string_view module : {"/core/", "/io/", "/tiers/", "/optim/", "/collectives/",
                                  "/bindings/", "/bench/", "/tests/"}) {
    if (auto pos = file.rfind(module); pos != std::string_view::npos) {
      file.remove_prefix(pos + 1);
      break;
    }
  }
  return std::string(file) + ":" + std::to_string(where.line());
}

}  // namespace

namespace detail {

std::string describe(const error_context& c) {
  std::string out = c.operation.empty() ? std::string("operation") : c.operation;
  if (!c.path.empty()) out += " " + c.path;
  std::string details;
  auto add = [&](const std::string& part) {
    details += details.empty() ? "" : ", ";
    details += part;
  };
  if (c.offset) add("offset " + std::to_string(*c.offset));
  if (c.length) add("length " + std::to_string(*c.length));
  if (!c.tier.empty()) add("tier " + c.tier);
  if (!c.block.empty()) add("block \"" + c.block + "\"");
  if (!details.empty()) out += " (" + details + ")";
  return out;
}

}  // namespace detail

error::error(std::error_code code, error_context context, std::source_location where)
    : std::system_error(code),
      context_(std::move(context)),
      where_(where),
      message_(detail::describe(context_) + ": " + code.message() + " [" + location(where) + "]") {}

error::error(int errnum, error_context context, std::source_location where)
    : error(std::error_code(errnum, std::generic_category()), std::move(context), where) {}

error::error(int errnum, error_context context, std::string message, std::source_location where)
    : error(std::error_code(errnum, std::generic_category()), std::move(context), where, std::move(message)) {}

std::string error::where() const { return location(where_); }

error::error(std::error_code code, error_context context, std::source_location where,
             std::string message)
    : std::system_error(code), context_(std::move(context)), where_(where), message_(std::move(message)) {}

user_error::user_error(std::string message, std::source_location where)
    : error(std::make_error_code(std::errc::invalid_argument), error_context{"invalid input"}, where,
            std::move(message)) {}

void throw_errno(int errnum, error_context context, std::source_location where) {
  throw error(errnum, std::move(context), where);
}

}  // namespace tierflow
