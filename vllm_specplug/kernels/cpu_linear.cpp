// y[M, N] = x[M, K] @ w[N, K]^T for a few rows (decode and tree-verify
// steps), on weights packed once into panels of NP output columns (see
// cpu_linear.py for why it exists and how it is checked before use).
//
// Each output element is one chain of fused multiply-adds over k = 0..K-1 in
// order, starting from zero: the order vLLM's oneDNN path uses for the
// shapes where the load-time check finds them bitwise equal (a row's result
// then does not depend on how many rows share the call, which is what keeps
// float32 tree verification token-identical). The k loop is cut into chunks
// of KC with the partial sums parked in y between chunks -- the same chain,
// so the same bits -- so that a panel's chunk, read from memory by the first
// block of rows, is still in L1 for the next blocks.

#include <omp.h>

#include <cstdint>
#include <cstring>

namespace {

#ifdef __AVX512F__
constexpr int W = 16;  // floats in one register
constexpr int MB = 8;  // rows per block: MB x NV accumulators in registers
#else                  // AVX2: 16 registers of 8 floats; 6 x 2 accumulators
constexpr int W = 8;
constexpr int MB = 6;
#endif
constexpr int NV = 2;            // registers of columns per panel
constexpr int NP = W * NV;       // columns per panel
constexpr int64_t KC = 128;      // k per chunk: NP x KC floats stay in L1
typedef float vf __attribute__((vector_size(W * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// R rows of one panel over k in [k0, k1), continuing the chains parked in y.
template <int R>
void rows(const float* x, int64_t K, const float* wp, int64_t k0, int64_t k1, float* y,
          int64_t N) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = k0 == 0 ? vf{} : load(y + r * N + v * W);
  for (int64_t k = k0; k < k1; ++k) {
    vf w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load(wp + k * NP + v * W);
    for (int r = 0; r < R; ++r) {
      const vf a = vf{} + x[r * K + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * w[v];  // one FMA (-ffp-contract=fast)
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(y + r * N + v * W, acc[r][v]);
}

// The last r < MB rows, as one block of exactly r.
template <int R>
void rest(const float* x, int64_t K, const float* wp, int64_t k0, int64_t k1, float* y,
          int64_t N, int64_t r) {
  if constexpr (R > 0) {
    if (r == R) return rows<R>(x, K, wp, k0, k1, y, N);
    rest<R - 1>(x, K, wp, k0, k1, y, N, r);
  }
}

}  // namespace

extern "C" {

int specplug_linear_panel() { return NP; }

// wp[N / NP][K][NP] from w[N, K] (N a multiple of NP).
void specplug_linear_pack(const float* w, int64_t N, int64_t K, float* wp) {
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < N / NP; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < NP; ++j) wp[(p * K + k) * NP + j] = w[(p * NP + j) * K + k];
}

// x[M, K] contiguous, y[M, N] contiguous; panels split across the threads.
void specplug_linear(const float* x, int64_t M, int64_t K, const float* wp, int64_t N,
                     float* y) {
  const int64_t P = N / NP;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const float* w = wp + p * K * NP;
    float* yp = y + p * NP;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t k1 = k0 + KC < K ? k0 + KC : K;
      int64_t m = 0;
      for (; m + MB <= M; m += MB) rows<MB>(x + m * K, K, w, k0, k1, yp + m * N, N);
      if (m < M) rest<MB - 1>(x + m * K, K, w, k0, k1, yp + m * N, N, M - m);
    }
  }
}
}
