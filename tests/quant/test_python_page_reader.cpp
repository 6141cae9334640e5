// python/oscar_pages.py, the INT2 page reader for Python engines, against the C++ CPU cache:
// every INT2 block a host::PagedCache wrote (random rows with outlier channels, a NaN row,
// several head dims, quantization groups and page sizes) reads back in Python as the same codes
// and the same float32 rows, bit for bit, as oscar::dequantize_row gives; unrotate(rows, R_K)
// matches the C++ x'·Rᵀ to float32 rounding; a block of the wrong size and an unsupported
// shape are refused with the problem named. Runs Debian's python3 with python3-numpy.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/command.hpp"
#include "host/cache_test_util.hpp"
#include "oscar/quant/row.hpp"

using namespace oscar;
using namespace oscar::testing;

namespace {

const std::filesystem::path kDir = std::filesystem::temp_directory_path() / "oscar_python_page_reader";

template <class T>
void write_file(const std::filesystem::path& path, const std::vector<T>& data) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size() * sizeof(T)));
  REQUIRE(f.good());
}

// The Python side: reads the blocks and the C++ expectations, prints one verdict line.
constexpr const char* kCheck = R"PY(
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import oscar_pages as op
d, page, group, n = (int(a) for a in sys.argv[2:6])
size = op.int2_block_bytes(d, page, group)
blocks = np.fromfile("blocks.bin", np.uint8).reshape(n, size)
want_rows = np.fromfile("rows.bin", np.float32).reshape(n, page, d)
want_codes = np.fromfile("codes.bin", np.uint8).reshape(n, page, d)
rotation = np.fromfile("rotation.bin", np.float32).reshape(d, d)
want_unrotated = np.fromfile("unrotated.bin", np.float32).reshape(n, page, d)
bad = 0
for b in range(n):
    codes, scale, offset = op.read_int2_block(blocks[b], d, page, group)
    rows = op.dequantize_int2_block(blocks[b], d, page, group)
    bad += not np.array_equal(codes, want_codes[b])
    bad += not np.array_equal(rows.view(np.uint32), want_rows[b].view(np.uint32))  # bits, NaNs included
    un = op.unrotate(rows, rotation)
    finite = np.isfinite(want_unrotated[b])
    scale_b = np.abs(want_unrotated[b][finite]).max(initial=1.0)
    bad += not np.array_equal(finite, np.isfinite(un))
    bad += not np.all(np.abs(un[finite] - want_unrotated[b][finite]) <= 1e-6 * scale_b)
last = op.dequantize_int2_block(blocks[0], d, page, group, rows=3)
bad += last.shape != (3, d)
nan_rows = int(np.isnan(np.stack([op.dequantize_int2_block(x, d, page, group) for x in blocks])).all(axis=2).sum())
print(f"blocks={n} mismatches={bad} nan_rows={nan_rows}")
)PY";

// Refusals: each prints the PageError's message.
constexpr const char* kRefusals = R"PY(
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import oscar_pages as op
for call in (lambda: op.read_int2_block(np.zeros(100, np.uint8), 128, 16),
             lambda: op.int2_block_bytes(96, 16),
             lambda: op.int2_block_bytes(128, 12),
             lambda: op.int2_block_bytes(128, 16, 16),
             lambda: op.unrotate(np.zeros((2, 64), np.float32), np.eye(128))):
    try:
        call()
        print("accepted")
    except op.PageError as e:
        print("refused:", e)
)PY";

}  // namespace

TEST_CASE("the Python page reader reads the CPU cache's INT2 blocks bit for bit") {
  struct Shape {
    int d, page, group;
  };
  for (const Shape s : {Shape{64, 8, 64}, Shape{128, 16, 32}, Shape{128, 64, 128}, Shape{256, 32, 64}}) {
    CAPTURE(s.d);
    CAPTURE(s.page);
    CAPTURE(s.group);
    host::CacheConfig c;
    c.num_layers = 1;
    c.num_kv_heads = 2;
    c.num_qo_heads = 2;
    c.head_dim = s.d;
    c.quant_group_size = s.group;
    c.page_size = s.page;
    c.sink_tokens = 0;
    c.recent_tokens = 0;
    c.num_int2_pages = 16;
    c.num_bf16_pages = 4;
    c.max_requests = 1;
    host::PagedCache cache = make_cache(c, true, 5, 0.96f, 0.9f);
    const auto id = cache.add_request();
    REQUIRE(id.ok());
    RowGenerator keys(21, s.d), values(22, s.d);
    const int tokens = 3 * s.page + 5;  // three whole INT2 pages, the rest in the window
    KvRows kv = random_kv(keys, values, c, tokens);
    kv.k[size_t(s.page + 2) * c.num_kv_heads * s.d + 7] = bf16_t{0x7fc0};  // a NaN key row: stored as NaN
    const int32_t count = tokens;
    REQUIRE(cache.append(std::span<const host::RequestId>(&*id, 1), std::span<const int32_t>(&count, 1), kv.k.data(),
                         kv.v.data())
                .ok());
    const auto tables = cache.page_tables(std::span<const host::RequestId>(&*id, 1));
    REQUIRE(tables.ok());
    REQUIRE(tables->int2.indices.size() == 3);

    // Every (INT2 page, head) block of K: its bytes, the C++ codes and rows, and rows·R_Kᵀ.
    using T = host::PagedCache::Tensor;
    const Int2PoolRef pool = cache.int2_pool(0, T::kKeys);
    const Int2Layout& layout = pool.layout;
    const std::vector<float>& r = cache.layer_quantizer(0).k_rotation;
    std::vector<uint8_t> blocks, codes;
    std::vector<float> rows, unrotated;
    int n = 0;
    for (const int32_t page : tables->int2.indices) {
      for (int32_t h = 0; h < c.num_kv_heads; ++h, ++n) {
        const uint8_t* block = pool.block(page, h);
        blocks.insert(blocks.end(), block, block + layout.block_bytes());
        for (int t = 0; t < s.page; ++t) {
          std::vector<float> x(size_t(s.d));
          dequantize_row(layout.codes(block, t), layout.meta(block, t), s.d, s.group, x.data());
          rows.insert(rows.end(), x.begin(), x.end());
          for (int e = 0; e < s.d; ++e) codes.push_back(uint8_t(unpack_code(layout.codes(block, t), e, s.group)));
          for (int i = 0; i < s.d; ++i) {
            double acc = 0;
            for (int k = 0; k < s.d; ++k) acc += double(x[size_t(k)]) * r[size_t(i) * s.d + k];
            unrotated.push_back(float(acc));
          }
        }
      }
    }
    std::filesystem::create_directories(kDir);
    write_file(kDir / "blocks.bin", blocks);
    write_file(kDir / "rows.bin", rows);
    write_file(kDir / "codes.bin", codes);
    write_file(kDir / "rotation.bin", r);
    write_file(kDir / "unrotated.bin", unrotated);
    {
      std::ofstream f(kDir / "check.py");
      f << kCheck;
    }
    const std::string dir = std::filesystem::path(OSCAR_PAGES_PY).parent_path().string();
    const auto result = run_command("cd " + kDir.string() + " && " + OSCAR_PYTHON3 + " check.py " + dir + " " + std::to_string(s.d) + " " +
                                        std::to_string(s.page) + " " + std::to_string(s.group) + " " + std::to_string(n),
                                    kDir);
    INFO(result.err);
    REQUIRE(result.code == 0);
    CHECK(result.out == "blocks=" + std::to_string(n) + " mismatches=0 nan_rows=1\n");
  }
}

TEST_CASE("the Python page reader refuses a wrong block size and unsupported shapes by name") {
  std::filesystem::create_directories(kDir);
  {
    std::ofstream f(kDir / "refusals.py");
    f << kRefusals;
  }
  const std::string dir = std::filesystem::path(OSCAR_PAGES_PY).parent_path().string();
  const auto result = run_command("cd " + kDir.string() + " && " + OSCAR_PYTHON3 + " refusals.py " + dir, kDir);
  INFO(result.err);
  REQUIRE(result.code == 0);
  CHECK(result.out.find("refused: an INT2 block of head_dim 128, page_size 16 and quant_group 128 has 576 bytes; got 100") !=
        std::string::npos);
  CHECK(result.out.find("refused: head_dim 96 is not supported") != std::string::npos);
  CHECK(result.out.find("refused: page_size 12 is not supported") != std::string::npos);
  CHECK(result.out.find("refused: quant_group 16 is not supported for head_dim 128") != std::string::npos);
  CHECK(result.out.find("refused: rotation of shape (128, 128) for rows of 64 channels") != std::string::npos);
  CHECK(result.out.find("accepted") == std::string::npos);
}
