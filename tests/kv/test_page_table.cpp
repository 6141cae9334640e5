// Page-table views: token counts and every validation error.
#include <doctest/doctest.h>

#include <cstdint>

#include <vector>

#include "oscar/kv/page_table.hpp"

using namespace oscar;

TEST_CASE("num_tokens and page_of follow indptr / last_page_len") {
  const std::vector<int32_t> indptr{0, 2, 2, 5}, indices{4, 1, 0, 3, 2}, last{3, 0, 16};
  const PageTableRef t{indptr.data(), indices.data(), last.data(), 3, 16};
  CHECK(t.num_tokens(0) == 19);
  CHECK(t.num_tokens(1) == 0);
  CHECK(t.num_tokens(2) == 48);
  CHECK(t.page_of(0, 15) == 4);
  CHECK(t.page_of(0, 16) == 1);
  CHECK(t.page_of(2, 47) == 2);
  CHECK(validate(t, 5, "test").ok());
}

TEST_CASE("validation names the broken entry") {
  std::vector<int32_t> indptr{0, 2}, indices{0, 7}, last{3};
  PageTableRef t{indptr.data(), indices.data(), last.data(), 1, 16};
  Status s = validate(t, 5, "int2");
  CHECK(s.code() == StatusCode::kOutOfRange);
  CHECK(s.message().find("int2 page table: indices[1] = 7") != std::string::npos);

  indices[1] = 1;
  last[0] = 17;
  s = validate(t, 5, "sink");
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("last_page_len[0] = 17") != std::string::npos);
  last[0] = 0;
  CHECK_FALSE(validate(t, 5, "sink").ok());
  last[0] = 16;
  CHECK(validate(t, 5, "sink").ok());

  indptr = {1, 2};
  t.indptr = indptr.data();
  CHECK(validate(t, 5, "x").message().find("indptr[0]") != std::string::npos);
  indptr = {0, -1};
  CHECK(validate(t, 5, "x").message().find("decreases") != std::string::npos);
  // indptr[2] - indptr[1] overflows int32 (INT32_MIN + 1 wraps to a positive count): the
  // decrease must still be seen, and the indices loop must not be skipped by the negative end.
  std::vector<int32_t> wrap_indptr{0, INT32_MAX, -2}, wrap_last{1, 1};
  PageTableRef wrap{wrap_indptr.data(), nullptr, wrap_last.data(), 2, 16};
  const Status w = validate(wrap, 5, "x");
  CHECK(!w.ok());
  CHECK(w.message().find("indptr decreases at request 1") != std::string::npos);

  PageTableRef null_table{nullptr, nullptr, nullptr, 1, 16};
  CHECK(validate(null_table, 5, "x").code() == StatusCode::kInvalidArgument);
}
