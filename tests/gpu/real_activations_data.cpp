#include "gpu/real_activations_data.hpp"

#include <cstring>

#include "oscar/io/plan_file.hpp"
#include "oscar/io/safetensors.hpp"

namespace oscar::testing {

namespace {

std::string read_f32(const io::SafetensorsFile& file, const std::string& name, std::vector<int64_t>& shape,
                     std::vector<float>& out) {
  const io::TensorInfo* info = file.find(name);
  if (info == nullptr) return file.source() + " has no tensor " + name;
  if (info->dtype != io::DType::kF32) return name + " is not F32";
  shape = info->shape;
  auto bytes = file.read_bytes(*info);
  if (!bytes.ok()) return bytes.status().to_string();
  out.resize(bytes->size() / sizeof(float));
  std::memcpy(out.data(), bytes->data(), out.size() * sizeof(float));
  return "";
}

}  // namespace

std::string load_real_activations(const std::string& dir, const std::vector<int>& layers, RealActivations& out) {
  auto file = io::SafetensorsFile::open(dir + "/activations.safetensors");
  if (!file.ok()) return file.status().to_string();
  auto plan = io::load_plan(dir + "/plan.safetensors");
  if (!plan.ok()) return plan.status().to_string();
  out = RealActivations{};
  out.layers = layers;
  for (int l : layers) {
    std::vector<int64_t> qs, ks, vs;
    std::vector<float> q, k, v;
    for (auto [what, shape, data] : {std::tuple{"q", &qs, &q}, std::tuple{"k", &ks, &k}, std::tuple{"v", &vs, &v}}) {
      const std::string e = read_f32(*file, io::layer_tensor_name(l, what), *shape, *data);
      if (!e.empty()) return e;
    }
    if (qs.size() != 3 || ks != vs || ks.size() != 3 || qs[0] != ks[0] || qs[2] != ks[2]) {
      return "layer " + std::to_string(l) + ": q/k/v shapes disagree";
    }
    out.tokens = qs[0], out.num_qo_heads = int(qs[1]), out.num_kv_heads = int(ks[1]), out.head_dim = int(ks[2]);
    if (plan->head_dim != out.head_dim) return "the plan's head_dim differs from the activations'";
    if (l >= plan->num_layers) return "the plan has no layer " + std::to_string(l);
    const io::PlanLayer& p = plan->layers[size_t(l)];
    out.quantizers.push_back({p.k_rotation, p.v_rotation, p.k_clip_ratio, p.v_clip_ratio});
    out.q.push_back(std::move(q));
    out.k.push_back(std::move(k));
    out.v.push_back(std::move(v));
  }
  return "";
}

}  // namespace oscar::testing
