// Tree-masked attention of draft-tree nodes on vLLM's paged CPU KV cache,
// in one call per layer (see cpu_tree_attention.py for why it exists and how
// it is built and loaded).
//
// For every kv head g and every query row r of that head's group (node i,
// query head g*rep + j) it computes
//   softmax over [context tokens 0..ctx-1 | step rows visible to node i]
// of q.k * scale, times V. The context is split into chunks of whole cache
// blocks; each (kv head, chunk) is one work item that keeps its partial
// maximum, sum and weighted values (flash-attention style), and a last pass
// merges the partials and the step rows. A work item reads its K/V blocks
// once for all the rows of its group (the rows share them), which is what a
// chain of ATen calls cannot do without copying the blocks out first.
//
// Plain C++ with GCC vector extensions (one register: 16 floats with AVX-512,
// 8 with AVX2), OpenMP from the libgomp torch already loaded.

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// A vf is one native register: 16 floats with AVX-512, 8 with AVX2. Wider
// GCC vectors than the ISA has are split by the compiler, and on AVX2 the
// 16-float version went through the stack (its disassembly mostly scalar
// and stack moves): 2.2 ms a layer for 8 nodes at a 1000-token context,
// 12x the AVX-512 build and slower than the ATen path.
#ifdef __AVX512F__
constexpr int W = 16;  // floats in a vf
constexpr int RB = 8;  // query rows per register block in the q.k loop
constexpr int PB = 4;  // ... and in the p.v loop (PB x 4 accumulators)
#else                  // AVX2: 16 registers of 8 floats
constexpr int W = 8;
constexpr int RB = 8;
constexpr int PB = 2;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

inline vf splat(float x) { return vf{} + x; }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load(const uint16_t* p) {  // bfloat16 -> float: the high half
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store1(float* p, float x) { *p = x; }
inline void store1(uint16_t* p, float x) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    *p = static_cast<uint16_t>((u >> 16) | ((u & 0xffff) ? 0x40 : 0));  // inf / NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0 (scores minus their maximum): Cody-Waite range reduction
// and Cephes' expf polynomial, branch-free so whole vectors go at once;
// relative error about 2e-7. Below -87 the result is flushed to 0.
inline vf vexp(vf x) {
  const vi under = x < splat(-87.0f);
  x = under ? splat(-87.0f) : x;
  vf t = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(t, vi);  // truncation ...
  vf nf = __builtin_convertvector(n, vf);
  const vi gt = nf > t;                   // ... made a floor
  n += gt;
  nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  p = p * scale;
  return under ? splat(0.0f) : p;
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// s[i, 0..w) = q_i . K^T[:, 0..w) for NR rows of q ([NR, D], contiguous) and
// a key block stored [D, bs] (kt points at its first token column): NR
// accumulators share every key vector.
template <int NR, typename T>
inline void qk_rows(const float* q, const T* kt, int64_t bs, int64_t D, float* s,
                    int64_t s_stride, int64_t w) {
  vf c[NR] = {};
  for (int64_t e = 0; e < D; ++e) {
    const vf kv = load(kt + e * bs);
    for (int i = 0; i < NR; ++i) c[i] += q[i * D + e] * kv;
  }
  for (int i = 0; i < NR; ++i)
    for (int64_t k = 0; k < w; ++k) s[i * s_stride + k] = c[i][k];
}

// acc[i, :] += sum_t p[i, t] * V[t, :] for NR rows over one value block
// [nt, D], NE vectors of D at a time: the rows share every value vector,
// every weight is loaded once per NE vectors.
template <int NR, int NE, typename T>
inline void pv_rows(const float* p, int64_t p_stride, const T* v, int64_t nt, int64_t D,
                    float* acc) {
  for (int64_t e = 0; e < D; e += NE * W) {
    vf c[NR][NE] = {};
    for (int64_t t = 0; t < nt; ++t) {
      vf vv[NE];
      for (int k = 0; k < NE; ++k) vv[k] = load(v + t * D + e + k * W);
      for (int i = 0; i < NR; ++i) {
        const float w = p[i * p_stride + t];
        for (int k = 0; k < NE; ++k) c[i][k] += w * vv[k];
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int k = 0; k < NE; ++k) {
        vf cur = load(acc + i * D + e + k * W) + c[i][k];
        std::memcpy(acc + i * D + e + k * W, &cur, sizeof cur);
      }
  }
}

template <int NR, typename T>
inline void pv_rows(const float* p, int64_t p_stride, const T* v, int64_t nt, int64_t D,
                    float* acc) {
  if (D % (4 * W) == 0)
    pv_rows<NR, 4>(p, p_stride, v, nt, D, acc);
  else
    pv_rows<NR, 1>(p, p_stride, v, nt, D, acc);
}

struct Args {
  const void* q;          // [n, H, D] (rows stride q_s0, heads stride q_s1)
  int64_t q_s0, q_s1;
  const void* k_cache;    // key block b of kv head h at b*k_s0 + h*k_s1
  const void* v_cache;    // value block likewise, token t dim e at t*D + e
  int64_t k_s0, k_s1, v_s0, v_s1;
  int k_transposed;       // key block [D, bs] (else [bs, D])
  const int32_t* block_ids;
  int64_t context_len, block_size;
  const void* k_step;     // [m, Hkv, D]: root + every node
  const void* v_step;
  int64_t ks_s0, ks_s1, vs_s0, vs_s1;
  const uint8_t* mask;    // [n, m] node row -> visible step rows
  int64_t mask_s0;
  void* out;              // [n, H, D]
  int64_t o_s0, o_s1;
  float scale;
  int64_t n, H, Hkv, D, m;
};

// One work item: kv head g over context blocks [b0, b1). Writes the item's
// per-row maximum, sum of exp and un-normalised weighted values.
template <typename T>
void context_chunk(const Args& a, const float* qs, int64_t g, int64_t b0, int64_t b1,
                   float* s, float* mx, float* l, float* acc) {
  const int64_t rep = a.H / a.Hkv, R = a.n * rep, D = a.D, bs = a.block_size;
  const int64_t t_end = std::min<int64_t>(b1 * bs, a.context_len);
  const int64_t C = t_end - b0 * bs;  // tokens in this chunk
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const float* qg = qs + g * R * D;  // the group's rows, scaled, [R, D]

  // scores s[R, C]
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t blk = a.block_ids[b];
    const T* kb = kc + blk * a.k_s0 + g * a.k_s1;
    const int64_t base = (b - b0) * bs;
    const int64_t nt = std::min<int64_t>(bs, a.context_len - b * bs);
    if (a.k_transposed) {
      // key block [D, bs]: W tokens per vector, RB rows share each load
      for (int64_t t0 = 0; t0 < nt; t0 += W) {
        const int64_t w = std::min<int64_t>(W, nt - t0);
        int64_t r0 = 0;
        for (; r0 + RB <= R; r0 += RB) qk_rows<RB>(qg + r0 * D, kb + t0, bs, D, s + r0 * C + base + t0, C, w);
        for (; r0 < R; ++r0) qk_rows<1>(qg + r0 * D, kb + t0, bs, D, s + r0 * C + base + t0, C, w);
      }
    } else {
      // key block [bs, D]: dot products along D
      for (int64_t t = 0; t < nt; ++t) {
        const T* kt = kb + t * D;
        for (int64_t r = 0; r < R; ++r) {
          vf c = {};
          for (int64_t e = 0; e < D; e += W) c += load(qg + r * D + e) * load(kt + e);
          s[r * C + base + t] = hsum(c);
        }
      }
    }
  }

  // softmax numerators, per row
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * C;
    float m = -INFINITY;
    for (int64_t t = 0; t < C; ++t) m = sr[t] > m ? sr[t] : m;
    vf sum = {};
    int64_t t = 0;
    for (; t + W <= C; t += W) {
      vf p = vexp(load(sr + t) - m);
      std::memcpy(sr + t, &p, sizeof p);
      sum += p;
    }
    float tail = 0.0f;
    if (t < C) {
      float buf[W];
      for (int64_t k = 0; k < W; ++k) buf[k] = t + k < C ? sr[t + k] - m : -INFINITY;
      vf p = vexp(load(buf));
      for (int64_t k = 0; t + k < C; ++k) {
        sr[t + k] = p[k];
        tail += p[k];
      }
    }
    mx[r] = m;
    l[r] = hsum(sum) + tail;
  }

  // acc[R, D] = p @ V, PB rows at a time sharing each value vector
  std::memset(acc, 0, sizeof(float) * R * D);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t blk = a.block_ids[b];
    const T* vb = vc + blk * a.v_s0 + g * a.v_s1;
    const int64_t base = (b - b0) * bs;
    const int64_t nt = std::min<int64_t>(bs, a.context_len - b * bs);
    int64_t r0 = 0;
    for (; r0 + PB <= R; r0 += PB) pv_rows<PB>(s + r0 * C + base, C, vb, nt, D, acc + r0 * D);
    for (; r0 < R; ++r0) pv_rows<1>(s + r0 * C + base, C, vb, nt, D, acc + r0 * D);
  }
}

// Merge the chunks' partials with the step rows (root + nodes) for one
// (kv head, row) and write the output row.
template <typename T>
void finish_row(const Args& a, const float* qs, int64_t g, int64_t r, int64_t nchunks,
                const float* mx, const float* l, const float* acc, float* tmp) {
  const int64_t rep = a.H / a.Hkv, R = a.n * rep, D = a.D;
  const int64_t node = r / rep, head = g * rep + r % rep;
  const float* qr = qs + (g * R + r) * D;
  const T* ks = static_cast<const T*>(a.k_step);
  const T* vs = static_cast<const T*>(a.v_step);
  const uint8_t* vis = a.mask + node * a.mask_s0;

  float* sc = tmp;  // step scores [m]
  float m = -INFINITY;
  for (int64_t j = 0; j < a.m; ++j) {
    if (!vis[j]) continue;
    vf c = {};
    const T* kj = ks + j * a.ks_s0 + g * a.ks_s1;
    for (int64_t e = 0; e < D; e += W) c += load(qr + e) * load(kj + e);
    sc[j] = hsum(c);
    m = sc[j] > m ? sc[j] : m;
  }
  for (int64_t c = 0; c < nchunks; ++c) {
    const float mc = mx[(g * nchunks + c) * R + r];
    m = mc > m ? mc : m;
  }
  float* o = tmp + a.m;  // [D]
  std::memset(o, 0, sizeof(float) * D);
  float total = 0.0f;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t idx = (g * nchunks + c) * R + r;
    const float w = std::exp(mx[idx] - m);
    total += l[idx] * w;
    const float* ac = acc + idx * D;
    for (int64_t e = 0; e < D; e += W) {
      vf cur = load(o + e) + load(ac + e) * w;
      std::memcpy(o + e, &cur, sizeof cur);
    }
  }
  for (int64_t j = 0; j < a.m; ++j) {
    if (!vis[j]) continue;
    const float w = std::exp(sc[j] - m);
    total += w;
    const T* vj = vs + j * a.vs_s0 + g * a.vs_s1;
    for (int64_t e = 0; e < D; e += W) {
      vf cur = load(o + e) + load(vj + e) * w;
      std::memcpy(o + e, &cur, sizeof cur);
    }
  }
  T* dst = static_cast<T*>(a.out) + node * a.o_s0 + head * a.o_s1;
  const float inv = 1.0f / total;
  for (int64_t e = 0; e < D; ++e) store1(dst + e, o[e] * inv);
}

template <typename T>
int run(const Args& a, int64_t blocks_per_chunk) {
  const int64_t rep = a.H / a.Hkv, R = a.n * rep, D = a.D, bs = a.block_size;
  const int64_t nblk = (a.context_len + bs - 1) / bs;
  const int64_t nchunks = nblk == 0 ? 0 : (nblk + blocks_per_chunk - 1) / blocks_per_chunk;
  const int64_t items = a.Hkv * nchunks;
  const int64_t C = blocks_per_chunk * bs;

  // queries in float, scaled, grouped by kv head: qs[g][node*rep + j][D]
  std::vector<float> qs(a.Hkv * R * D);
  const T* q = static_cast<const T*>(a.q);
  for (int64_t i = 0; i < a.n; ++i)
    for (int64_t h = 0; h < a.H; ++h) {
      float* dst = qs.data() + ((h / rep) * R + i * rep + h % rep) * D;
      const T* src = q + i * a.q_s0 + h * a.q_s1;
      for (int64_t e = 0; e < D; ++e) dst[e] = load1(src + e) * a.scale;
    }
  std::vector<float> mx(items * R), l(items * R), acc(items * R * D);

#pragma omp parallel
  {
    std::vector<float> s(R * C);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t g = it / nchunks, c = it % nchunks;
      const int64_t b0 = c * blocks_per_chunk;
      const int64_t b1 = std::min(nblk, b0 + blocks_per_chunk);
      context_chunk<T>(a, qs.data(), g, b0, b1, s.data(), mx.data() + it * R,
                       l.data() + it * R, acc.data() + it * R * D);
    }
    std::vector<float> tmp(a.m + D);
#pragma omp for schedule(static)
    for (int64_t gr = 0; gr < a.Hkv * R; ++gr)
      finish_row<T>(a, qs.data(), gr / R, gr % R, nchunks, mx.data(), l.data(),
                    acc.data(), tmp.data());
  }
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (q, caches, step K/V and out alike).
// Returns 0 on success, a negative code when the call is not supported (the
// caller then takes its torch path).
int specplug_tree_attention(const Args* a, int dtype, int64_t blocks_per_chunk) {
  if (a->D % W != 0 || a->H % a->Hkv != 0 || a->n <= 0 || blocks_per_chunk <= 0) return -1;
  if (a->k_transposed && a->block_size % W != 0) return -2;
  if (dtype == 0) return run<float>(*a, blocks_per_chunk);
  if (dtype == 1) return run<uint16_t>(*a, blocks_per_chunk);
  return -3;
}

int specplug_tree_attention_abi() { return static_cast<int>(sizeof(Args)); }
}
