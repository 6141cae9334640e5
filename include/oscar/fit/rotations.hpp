// The rotation fitters (method.md §2): OSCAR's R = U·H·P_br from a target second moment, and
// the baselines the library produces for side-by-side evaluation. float64 throughout; the plan
// stores the result as float32.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <Eigen/Dense>

#include "oscar/core/status.hpp"
#include "oscar/quant/format.hpp"

namespace oscar::fit {

enum class RotationMethod {
  kOscar,           // U·H·P_br, U = eig(C_K) for keys, eig(C_V) for values
  kHadamard,        // H (QuaRot-style, data-oblivious)
  kRandomHadamard,  // D·H, D = random ±1 diagonal (seeded)
  kIdentity,        // no rotation
  kKtk,             // eig(KᵀK)·H·P_br for keys, eig(VᵀV)·H·P_br for values (authors' ablation)
};

inline const char* to_string(RotationMethod m) {
  switch (m) {
    case RotationMethod::kOscar: return "oscar";
    case RotationMethod::kHadamard: return "hadamard";
    case RotationMethod::kRandomHadamard: return "random_hadamard";
    case RotationMethod::kIdentity: return "identity";
    case RotationMethod::kKtk: return "ktk";
  }
  return "?";
}

inline Result<RotationMethod> parse_rotation_method(std::string_view name) {
  for (RotationMethod m : {RotationMethod::kOscar, RotationMethod::kHadamard, RotationMethod::kRandomHadamard,
                           RotationMethod::kIdentity, RotationMethod::kKtk}) {
    if (name == to_string(m)) return m;
  }
  return invalid_argument("unknown rotation method \"" + std::string(name) +
                          "\" (expected oscar, hadamard, random_hadamard, identity or ktk)");
}

// The normalized Sylvester Hadamard matrix, H_ij = (-1)^popcount(i&j) / sqrt(d), in double
// (the same matrix as oscar::hadamard_entry, without float rounding of 1/sqrt(d)).
inline Eigen::MatrixXd hadamard_matrix(int d) {
  Eigen::MatrixXd h(d, d);
  const double norm = 1.0 / std::sqrt(static_cast<double>(d));
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) h(i, j) = (__builtin_popcount(static_cast<unsigned>(i & j)) & 1) ? -norm : norm;
  }
  return h;
}

// perm[j] = j with its log2(d) bits reversed. An involution (perm[perm[j]] = j).
inline std::vector<int> bit_reversal_permutation(int d) {
  int bits = 0;
  while ((1 << bits) < d) ++bits;
  std::vector<int> perm(d);
  for (int j = 0; j < d; ++j) {
    int r = 0;
    for (int b = 0; b < bits; ++b) r |= ((j >> b) & 1) << (bits - 1 - b);
    perm[j] = r;
  }
  return perm;
}

struct SpectralRotation {
  Eigen::MatrixXd rotation;     // d×d, orthogonal
  Eigen::VectorXd eigenvalues;  // of the target, descending
};

// R = U·H·P_br. U holds the target's eigenvectors ordered by eigenvalue rank, descending
// (Eigen returns them ascending; we reverse). H spreads every eigen-direction evenly over all
// coordinates, so diag(RᵀCR) = tr(C)/d exactly, whatever the permutation. P_br reorders the
// columns of U·H by bit reversal: column j of R is column bitrev(j) of U·H. In U·H, the
// coordinates whose indices differ in high bits are the ones correlated by the big eigenvalues
// (the Walsh transform of a descending spectrum peaks at the high-bit sequencies); bit reversal
// moves those pairs into the same quantization group, so that a group's range follows one
// direction instead of many. With one group per row the quantizer is permutation-equivariant
// and P_br changes nothing (tested). Our reading of the method (derived; the paper body was
// not available): the keying is on eigenvalue rank, so it does not depend on Eigen's order.
inline Result<SpectralRotation> spectral_rotation(const Eigen::MatrixXd& target, bool bit_reversal = true) {
  const int d = static_cast<int>(target.rows());
  if (target.cols() != d || !is_power_of_two(d)) {
    return invalid_argument("spectral_rotation: target must be square with a power-of-two size, got " +
                            std::to_string(target.rows()) + "x" + std::to_string(target.cols()));
  }
  if (!target.allFinite()) return invalid_argument("spectral_rotation: target has NaN or Inf entries");
  // A second moment without a positive diagonal entry is zero (no calibration tokens reached
  // it, or every activation was 0): every basis diagonalizes it, so its eigenvectors say nothing.
  if (!(target.diagonal().maxCoeff() > 0.0)) {
    return invalid_argument("spectral_rotation: target is zero (no calibration tokens, or all-zero activations)");
  }
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(target);
  if (solver.info() != Eigen::Success) return invalid_argument("spectral_rotation: eigen-decomposition failed");
  SpectralRotation out;
  const Eigen::MatrixXd u = solver.eigenvectors().rowwise().reverse();  // descending
  out.eigenvalues = solver.eigenvalues().reverse();
  const Eigen::MatrixXd uh = u * hadamard_matrix(d);
  if (!bit_reversal) {
    out.rotation = uh;
  } else {
    const std::vector<int> perm = bit_reversal_permutation(d);
    out.rotation.resize(d, d);
    for (int j = 0; j < d; ++j) out.rotation.col(j) = uh.col(perm[j]);
  }
  return Result<SpectralRotation>(std::move(out));
}

inline Eigen::MatrixXd random_hadamard(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Eigen::MatrixXd r = hadamard_matrix(d);
  for (int i = 0; i < d; ++i) {
    if (rng() & 1) r.row(i) = -r.row(i);  // D·H: flip the sign of input coordinate i
  }
  return r;
}

// Max |R·Rᵀ - I| entry: the orthogonality check used by plan files and tests.
inline double orthogonality_error(const Eigen::MatrixXd& r) {
  return (r * r.transpose() - Eigen::MatrixXd::Identity(r.rows(), r.rows())).cwiseAbs().maxCoeff();
}

// max λ / mean λ of a second moment: how far it is from isotropic (1 = flat spectrum); the
// summary table prints it as the "eigen-spectrum spread".
inline double spectrum_spread(const Eigen::VectorXd& eigenvalues) {
  const double mean = eigenvalues.mean();
  return mean > 0 ? eigenvalues.maxCoeff() / mean : 0.0;
}

}  // namespace oscar::fit
