// Test helpers that edit a serialized safetensors file the way corruption or an older writer
// would: one metadata key set or dropped (and the file's content checksum kept or dropped with
// it), and where the tensor data begins (to flip bytes of a tensor in place).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "oscar/io/safetensors.hpp"

namespace oscar::testing {

// Byte offset of the data section: the 8-byte little-endian header length, then the header.
inline uint64_t safetensors_data_start(const std::vector<uint8_t>& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  return 8 + n;
}

// The same file with metadata `key` set to *value (removed where value is null) and the
// checksum key dropped unless keep_checksum (then a changed value no longer matches it).
inline std::vector<uint8_t> with_metadata_key(const std::vector<uint8_t>& bytes, const std::string& key,
                                              const std::string* value, const std::string& checksum_key,
                                              bool keep_checksum) {
  auto file = io::SafetensorsFile::parse(bytes);
  REQUIRE(file.ok());
  io::SafetensorsWriter w;
  for (const auto& [k, v] : file->metadata()) {
    if (k != key && (keep_checksum || k != checksum_key)) w.set_metadata(k, v);
  }
  if (value) w.set_metadata(key, *value);
  for (const io::TensorInfo& t : file->tensors()) REQUIRE(w.add(t.name, t.dtype, t.shape, *file->read_bytes(t)).ok());
  return w.serialize();
}

}  // namespace oscar::testing
