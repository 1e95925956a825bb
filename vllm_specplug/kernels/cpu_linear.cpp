// y[M, N] = x[M, K] @ w[N, K]^T for a few rows (decode and tree-verify
// steps), on weights packed once into panels of NP output columns (see
// cpu_linear.py for why it exists and how it is checked before use).
//
// Each output element is summed in the order vLLM's oneDNN path uses for the
// shapes where the load-time check finds them bitwise equal: k is cut into
// blocks of KB (oneDNN's brgemm: 1024 here), each block one chain of fused
// multiply-adds over its k in order starting from zero, and the blocks'
// sums added in order (KB <= 0: one chain over all of K). A row's result
// then does not depend on how many rows share the call, which is what keeps
// float32 tree verification token-identical. Within a block the k loop is
// cut into chunks of KC with the partial chain parked between chunks -- the
// same chain, so the same bits -- so that a panel's chunk, read from memory
// by the first block of rows, is still in cache for the next blocks of rows.

#include <omp.h>

#include <cstdint>
#include <cstring>

namespace {

#ifdef __AVX512F__
constexpr int W = 16;   // floats in one register
constexpr int MB = 12;  // rows per block: MB x NV accumulators in registers (24 of
                        // 32; with 8, a 9-12-row step paid a second, latency-bound
                        // pass over each panel: ~20 % slower at 9-12 rows)
#else                  // AVX2: 16 registers of 8 floats; 6 x 2 accumulators
constexpr int W = 8;
constexpr int MB = 6;
#endif
constexpr int NV = 2;            // registers of columns per panel
constexpr int NP = W * NV;       // columns per panel
constexpr int64_t KC = 512;      // k per chunk: NP x KC floats stay in L2 for the next
                                 // block of rows; shorter chunks (128) park and reload
                                 // every chain more often and cost ~10 % at every row
                                 // count (AVX-512 and AVX2 alike)
constexpr int64_t PF = 64;       // k ahead to prefetch: the panel streams in while
                                 // the FMAs run (~5-10 % at 9-17 rows on AVX2)
constexpr int LINE = 16;         // floats in a cache line: AVX-512's 32-column panel row
                                 // spans two, and prefetching only the first left the
                                 // kernel slower than oneDNN at 3-8 rows
constexpr int MAX_M = 64;        // rows one call may take (cpu_linear.py sends <= 24)
typedef float vf __attribute__((vector_size(W * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// Where R rows of one panel continue their chains from (``in``; nullptr:
// start from zero) and go to (``out``); ``accumulate``: a block after the
// first ends here, its chain is added to what ``out`` holds (the earlier
// blocks' sum).
struct Io {
  const float* in;
  int64_t ldi;
  float* out;
  int64_t ldo;
  bool accumulate;
  Io at(int64_t m) const { return {in ? in + m * ldi : nullptr, ldi, out + m * ldo, ldo, accumulate}; }
};

// R rows of one panel over k in [k0, k1).
template <int R>
void rows(const float* x, int64_t K, const float* wp, int64_t k0, int64_t k1, Io io,
          bool prefetch) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = io.in ? load(io.in + r * io.ldi + v * W) : vf{};
  for (int64_t k = k0; k < k1; ++k) {
    vf w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load(wp + k * NP + v * W);
    if (prefetch)  // every cache line of the panel's row k + PF (2 with AVX-512)
      for (int l = 0; l < NP; l += LINE) __builtin_prefetch(wp + (k + PF) * NP + l, 0, 3);
    for (int r = 0; r < R; ++r) {
      const vf a = vf{} + x[r * K + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * w[v];  // one FMA (-ffp-contract=fast)
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      vf s = acc[r][v];
      if (io.accumulate) s = load(io.out + r * io.ldo + v * W) + s;  // a plain add: blocks' sums
      store(io.out + r * io.ldo + v * W, s);
    }
}

// The last r < MB rows, as one block of exactly r.
template <int R>
void rest(const float* x, int64_t K, const float* wp, int64_t k0, int64_t k1, Io io,
          bool prefetch, int64_t r) {
  if constexpr (R > 0) {
    if (r == R) return rows<R>(x, K, wp, k0, k1, io, prefetch);
    rest<R - 1>(x, K, wp, k0, k1, io, prefetch, r);
  }
}

}  // namespace

extern "C" {

int specplug_linear_panel() { return NP; }
int specplug_linear_max_rows() { return MAX_M; }

// wp[N / NP][K][NP] from w[N, K] (N a multiple of NP).
void specplug_linear_pack(const float* w, int64_t N, int64_t K, float* wp) {
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < N / NP; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < NP; ++j) wp[(p * K + k) * NP + j] = w[(p * NP + j) * K + k];
}

// x[M, K] contiguous (M <= MAX_M), y[M, N] contiguous; panels split across
// the threads; KB as above.
void specplug_linear(const float* x, int64_t M, int64_t K, const float* wp, int64_t N,
                     float* y, int64_t KB) {
  const int64_t P = N / NP;
  if (KB <= 0 || KB > K) KB = K;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) {
    const float* w = wp + p * K * NP;
    float* yp = y + p * NP;
    float part[MAX_M * NP];  // the chain of a block after the first, between chunks
    for (int64_t k0 = 0; k0 < K;) {
      const int64_t b0 = k0 - k0 % KB, b1 = b0 + KB < K ? b0 + KB : K;  // this block
      const int64_t k1 = k0 + KC < b1 ? k0 + KC : b1;
      // The first block's chain is parked in y itself; later ones in part,
      // added to y when they end.
      float* park = b0 == 0 ? yp : part;
      const int64_t ld = b0 == 0 ? N : NP;
      const bool ends_later_block = k1 == b1 && b0 > 0;
      const Io io{k0 == b0 ? nullptr : park, ld, ends_later_block ? yp : park,
                  ends_later_block ? N : ld, ends_later_block};
      int64_t m = 0;
      for (; m + MB <= M; m += MB) rows<MB>(x + m * K, K, w, k0, k1, io.at(m), m == 0);
      if (m < M) rest<MB - 1>(x + m * K, K, w, k0, k1, io.at(m), m == 0, M - m);
      k0 = k1;
    }
  }
}
}
