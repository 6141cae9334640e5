// oscar-fit: calibration activations (or saved accumulators) -> an OSCAR plan file.
// See `oscar-fit --help` and docs/fitting.md. Exit status: 0 success, 2 bad arguments or a bad
// input file (one message on stderr), 1 anything else (for example the output cannot be written).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "oscar/fit/accumulators.hpp"
#include "oscar/fit/fit_plan.hpp"
#include "oscar/io/accumulator_file.hpp"
#include "oscar/io/plan_file.hpp"
#include "oscar/io/safetensors.hpp"

namespace {

using namespace oscar;

constexpr const char* kUsage = R"(usage: oscar-fit (--calibration FILE | --accumulators FILE [--held-out FILE])
                 --output PLAN [options]

Fits one K rotation, one V rotation and two clip ratios per layer (OSCAR, method.md §2) and
writes them as a plan file (safetensors; docs/fitting.md describes every tensor and key).

Input (exactly one of):
  --calibration FILE      safetensors with, per layer l = 0, 1, ...: layers.{l}.q [T, Hq, d],
                          layers.{l}.k [T, Hkv, d], layers.{l}.v [T, Hkv, d], post-RoPE,
                          F32, F16 or BF16; optionally layers.{l}.attn_mass [T, Hkv] (F32)
                          for --value-weights mass. A held-out subset of the tokens is kept
                          out of the statistics for the clip search.
  --accumulators FILE     statistics saved by an engine (oscar::io::save_accumulators).
  --held-out FILE         with --accumulators: held-out tokens, same layout as --calibration
                          (layers.{l}.q may be absent). Needed for --clip fitted.

Output:
  --output PLAN           the plan file to write (atomically: temp file + rename).
  --save-accumulators F   also save the accumulated statistics (with --calibration).

Fitting:
  --method M              oscar (default), hadamard, random_hadamard, identity, ktk.
  --clip MODE             fitted (default): grid search per layer on held-out tokens;
                          fixed: --k-clip / --v-clip for every layer.
  --clip-grid G           ratios to search: HI:LO:STEP (default 1.00:0.85:0.01) or a
                          comma-separated list; every ratio in (0, 1].
  --k-clip R, --v-clip R  fixed ratios (default 0.96 and 0.92, the authors' values).
  --value-weights W       proxy (default): w_t = k A_h k^T, two passes per layer;
                          mass: the file's layers.{l}.attn_mass (exact attention mass).
  --held-out-fraction F   fraction of the tokens held out for the clip search (default 0.1).
  --max-held-out-tokens N cap on held-out tokens per layer (default 1024).
  --skip-tokens N         ignore the first N tokens (warm-up; default 0).
  --seed S                seed of the held-out split and of random_hadamard (default 0).
  --no-bit-reversal       R = U·H without the bit-reversal permutation.
  --quant-group-size G    quantization group the plan is fitted for (default 0: whole row).
  --sink-tokens N         BF16 sink recorded in the plan (default 64).
  --recent-tokens N       BF16 recent window recorded in the plan (default 256).
  --model-name NAME       recorded in the plan's metadata.
  --threads N             fitting threads (default: all cores).
  --chunk-tokens N        tokens per accumulator update (default 2048).
  --quiet                 no progress lines, only the summary table.
  --help                  this text.
)";

struct Args {
  std::string calibration, accumulators, held_out, output, save_accumulators;
  fit::FitOptions fit;
  std::string value_weights = "proxy";
  double held_out_fraction = 0.1;
  int64_t max_held_out = 1024;
  int64_t skip_tokens = 0;
  int64_t chunk_tokens = 2048;
  bool quiet = false;
};

[[noreturn]] void fail(const std::string& message, int code = 2) {
  std::fprintf(stderr, "oscar-fit: %s\n", message.c_str());
  std::exit(code);
}

double parse_double(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || !std::isfinite(v)) fail(flag + ": \"" + s + "\" is not a number");
  return v;
}
int64_t parse_int(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno != 0) fail(flag + ": \"" + s + "\" is not an integer");
  if (v < lo || v > hi) fail(flag + ": " + s + " outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

std::vector<float> parse_grid(const std::string& s) {
  std::vector<float> grid;
  if (s.find(':') != std::string::npos) {
    const size_t a = s.find(':'), b = s.find(':', a + 1);
    if (b == std::string::npos) fail("--clip-grid: expected HI:LO:STEP, got \"" + s + "\"");
    const double hi = parse_double("--clip-grid", s.substr(0, a));
    const double lo = parse_double("--clip-grid", s.substr(a + 1, b - a - 1));
    const double step = parse_double("--clip-grid", s.substr(b + 1));
    if (!(step > 0) || lo > hi) fail("--clip-grid: need LO <= HI and STEP > 0, got \"" + s + "\"");
    for (int i = 0; hi - i * step >= lo - 1e-9; ++i) {
      grid.push_back(static_cast<float>(std::round((hi - i * step) * 1e6) / 1e6));
      if (grid.size() > 1000) fail("--clip-grid: more than 1000 ratios");
    }
  } else {
    size_t start = 0;
    while (start <= s.size()) {
      const size_t comma = std::min(s.find(',', start), s.size());
      grid.push_back(static_cast<float>(parse_double("--clip-grid", s.substr(start, comma - start))));
      start = comma + 1;
    }
  }
  for (float r : grid) {
    if (!(r > 0.0f && r <= 1.0f)) fail("--clip-grid: ratio " + std::to_string(r) + " outside (0, 1]");
  }
  return grid;
}

Args parse_args(int argc, char** argv) {
  Args a;
  std::set<std::string> given;  // the flags on the command line: one that cannot apply is refused, not ignored
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    given.insert(flag);
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(flag + " needs a value (see --help)");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (flag == "--calibration") {
      a.calibration = value();
    } else if (flag == "--accumulators") {
      a.accumulators = value();
    } else if (flag == "--held-out") {
      a.held_out = value();
    } else if (flag == "--output") {
      a.output = value();
    } else if (flag == "--save-accumulators") {
      a.save_accumulators = value();
    } else if (flag == "--method") {
      auto m = fit::parse_rotation_method(value());
      if (!m.ok()) fail("--method: " + m.status().message());
      a.fit.method = *m;
    } else if (flag == "--clip") {
      const std::string v = value();
      if (v != "fitted" && v != "fixed") fail("--clip: expected fitted or fixed, got \"" + v + "\"");
      a.fit.fit_clip = v == "fitted";
    } else if (flag == "--clip-grid") {
      a.fit.clip_grid = parse_grid(value());
    } else if (flag == "--k-clip" || flag == "--v-clip") {
      const double r = parse_double(flag, value());
      if (!(r > 0 && r <= 1)) fail(flag + ": " + std::to_string(r) + " outside (0, 1]");
      (flag == "--k-clip" ? a.fit.fixed_k_clip_ratio : a.fit.fixed_v_clip_ratio) = static_cast<float>(r);
    } else if (flag == "--value-weights") {
      a.value_weights = value();
      if (a.value_weights != "proxy" && a.value_weights != "mass") {
        fail("--value-weights: expected proxy or mass, got \"" + a.value_weights + "\"");
      }
    } else if (flag == "--held-out-fraction") {
      a.held_out_fraction = parse_double(flag, value());
      if (!(a.held_out_fraction >= 0 && a.held_out_fraction < 1)) fail("--held-out-fraction: must be in [0, 1)");
    } else if (flag == "--max-held-out-tokens") {
      a.max_held_out = parse_int(flag, value(), 0, INT64_MAX);
    } else if (flag == "--skip-tokens") {
      a.skip_tokens = parse_int(flag, value(), 0, INT64_MAX);
    } else if (flag == "--seed") {
      a.fit.seed = static_cast<uint64_t>(parse_int(flag, value(), 0, INT64_MAX));
    } else if (flag == "--no-bit-reversal") {
      a.fit.bit_reversal = false;
    } else if (flag == "--quant-group-size") {
      a.fit.quant_group_size = static_cast<int32_t>(parse_int(flag, value(), 0, 256));
      if (a.fit.quant_group_size != 0 && (!is_power_of_two(a.fit.quant_group_size) || a.fit.quant_group_size < 32)) {
        fail("--quant-group-size: " + std::to_string(a.fit.quant_group_size) +
             " is not supported (0 for the whole row, or a power of two from 32 to head_dim)");
      }
    } else if (flag == "--sink-tokens") {
      a.fit.sink_tokens = static_cast<int32_t>(parse_int(flag, value(), 0, INT32_MAX));
    } else if (flag == "--recent-tokens") {
      a.fit.recent_tokens = static_cast<int32_t>(parse_int(flag, value(), 0, INT32_MAX));
    } else if (flag == "--model-name") {
      a.fit.model_name = value();
    } else if (flag == "--threads") {
      a.fit.threads = static_cast<int>(parse_int(flag, value(), 1, 1024));
    } else if (flag == "--chunk-tokens") {
      a.chunk_tokens = parse_int(flag, value(), 1, 1 << 20);
    } else if (flag == "--quiet") {
      a.quiet = true;
    } else {
      fail("unknown option \"" + flag + "\" (see --help)");
    }
  }
  if (a.calibration.empty() == a.accumulators.empty()) fail("give exactly one of --calibration and --accumulators");
  if (!a.held_out.empty() && a.accumulators.empty()) fail("--held-out goes with --accumulators");
  if (a.output.empty()) fail("--output is required");
  if (!a.save_accumulators.empty() && a.calibration.empty()) fail("--save-accumulators goes with --calibration");
  if (a.fit.fit_clip && !a.accumulators.empty() && a.held_out.empty()) {
    fail("--clip fitted needs held-out tokens: give --held-out FILE, or use --clip fixed");
  }
  for (const char* flag : {"--k-clip", "--v-clip"}) {
    if (a.fit.fit_clip && given.contains(flag)) {
      fail(std::string(flag) + " sets a fixed ratio: it goes with --clip fixed (--clip fitted searches --clip-grid)");
    }
  }
  if (!a.fit.fit_clip && given.contains("--clip-grid")) fail("--clip-grid is searched by --clip fitted, not --clip fixed");
  if (!a.accumulators.empty()) {
    // The accumulators' tokens are already summed: these choose which calibration tokens to sum.
    for (const char* flag : {"--held-out-fraction", "--skip-tokens", "--chunk-tokens"}) {
      if (given.contains(flag)) fail(std::string(flag) + " goes with --calibration, not --accumulators");
    }
  }
  return a;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The per-layer tensors of an activation file, checked for consistent shapes.
struct ActivationFile {
  io::SafetensorsFile file;
  fit::ModelShape shape;
  int64_t tokens = 0;
  bool has_q = true;
};

ActivationFile open_activations(const std::string& path, bool need_q, bool need_mass) {
  auto f = io::SafetensorsFile::open(path);
  if (!f.ok()) fail(f.status().message());
  ActivationFile a{std::move(*f), {}, 0, need_q};
  int32_t layers = 0;
  while (a.file.find(io::layer_tensor_name(layers, "k"))) ++layers;
  if (layers == 0) fail(path + ": no tensor \"layers.0.k\" (see --help for the expected layout)");
  const io::TensorInfo* k0 = a.file.find("layers.0.k");
  if (k0->shape.size() != 3) fail(path + ": tensor \"layers.0.k\" has shape " + k0->shape_string() + ", expected [T, Hkv, d]");
  a.tokens = k0->shape[0];
  a.shape.num_layers = layers;
  a.shape.num_kv_heads = static_cast<int32_t>(k0->shape[1]);
  a.shape.head_dim = static_cast<int32_t>(k0->shape[2]);
  const io::TensorInfo* q0 = a.file.find("layers.0.q");
  a.has_q = q0 != nullptr;
  if (need_q && !q0) fail(path + ": tensor \"layers.0.q\" is missing");
  a.shape.num_qo_heads = q0 && q0->shape.size() == 3 ? static_cast<int32_t>(q0->shape[1]) : a.shape.num_kv_heads;
  const Status valid = fit::validate(a.shape);
  if (!valid.ok()) fail(path + ": " + valid.message());
  if (!is_supported_head_dim(a.shape.head_dim)) {
    fail(path + ": head_dim " + std::to_string(a.shape.head_dim) + " is not supported (64, 128, 256)");
  }
  for (int32_t l = 0; l < layers; ++l) {
    auto check = [&](const char* name, std::vector<int64_t> want, bool required) {
      const std::string n = io::layer_tensor_name(l, name);
      const io::TensorInfo* t = a.file.find(n);
      if (!t) {
        if (required) fail(path + ": tensor \"" + n + "\" is missing");
        return;
      }
      if (t->shape != want) {
        io::TensorInfo w;
        w.shape = want;
        fail(path + ": tensor \"" + n + "\" has shape " + t->shape_string() + ", expected " + w.shape_string());
      }
      const bool mass = std::strcmp(name, "attn_mass") == 0;
      if (mass ? t->dtype != io::DType::kF32
               : (t->dtype != io::DType::kF32 && t->dtype != io::DType::kF16 && t->dtype != io::DType::kBF16)) {
        fail(path + ": tensor \"" + n + "\" has dtype " + io::to_string(t->dtype) +
             (mass ? ", expected F32" : ", expected F32, F16 or BF16"));
      }
    };
    const int64_t T = a.tokens, hq = a.shape.num_qo_heads, hk = a.shape.num_kv_heads, d = a.shape.head_dim;
    if (need_q) check("q", {T, hq, d}, true);
    check("k", {T, hk, d}, true);
    check("v", {T, hk, d}, true);
    check("attn_mass", {T, hk}, need_mass);
  }
  return a;
}

std::vector<float> read_tensor(const ActivationFile& a, int32_t layer, const char* name) {
  auto v = a.file.read_as<float>(io::layer_tensor_name(layer, name));
  if (!v.ok()) fail(v.status().message());
  for (float x : *v) {
    if (!std::isfinite(x)) fail(a.file.source() + ": tensor \"" + io::layer_tensor_name(layer, name) + "\" has NaN or Inf");
  }
  return std::move(*v);
}

// Moves the rows of `held` (sorted token indices) out of x [tokens, row] into the result and
// compacts the remaining rows to the front, keeping their order: no second copy of x.
std::vector<float> split_rows(std::vector<float>& x, int64_t tokens, int64_t row, const std::vector<int64_t>& held) {
  std::vector<float> out(held.size() * row);
  size_t next = 0;
  int64_t write = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* src = x.data() + t * row;
    if (next < held.size() && held[next] == t) {
      std::copy(src, src + row, out.data() + next * row);
      ++next;
    } else {
      if (write != t) std::copy(src, src + row, x.data() + write * row);
      ++write;
    }
  }
  x.resize(write * row);
  return out;
}

void print_summary(const fit::FitResult& r, bool have_objectives) {
  std::printf("\n%5s %9s %9s %6s %6s %12s %12s\n", "layer", "spread_K", "spread_V", "rho_K", "rho_V", "J_K/J_K(H)",
              "J_V/J_V(H)");
  double jk = 0, jv = 0;
  for (const fit::LayerReport& l : r.reports) {
    const double rk = l.j_k / l.j_k_hadamard, rv = l.j_v / l.j_v_hadamard;
    if (have_objectives) {
      std::printf("%5d %9.2f %9.2f %6.2f %6.2f %12.4f %12.4f\n", l.layer, l.k_spread, l.v_spread, l.k_clip_ratio,
                  l.v_clip_ratio, rk, rv);
      jk += rk;
      jv += rv;
    } else {
      std::printf("%5d %9.2f %9.2f %6.2f %6.2f %12s %12s\n", l.layer, l.k_spread, l.v_spread, l.k_clip_ratio,
                  l.v_clip_ratio, "-", "-");
    }
  }
  if (have_objectives) {
    const double n = static_cast<double>(r.reports.size());
    std::printf("%5s %9s %9s %6s %6s %12.4f %12.4f\n", "mean", "", "", "", "", jk / n, jv / n);
  }
  std::printf("spread = max eigenvalue / mean eigenvalue of the fitted target (0: the method uses none).\n"
              "J relative to the Hadamard baseline (normalized Hadamard, rho_K 0.96, rho_V 0.92) on the\n"
              "held-out tokens; below 1 is better.\n");
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  const auto t0 = std::chrono::steady_clock::now();
  const bool mass = args.value_weights == "mass";
  std::vector<fit::LayerStatistics> stats;
  std::vector<fit::HeldOutLayer> held;
  fit::ModelShape shape;
  int64_t calibration_tokens = 0;

  if (!args.calibration.empty()) {
    const ActivationFile in = open_activations(args.calibration, true, mass);
    shape = in.shape;
    if (args.skip_tokens >= in.tokens) {
      fail("--skip-tokens " + std::to_string(args.skip_tokens) + " leaves none of the " + std::to_string(in.tokens) +
           " tokens");
    }
    const int64_t usable = in.tokens - args.skip_tokens;
    int64_t n_held = std::min<int64_t>(args.max_held_out, static_cast<int64_t>(args.held_out_fraction * usable));
    if (!args.fit.fit_clip && args.held_out_fraction == 0) n_held = 0;
    if (args.fit.fit_clip && n_held == 0) fail("--clip fitted needs held-out tokens: raise --held-out-fraction");
    if (usable - n_held <= 0) fail("no calibration tokens left after the held-out split");
    // The same held-out tokens in every layer: a seeded sample, sorted.
    std::vector<int64_t> order(usable);
    std::iota(order.begin(), order.end(), args.skip_tokens);
    std::mt19937_64 rng(args.fit.seed);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int64_t> held_idx(order.begin(), order.begin() + n_held);
    std::sort(held_idx.begin(), held_idx.end());
    std::vector<int64_t> skipped(args.skip_tokens);
    std::iota(skipped.begin(), skipped.end(), 0);

    auto acc = fit::CalibrationAccumulator::create(shape);
    if (!acc.ok()) fail(acc.status().message());
    const int64_t d = shape.head_dim, hq = shape.num_qo_heads, hk = shape.num_kv_heads;
    for (int32_t l = 0; l < shape.num_layers; ++l) {
      const auto tl = std::chrono::steady_clock::now();
      std::vector<float> q = read_tensor(in, l, "q"), k = read_tensor(in, l, "k"), v = read_tensor(in, l, "v");
      std::vector<float> m = mass ? read_tensor(in, l, "attn_mass") : std::vector<float>();
      int64_t tokens = in.tokens;
      if (args.skip_tokens > 0) {  // drop the warm-up tokens
        split_rows(q, tokens, hq * d, skipped);
        split_rows(k, tokens, hk * d, skipped);
        split_rows(v, tokens, hk * d, skipped);
        if (mass) split_rows(m, tokens, hk, skipped);
        tokens -= args.skip_tokens;
      }
      std::vector<int64_t> local(held_idx.size());
      for (size_t i = 0; i < held_idx.size(); ++i) local[i] = held_idx[i] - args.skip_tokens;
      fit::HeldOutLayer h;
      h.tokens = n_held;
      split_rows(q, tokens, hq * d, local);
      h.k = split_rows(k, tokens, hk * d, local);
      h.v = split_rows(v, tokens, hk * d, local);
      if (mass) h.value_weights = split_rows(m, tokens, hk, local);
      tokens -= n_held;
      for (int64_t t = 0; t < tokens; t += args.chunk_tokens) {
        const int64_t n = std::min(args.chunk_tokens, tokens - t);
        Status s = acc->add_chunk(l, q.data() + t * hq * d, k.data() + t * hk * d, v.data() + t * hk * d, n);
        if (s.ok() && mass) s = acc->add_values_weighted(l, v.data() + t * hk * d, m.data() + t * hk, n);
        if (!s.ok()) fail(s.message(), 1);
      }
      if (!mass) {
        const Status frozen = acc->freeze_layer(l);
        if (!frozen.ok()) fail(frozen.message(), 1);
        for (int64_t t = 0; t < tokens; t += args.chunk_tokens) {
          const int64_t n = std::min(args.chunk_tokens, tokens - t);
          const Status s = acc->add_values_proxy(l, k.data() + t * hk * d, v.data() + t * hk * d, n);
          if (!s.ok()) fail(s.message(), 1);
        }
      }
      auto st = acc->statistics(l);
      if (!st.ok()) fail(st.status().message(), 1);
      stats.push_back(std::move(*st));
      held.push_back(std::move(h));
      calibration_tokens = tokens;
      if (!args.quiet) {
        std::fprintf(stderr, "[oscar-fit] layer %d/%d: %lld calibration + %lld held-out tokens accumulated in %.2f s\n",
                     l + 1, shape.num_layers, static_cast<long long>(tokens), static_cast<long long>(n_held),
                     seconds_since(tl));
      }
    }
    if (!args.save_accumulators.empty()) {
      const Status s = io::save_accumulators(*acc, args.save_accumulators);
      if (!s.ok()) fail(s.message(), 1);
    }
  } else {
    auto acc = io::load_accumulators(args.accumulators);
    if (!acc.ok()) fail(acc.status().message());
    shape = acc->shape();
    for (int32_t l = 0; l < shape.num_layers; ++l) {
      auto st = acc->statistics(l);
      if (!st.ok()) fail(args.accumulators + ": " + st.status().message());
      calibration_tokens = st->tokens;
      stats.push_back(std::move(*st));
    }
    if (!args.held_out.empty()) {
      const ActivationFile in = open_activations(args.held_out, false, mass);
      if (in.shape.num_layers != shape.num_layers || in.shape.num_kv_heads != shape.num_kv_heads ||
          in.shape.head_dim != shape.head_dim) {
        fail(args.held_out + ": held-out tokens of another model (" + in.shape.to_string() + ") than the accumulators (" +
             shape.to_string() + ")");
      }
      const int64_t n = std::min(in.tokens, args.max_held_out);
      for (int32_t l = 0; l < shape.num_layers; ++l) {
        fit::HeldOutLayer h;
        h.tokens = n;
        h.k = read_tensor(in, l, "k");
        h.v = read_tensor(in, l, "v");
        h.k.resize(n * shape.num_kv_heads * shape.head_dim);
        h.v.resize(h.k.size());
        if (mass) {
          h.value_weights = read_tensor(in, l, "attn_mass");
          h.value_weights.resize(n * shape.num_kv_heads);
        }
        held.push_back(std::move(h));
      }
    }
  }

  const auto tf = std::chrono::steady_clock::now();
  auto result = fit::fit_plan(shape, stats, held, args.fit, [&](const fit::LayerReport& r) {
    if (!args.quiet) {
      std::fprintf(stderr, "[oscar-fit] fitted layer %d: rho_K %.2f rho_V %.2f\n", r.layer, r.k_clip_ratio,
                   r.v_clip_ratio);
    }
  });
  if (!result.ok()) fail(result.status().message(), result.status().code() == StatusCode::kInternal ? 1 : 2);
  result->plan.calibration_tokens = calibration_tokens;
  const Status saved = io::save_plan(result->plan, args.output);
  if (!saved.ok()) fail(saved.message(), 1);
  print_summary(*result, !held.empty());
  std::printf("wrote %s: %s, %d layers, fitted in %.2f s (%.2f s total)\n", args.output.c_str(),
              result->plan.method.c_str(), shape.num_layers, seconds_since(tf), seconds_since(t0));
  return 0;
}
