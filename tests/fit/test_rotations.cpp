// Rotation fitters: orthogonality, OSCAR's equalized diagonal, the bit-reversal permutation,
// and the trace identity behind J_K.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <Eigen/Dense>

#include "fit/fit_test_util.hpp"
#include "oscar/fit/clip_search.hpp"
#include "oscar/fit/fit_plan.hpp"
#include "oscar/fit/rotations.hpp"
#include "oscar/rotate/hadamard.hpp"

using namespace oscar;
using namespace oscar::fit;

namespace {
Eigen::MatrixXd random_spd(int d, uint64_t seed) {
  testing::AnisotropicSource src(d, seed, seed + 1, 0.9);
  Eigen::MatrixXd c = Eigen::MatrixXd::Zero(d, d);
  std::vector<float> row(d);
  for (int t = 0; t < 4 * d; ++t) {
    src.row(row.data());
    const Eigen::RowVectorXd r = Eigen::Map<Eigen::RowVectorXf>(row.data(), d).cast<double>();
    c += r.transpose() * r;
  }
  return c / (4.0 * d);
}
// A d×d orthogonal product in float64 is orthogonal to ~d·eps ≈ 3e-14 for d = 256.
constexpr double kOrthoTol = 1e-12;
}  // namespace

TEST_CASE("every fitter returns an orthogonal matrix") {
  for (int d : {64, 128, 256}) {
    CAPTURE(d);
    const Eigen::MatrixXd c = random_spd(d, d);
    CHECK(orthogonality_error(hadamard_matrix(d)) < kOrthoTol);
    CHECK(orthogonality_error(random_hadamard(d, 5)) < kOrthoTol);
    auto s = spectral_rotation(c);
    REQUIRE(s.ok());
    CHECK(orthogonality_error(s->rotation) < kOrthoTol);
    // Eigenvalues come out descending.
    for (int i = 1; i < d; ++i) CHECK(s->eigenvalues[i] <= s->eigenvalues[i - 1]);
  }
  // random_hadamard is seeded: same seed, same matrix; another seed, another one.
  CHECK(random_hadamard(64, 7) == random_hadamard(64, 7));
  CHECK(random_hadamard(64, 7) != random_hadamard(64, 8));
  // The double Hadamard equals the runtime's float entries to float rounding.
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 64; ++j) CHECK(std::abs(hadamard_matrix(64)(i, j) - hadamard_entry(i, j, 64)) < 1e-7);
  }
}

TEST_CASE("R = U·H equalizes the diagonal of RᵀCR to tr(C)/d, with or without P_br") {
  for (int d : {64, 128}) {
    const Eigen::MatrixXd c = random_spd(d, 100 + d);
    for (bool br : {false, true}) {
      auto s = spectral_rotation(c, br);
      REQUIRE(s.ok());
      const Eigen::MatrixXd m = s->rotation.transpose() * c * s->rotation;
      const double target = c.trace() / d;
      // Exact in exact arithmetic; float64 rounding of two d×d products: 1e-12 relative.
      CHECK((m.diagonal().array() - target).abs().maxCoeff() / target < 1e-12);
      // While the unrotated diagonal is far from flat (the test would be vacuous otherwise).
      CHECK((c.diagonal().array() - target).abs().maxCoeff() / target > 0.1);
    }
  }
}

TEST_CASE("the bit-reversal permutation is an involution keyed on eigenvalue rank") {
  const std::vector<int> p = bit_reversal_permutation(8);
  CHECK(p == std::vector<int>{0, 4, 2, 6, 1, 5, 3, 7});
  for (int d : {64, 128, 256}) {
    const std::vector<int> q = bit_reversal_permutation(d);
    std::vector<int> sorted = q;
    std::sort(sorted.begin(), sorted.end());
    for (int j = 0; j < d; ++j) {
      CHECK(sorted[j] == j);
      CHECK(q[q[j]] == j);
    }
  }
  // R with P_br is U·H with its columns permuted, U ordered by descending eigenvalue.
  const int d = 64;
  const Eigen::MatrixXd c = random_spd(d, 9);
  auto plain = spectral_rotation(c, false);
  auto br = spectral_rotation(c, true);
  const std::vector<int> q = bit_reversal_permutation(d);
  for (int j = 0; j < d; ++j) CHECK(br->rotation.col(j) == plain->rotation.col(q[j]));
  // First column of U (before H): the top eigenvector, so U·H's column 0 = u_top-weighted mix.
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(c);
  const Eigen::VectorXd top = es.eigenvectors().col(d - 1);
  const Eigen::MatrixXd u = plain->rotation * hadamard_matrix(d);  // H is its own inverse
  CHECK(std::abs(std::abs(u.col(0).dot(top)) - 1.0) < 1e-10);
}

TEST_CASE("trace identity: ‖Q(K−K̂)ᵀ‖² = tr(RᵀC_QR·EᵀE) with the real quantization residual") {
  const ModelShape s{1, 4, 1, 64};
  const testing::Activations x = testing::make_activations(s, 200, 11);
  const int d = 64;
  Eigen::MatrixXd q(200 * 4, d);
  for (int r = 0; r < 200 * 4; ++r) {
    for (int i = 0; i < d; ++i) q(r, i) = x.q[r * d + i];
  }
  const Eigen::MatrixXd cq = q.transpose() * q;
  auto rot = spectral_rotation(cq / (200.0 * 4));
  const std::vector<float> rf = detail::to_f32(rot->rotation);
  const Eigen::MatrixXd r = detail::from_f32(rf, d);
  auto rows = rotate_rows(x.k.data(), 200, 1, d, rf);
  REQUIRE(rows.ok());
  for (float rho : {1.0f, 0.9f}) {
    const RowMatrixXd e = quantization_residual(*rows, 0, clip_rank(rho, d));  // rotated basis
    // Left: the logit error of every query against every key, in the original basis (Eᵀ un-rotated).
    const Eigen::MatrixXd logits = q * (e * r.transpose()).transpose();
    const double lhs = logits.squaredNorm();
    const double rhs = (r.transpose() * cq * r * (e.transpose() * e)).trace();
    // Both sides sum 1.6e5 non-negative-ish terms in float64: agreement to 1e-10 relative.
    CHECK(std::abs(lhs - rhs) / lhs < 1e-10);
    CHECK(lhs > 0);
  }
}
