#include "tierflow/core/checkpoint_manifest.hpp"

#include <nlohmann/json.hpp>

#include "tierflow/core/store.hpp"

namespace tierflow {

using nlohmann::json;

namespace {

std::string message(std::string_view checkpoint, std::string_view block, std::string_view problem) {
  std::string out = "checkpoint " + std::string(checkpoint) + ": ";
  if (!block.empty()) out += "block \"" + std::string(block) + "\": ";
  return out + std::string(problem);
}

}  // namespace

checkpoint_error::checkpoint_error(std::string_view checkpoint, std::string_view block,
                                   std::string_view problem, std::source_location where)
    : error(std::make_error_code(std::errc::bad_message),
            error_context{"restore"}.at(std::string(checkpoint)).of_block(std::string(block)), where,
            message(checkpoint, block, problem)) {}

std::string to_json(const checkpoint_manifest& m) {
  json blocks = json::array();
  for (const manifest_block& b : m.blocks) {
    blocks.push_back({{"id", b.id},
                      {"name", b.name},
                      {"size_bytes", b.size_bytes},
                      {"dtype", name(b.type)},
                      {"shape", b.shape},
                      {"home", name(b.home)},
                      {"offset", b.offset},
                      {"xxh3", b.checksum}});
  }
  const json doc = {{"format", m.format},
                    {"generation", m.generation},
                    {"data_file", m.data_file},
                    {"data_bytes", m.data_bytes},
                    {"blocks", blocks}};
  return doc.dump(1);
}

checkpoint_manifest parse_manifest(std::string_view text, std::string_view checkpoint) {
  checkpoint_manifest m;
  try {
    const json doc = json::parse(text);
    m.format = doc.at("format").get<int>();
    if (m.format != checkpoint_manifest::current_format)
      throw checkpoint_error(checkpoint, "", "manifest format " + std::to_string(m.format) +
                                                 " is not the one this tierflow reads (" +
                                                 std::to_string(checkpoint_manifest::current_format) + ")");
    m.generation = doc.at("generation").get<std::uint64_t>();
    m.data_file = doc.at("data_file").get<std::string>();
    m.data_bytes = doc.at("data_bytes").get<std::uint64_t>();
    if (m.data_file.empty() || m.data_file.find('/') != std::string::npos || m.data_file[0] == '.')
      throw checkpoint_error(checkpoint, "", "manifest names a data file outside the checkpoint");
    for (const json& b : doc.at("blocks")) {
      manifest_block e;
      e.id = b.at("id").get<std::uint32_t>();
      e.name = b.at("name").get<std::string>();
      e.size_bytes = b.at("size_bytes").get<std::uint64_t>();
      e.type = parse_dtype(b.at("dtype").get<std::string>(), "manifest dtype");
      e.shape = b.at("shape").get<std::vector<std::int64_t>>();
      e.home = parse_tier_kind(b.at("home").get<std::string>(), "manifest home");
      e.offset = b.at("offset").get<std::uint64_t>();
      e.checksum = b.at("xxh3").get<std::uint64_t>();
      if (e.id != m.blocks.size())
        throw checkpoint_error(checkpoint, e.name, "manifest ids are not 0, 1, 2, ...");
      if (e.offset % block_alignment != 0 || e.offset + e.size_bytes > m.data_bytes)
        throw checkpoint_error(checkpoint, e.name, "manifest places it outside the data file");
      m.blocks.push_back(std::move(e));
    }
  } catch (const checkpoint_error&) {
    throw;
  } catch (const std::exception& e) {
    throw checkpoint_error(checkpoint, "", std::string("corrupt manifest (") + e.what() + ")");
  }
  return m;
}

checkpoint_manifest describe_store(const block_store& store) {
  checkpoint_manifest m;
  std::uint64_t offset = 0;
  const std::size_t count = store.block_count();
  for (std::uint32_t i = 0; i < count; ++i) {
    const block_desc& d = store.describe(block_id{i});
    manifest_block e;
    e.id = i;
    e.name = d.name;
    e.size_bytes = d.size_bytes;
    e.type = d.type;
    e.shape = d.shape;
    e.home = d.home;
    e.offset = offset;
    offset += aligned_size(d.size_bytes);
    m.blocks.push_back(std::move(e));
  }
  m.data_bytes = offset;
  return m;
}

void check_matches(const checkpoint_manifest& m, const block_store& store,
                   std::string_view checkpoint) {
  const std::size_t count = store.block_count();
  if (count != m.blocks.size())
    throw checkpoint_error(checkpoint, "",
                           "holds " + std::to_string(m.blocks.size()) + " blocks, the store has " +
                               std::to_string(count) + " (a different model or sharding?)");
  for (const manifest_block& e : m.blocks) {
    const block_desc& d = store.describe(block_id{e.id});
    std::string problem;
    if (d.name != e.name)
      problem = "id " + std::to_string(e.id) + " is \"" + d.name + "\" in the store";
    else if (d.size_bytes != e.size_bytes)
      problem = "size " + std::to_string(e.size_bytes) + " bytes, the store's is " +
                std::to_string(d.size_bytes);
    else if (d.type != e.type)
      problem = "dtype " + std::string(name(e.type)) + ", the store's is " + std::string(name(d.type));
    else if (d.shape != e.shape)
      problem = "its shape differs from the store's";
    else if (d.home != e.home)
      problem = "home tier " + std::string(name(e.home)) + ", the store's is " + std::string(name(d.home));
    if (!problem.empty()) throw checkpoint_error(checkpoint, e.name, "mismatch: " + problem);
  }
}

}  // namespace tierflow
